//! Ingest + proof of one recorded-shape sglang reply, measured once (issue 7's entry point).
//!
//! ```text
//! cargo run --release -p engy-miner --example ingest_bench -- --tokens N --hidden H [--stream] [--chunk BYTES]
//! ```
//!
//! Builds a `/generate` reply of N output tokens × H hidden floats (bf16-exact decimals as
//! sglang's orjson writes them; element 0 the 1-row prefill block of engy's serve hook;
//! `--stream`: the final SSE event then `data: [DONE]`), and hands its bytes to the miner's
//! real path in chunks of `--chunk` bytes (default 65536) as a socket would: the streaming
//! scanner ([`scan_reply_from`] / [`SseReader`]) writes bf16 rows into the proof
//! accumulator ([`ProofAcc`]), which proves every 32-row batch as it completes (topk 128).
//! The body is generated as it is read (rows copied from a pool of 97), never held whole.
//!
//! Prints one JSON line:
//! `{"tokens":N,"hidden":H,"cpu_s":…,"tokens_per_cpu_s":…,"peak_rss_mb":…,…}` where
//! `cpu_s` is the process's user + system CPU time of the ingest (`getrusage`, including
//! the copy of each chunk, as reading a socket costs), `peak_rss_mb` is `VmHWM` (the peak
//! is reset through `/proc/self/clear_refs` just before the ingest when the kernel allows,
//! `hwm_reset`), `base_rss_mb` the RSS just before and `extra_rss_mb` the difference.
use std::process::ExitCode;

use engy_core::toploc::Params;
use engy_miner::proof::ProofAcc;
use engy_miner::scan::{scan_reply_from, HiddenMode, ReplySource, ScanError, SseReader};

#[path = "../benches/harness/mod.rs"]
mod harness;
#[path = "../benches/support/mod.rs"]
mod support;
use harness::arg;

/// The generated reply, read chunk by chunk.
struct Gen<'a>(support::Chunks<'a>);

impl ReplySource for Gen<'_> {
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
        Ok(self.0.fill(buf))
    }
}

fn status_kb(key: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse::<f64>().ok())
            })
        })
        .unwrap_or(f64::NAN)
}

async fn ingest(
    reply: &support::Reply,
    chunk: usize,
    stream: bool,
) -> Result<(usize, usize), String> {
    let mut acc = ProofAcc::new(Params::ENGY);
    let src = Gen(reply.chunks(chunk));
    let r = if stream {
        let mut rd = SseReader::new(src, usize::MAX);
        let ev = rd
            .next_event(HiddenMode::IfFinished, true, &mut acc)
            .await
            .map_err(|e| e.to_string())?
            .ok_or("no event")?;
        if rd
            .next_event(HiddenMode::IfFinished, true, &mut acc)
            .await
            .map_err(|e| e.to_string())?
            .is_some()
        {
            return Err("an event after the final one".into());
        }
        ev
    } else {
        scan_reply_from(src, HiddenMode::Always, false, usize::MAX, &mut acc)
            .await
            .map_err(|e| e.to_string())?
    };
    let rows = r.rows.ok_or("no hidden_states")?;
    if rows.n_rows != acc.rows() || rows.ragged.is_some() {
        return Err(format!("{} rows scanned, {} kept", rows.n_rows, acc.rows()));
    }
    let n = acc.rows();
    let proofs = acc.finish().map_err(|e| e.to_string())?;
    Ok((n, proofs.len()))
}

fn main() -> ExitCode {
    if std::env::args().any(|a| a == "--help" || a == "-h") {
        println!("ingest_bench --tokens N --hidden H [--stream] [--chunk BYTES]");
        return ExitCode::SUCCESS;
    }
    let tokens = arg("--tokens").unwrap_or(1024).max(1);
    let hidden = arg("--hidden").unwrap_or(2048).max(1);
    let chunk = arg("--chunk").unwrap_or(1 << 16).max(1);
    let stream = std::env::args().any(|a| a == "--stream");
    let reply = support::Reply::new(tokens, hidden, stream);
    let bytes = reply.len();
    let rt = match tokio::runtime::Builder::new_current_thread().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ingest_bench: no runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let base_rss = status_kb("VmRSS:") / 1024.0;
    let hwm_reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let cpu0 = support::process_cpu_s();
    let out = rt.block_on(ingest(&reply, chunk, stream));
    let cpu = support::process_cpu_s() - cpu0;
    let peak = status_kb("VmHWM:") / 1024.0;
    match out {
        Ok((n, proofs)) if n == tokens && proofs == tokens.div_ceil(32) => {
            println!(
                "{{\"tokens\":{tokens},\"hidden\":{hidden},\"cpu_s\":{cpu:.4},\"tokens_per_cpu_s\":{:.0},\"peak_rss_mb\":{peak:.1},\"base_rss_mb\":{base_rss:.1},\"extra_rss_mb\":{:.1},\"hwm_reset\":{hwm_reset},\"stream\":{stream},\"bytes\":{bytes},\"mb_per_cpu_s\":{:.0},\"proofs\":{proofs}}}",
                tokens as f64 / cpu,
                peak - base_rss,
                bytes as f64 / 1e6 / cpu,
            );
            ExitCode::SUCCESS
        }
        Ok((n, proofs)) => {
            eprintln!("ingest_bench: {n} rows and {proofs} proofs for {tokens} tokens");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("ingest_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
