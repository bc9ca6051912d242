//! Ingest + proof of one recorded-shape sglang reply, measured once (issue 7's entry point).
//!
//! `cargo run --release -p engy-miner --example ingest_bench -- --tokens N --hidden H [--stream]`
//!
//! Generates a `/generate` reply of N output tokens × H hidden floats (bf16-exact decimals, as
//! sglang's orjson writes them; element 0 a 1-row prefill block), then runs the miner's real
//! path on its bytes: the single-pass scan to bf16 rows, then the TOPLOC proof (topk 128,
//! 32 rows per batch). Prints one JSON line:
//! `{"tokens":N,"hidden":H,"cpu_s":…,"tokens_per_cpu_s":…,"peak_rss_mb":…}`.
//! CPU time is this thread's (`/proc/thread-self/schedstat`), peak RSS is `VmHWM`.
use engy_core::toploc::{build_proofs_base64, Dtype, Params};
use engy_miner::scan::{scan_reply, HiddenMode};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn thread_cpu_s() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .next()
                .and_then(|x| x.parse::<f64>().ok())
        })
        .map(|ns| ns / 1e9)
        .unwrap_or(f64::NAN)
}

fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse::<f64>().ok())
            })
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

fn value(seed: &mut u64) -> f64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let r = *seed >> 11;
    let mant = 128 + (r & 0x7f) as i32;
    let exp = ((r >> 8) % 12) as i32 - 16;
    let v = f64::from(mant) * 2f64.powi(exp);
    if (r >> 20) & 1 == 1 {
        -v
    } else {
        v
    }
}

fn main() {
    let tokens = arg("--tokens", 1024).max(1);
    let hidden = arg("--hidden", 2048).max(1);
    let stream = std::env::args().any(|a| a == "--stream");
    let mut seed = 42u64;
    let mut body = String::with_capacity(tokens * hidden * 12 + 4096);
    if stream {
        body.push_str("data: ");
    }
    body.push_str("{\"text\":\"x\",\"output_ids\":[");
    body.push_str(
        &(0..tokens)
            .map(|i| (i % 1000).to_string())
            .collect::<Vec<_>>()
            .join(","),
    );
    body.push_str(
        "],\"meta_info\":{\"id\":\"engy-bench\",\"finish_reason\":{\"type\":\"length\",\"length\":",
    );
    body.push_str(&tokens.to_string());
    body.push_str("},\"prompt_tokens\":1,\"output_token_logprobs\":[");
    body.push_str(
        &(0..tokens)
            .map(|i| format!("[-0.5,{},null]", i % 1000))
            .collect::<Vec<_>>()
            .join(","),
    );
    body.push_str("],\"completion_tokens\":");
    body.push_str(&tokens.to_string());
    body.push_str(",\"cached_tokens\":0,\"hidden_states\":[");
    for t in 0..tokens {
        if t > 0 {
            body.push(',');
        }
        body.push_str(if t == 0 { "[[" } else { "[" });
        for j in 0..hidden {
            if j > 0 {
                body.push(',');
            }
            body.push_str(&value(&mut seed).to_string());
        }
        body.push_str(if t == 0 { "]]" } else { "]" });
    }
    body.push_str("],\"dp_rank\":null}}");
    let bytes = body.into_bytes();
    let line: &[u8] = if stream {
        bytes.get(6..).unwrap_or(&[])
    } else {
        &bytes
    };

    let t0 = thread_cpu_s();
    let reply = scan_reply(line, HiddenMode::Always, false).expect("scan");
    let rows = reply.rows.expect("rows");
    let t_scan = thread_cpu_s() - t0;
    let elements: Vec<&[u16]> = rows.bits.chunks_exact(rows.width).collect();
    let params = Params {
        topk: 128,
        decode_batching_size: 32,
        skip_prefill: true,
    };
    let proofs = build_proofs_base64(&elements, Dtype::Bf16, &params).expect("proofs");
    let cpu = thread_cpu_s() - t0;
    assert_eq!(rows.n_rows, tokens);
    assert_eq!(proofs.len(), tokens.div_ceil(32));
    println!(
        "{{\"tokens\":{tokens},\"hidden\":{hidden},\"bytes\":{},\"scan_cpu_s\":{t_scan:.4},\"cpu_s\":{cpu:.4},\"tokens_per_cpu_s\":{:.0},\"peak_rss_mb\":{:.1}}}",
        line.len(),
        tokens as f64 / cpu,
        peak_rss_mb()
    );
}
