//! Miner-added streaming latency (issue 7): from the serve's SSE event to the websocket
//! `chunk` frame that carries its text, at many concurrent streams.
//!
//! ```text
//! cargo bench -p engy-miner --bench latency -- [--streams 64] [--tokens 200] [--hidden 2048]
//!     [--interval-ms 15] [--workers 8] [--miner-nice N] [--miner-cpus LIST]
//! ```
//!
//! The REAL `engy-miner` binary runs between the gateway double (`--workers` legs) and the
//! sglang double (synthetic checkpoint, engy's trimmed serve shape §8, every decode step
//! paced by `--interval-ms`, ~65 tokens/s a stream: 64 streams ≈ 4,300 tokens/s, one
//! 8-GPU node). `--streams` streamed requests run at once, each of `--tokens + i` tokens
//! (the length tells the serve calls apart). The 50 ms coalescing window is policy, not
//! latency (PROTOCOL.md §2, `STREAM_FLUSH_S`), so it is set to 0: every event with new
//! text becomes one `chunk` frame at once.
//!
//! For every intermediate SSE event the sglang double records when it was handed to the
//! HTTP body and the length of its cumulative `text`; the gateway double records when each
//! `chunk` frame arrived. A frame is matched to the first event whose text length equals
//! the frame's cumulative delta length; latency = frame arrival − event hand-off (a frame
//! whose text came with the final event has no mark: counted as `unmatched`). Prints
//! one JSON line `{"streams":…,"samples":…,"p50_ms":…,"p90_ms":…,"p99_ms":…,"max_ms":…}`.
//! Both doubles share the machine with the miner, so the numbers include their CPU.
//! `ENGY_LATENCY_DUMP=<file>` writes every sample (`event_ms latency_ms stream event`).
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use engy_devnet::gateway::Dir;
use engy_devnet::sglang::Fault;
use serde_json::{json, Value};

mod harness;
use harness::{arg, Doubles};

/// User + system CPU seconds of process `pid` so far (`/proc/<pid>/stat`, 100 Hz ticks).
fn cpu_seconds(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the `(comm)`: state is field 3, utime 14, stime 15.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
            Some(ticks / 100.0)
        })
        .unwrap_or(f64::NAN)
}

/// The `q` quantile (0..=1) of sorted `v`, nearest rank.
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v.get(rank - 1).copied().unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let streams = arg("--streams").unwrap_or(64);
    let tokens = arg("--tokens").unwrap_or(200);
    let hidden = arg("--hidden").unwrap_or(2048);
    let interval = Duration::from_millis(arg("--interval-ms").unwrap_or(15) as u64);
    let workers = arg("--workers").unwrap_or(8);
    let t_out = Duration::from_secs(600);

    let Doubles {
        dir,
        ckpt,
        sglang,
        gw,
    } = Doubles::start(hidden, workers).await?;
    sglang.set_fault(Some(Fault::Slow(interval)));

    let log = std::fs::File::create(dir.path().join("miner.log"))?;
    // `--miner-nice N` runs the miner at niceness N (e.g. the bench under `nice -n 10` and
    // `--miner-nice -10`); `--miner-cpus LIST` pins it (`taskset -c LIST`, the bench
    // itself pinned elsewhere), as on a serve box where sglang has its own cores. Either
    // keeps the doubles' CPU (they render every reply) out of the miner's latency on a
    // small machine.
    let opt = |name: &str| {
        let args: Vec<String> = std::env::args().collect();
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1).cloned()
    };
    let mut argv: Vec<String> = Vec::new();
    if let Some(cpus) = opt("--miner-cpus") {
        argv.extend(["taskset".into(), "-c".into(), cpus]);
    }
    if let Some(n) = opt("--miner-nice") {
        argv.extend(["nice".into(), "-n".into(), n]);
    }
    argv.push(env!("CARGO_BIN_EXE_engy-miner").into());
    let mut cmd = Command::new(argv.first().context("no command")?);
    cmd.args(argv.get(1..).unwrap_or_default());
    let mut miner = cmd
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("GW", gw.url())
        .env("MINER_KEY", "mk-bench-secret")
        .env("CHECKPOINT", &ckpt)
        .env("SERVE_URL", sglang.url())
        .env("ENGY_MINER_LOCK", dir.path().join("miner.lock"))
        .env("MAX_INFLIGHT", streams.max(8).to_string())
        .env("STREAM_FLUSH_S", "0")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("start engy-miner")?;
    let run = async {
        gw.wait_legs(workers.min(streams), t_out)
            .await
            .context("the miner opened too few legs")?;
        let mut corrs = Vec::new();
        for i in 0..streams {
            let req = json!({"messages": [{"role": "user", "content": format!("Story {i}.")}],
                             "max_tokens": tokens + i});
            let (_, corr) = gw.submit(req, true).context("no leg has room")?;
            corrs.push((corr, tokens + i));
        }
        // Count `response` frames incrementally: a full scan of the frame log on every
        // recorded frame would hold the log's lock long enough to delay the recording.
        let (mut seen, mut responses) = (0usize, 0usize);
        gw.wait_for(t_out, |frames, _| {
            for f in frames.get(seen..).unwrap_or_default() {
                responses += usize::from(f.dir == Dir::FromMiner && f.kind() == "response");
            }
            seen = frames.len();
            (responses >= streams).then_some(())
        })
        .await
        .with_context(|| format!("{responses} of {streams} responses"))?;
        anyhow::Ok(corrs)
    };
    let corrs = run.await;
    let miner_cpu_s = cpu_seconds(miner.id());
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(miner.id().to_string())
        .status();
    let _ = miner.wait();
    let corrs = corrs?;

    let log = sglang.generate_log();
    let t0 = log
        .iter()
        .filter_map(|r| r.events.first().map(|e| e.at))
        .min()
        .context("no SSE event recorded")?;
    let mut dump = Vec::new();
    let mut lat_ms = Vec::new();
    let mut unmatched = 0usize;
    for (corr, max_new) in &corrs {
        let rec = log
            .iter()
            .find(|r| r.request.pointer("/sampling_params/max_new_tokens") == Some(&json!(max_new)))
            .with_context(|| format!("no serve call of {max_new} tokens"))?;
        let mut seen = 0usize;
        let mut next_event = 0usize;
        let chunks = gw
            .frames_for(corr)
            .into_iter()
            .filter(|f| f.dir == Dir::FromMiner && f.kind() == "chunk");
        for f in chunks {
            let delta = f
                .value
                .pointer("/delta/content")
                .and_then(Value::as_str)
                .unwrap_or("");
            seen += delta.len();
            // The first event (from `next_event` on) whose text is as long as all deltas so far.
            match rec
                .events
                .iter()
                .enumerate()
                .skip(next_event)
                .find(|(_, e)| e.text_len == seen)
            {
                Some((k, e)) => {
                    next_event = k + 1;
                    let ms = f.at.saturating_duration_since(e.at).as_secs_f64() * 1e3;
                    lat_ms.push(ms);
                    dump.push(format!(
                        "{:.3} {ms:.3} {max_new} {k}",
                        e.at.saturating_duration_since(t0).as_secs_f64() * 1e3
                    ));
                }
                None => unmatched += 1,
            }
        }
    }
    anyhow::ensure!(!lat_ms.is_empty(), "no chunk frame matched an SSE event");
    if let Ok(path) = std::env::var("ENGY_LATENCY_DUMP") {
        // One line per sample: event time (ms since the first event), latency (ms), the
        // stream's token count, event index.
        std::fs::write(&path, dump.join("\n"))?;
    }
    lat_ms.sort_by(f64::total_cmp);
    println!(
        "{{\"streams\":{streams},\"tokens\":{tokens},\"hidden\":{hidden},\"interval_ms\":{},\"samples\":{},\"unmatched\":{unmatched},\"p50_ms\":{:.3},\"p90_ms\":{:.3},\"p99_ms\":{:.3},\"max_ms\":{:.3},\"miner_cpu_s\":{miner_cpu_s:.2}}}",
        interval.as_millis(),
        lat_ms.len(),
        quantile(&lat_ms, 0.50),
        quantile(&lat_ms, 0.90),
        quantile(&lat_ms, 0.99),
        lat_ms.last().copied().unwrap_or(f64::NAN),
    );
    Ok(())
}
