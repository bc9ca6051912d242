//! Whole-process harness for `bench/serve.sh` (issue 7): the REAL `engy-miner` binary under
//! `/usr/bin/time -v`, serving requests from the gateway double on the sglang double (a
//! synthetic checkpoint with the given hidden size, engy's trimmed serve shape §8).
//!
//! ```text
//! cargo bench -p engy-miner --bench serve -- --tokens 4096 --hidden 2048 [--requests 1] [--stream]
//! ```
//!
//! Steps: start the doubles; start the miner under `/usr/bin/time -v`; once its leg is up
//! read its idle RSS (`VmRSS` of the miner process); send `--requests` requests of
//! `--tokens` output tokens one after another (the miner makes one 4,096-token serve call
//! each, TOPLOC_GEN_CHUNK) and check each commitment carries `tokens / 32` proofs; SIGTERM
//! the miner; print `/usr/bin/time`'s CPU and peak RSS lines and one JSON line
//! `{"tokens":…,"hidden":…,"requests":…,"stream":…,"idle_rss_mb":…,"peak_rss_mb":…,
//! "user_s":…,"sys_s":…,"cpu_s":…,"wall_s":…}`. Idle CPU (start-up, tokenizer load) is in
//! `cpu_s` too: run with `--requests 0` to measure it alone and subtract.
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::json;

mod harness;
use harness::{arg, Doubles};

fn status_mb(pid: u32, key: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with(key)).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse::<f64>().ok())
            })
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

/// The pid of `/usr/bin/time`'s child (the miner).
fn child_of(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn time_field(report: &str, key: &str) -> f64 {
    report
        .lines()
        .find_map(|l| l.trim().strip_prefix(key))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; ignore it.
    let tokens = arg("--tokens").unwrap_or(4096);
    let hidden = arg("--hidden").unwrap_or(2048);
    let requests = arg("--requests").unwrap_or(1);
    let stream = std::env::args().any(|a| a == "--stream");
    let t_out = Duration::from_secs(600);

    let Doubles {
        dir,
        ckpt,
        sglang,
        gw,
    } = Doubles::start(hidden, 1).await?;

    let report = dir.path().join("time.txt");
    let log = std::fs::File::create(dir.path().join("miner.log"))?;
    let mut child = Command::new("/usr/bin/time")
        .arg("-v")
        .arg("-o")
        .arg(&report)
        .arg(env!("CARGO_BIN_EXE_engy-miner"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("GW", gw.url())
        .env("MINER_KEY", "mk-bench-secret")
        .env("CHECKPOINT", &ckpt)
        .env("SERVE_URL", sglang.url())
        .env("ENGY_MINER_LOCK", dir.path().join("miner.lock"))
        .env("MAX_INFLIGHT", "8")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("/usr/bin/time (apt-get install time)")?;
    let started = Instant::now();
    let leg = gw
        .wait_legs(1, t_out)
        .await
        .context("the miner opened no leg")?
        .first()
        .map(|c| c.id)
        .context("no leg")?;
    let miner = child_of(child.id()).context("no miner process under /usr/bin/time")?;
    let idle_rss = status_mb(miner, "VmRSS:");
    for i in 0..requests {
        let corr = format!("bench-{i}");
        let req = json!({"messages": [{"role": "user", "content": "Write a long story."}],
                         "max_tokens": tokens});
        anyhow::ensure!(gw.serve(leg, &corr, req, stream), "gateway double refused");
        let resp = gw
            .wait_response(&corr, t_out)
            .await
            .context("no response")?;
        let proofs = resp
            .pointer("/commitment/toploc/proofs")
            .and_then(|p| p.as_array())
            .map_or(0, Vec::len);
        anyhow::ensure!(
            proofs == tokens.div_ceil(32),
            "request {i}: {proofs} proofs, want {}: {resp:.300}",
            tokens.div_ceil(32)
        );
    }
    let wall = started.elapsed().as_secs_f64();
    // SIGTERM the miner (not `time`), which then reports.
    Command::new("kill")
        .arg("-TERM")
        .arg(miner.to_string())
        .status()?;
    child.wait()?;
    let rep = std::fs::read_to_string(&report)?;
    for l in rep.lines().filter(|l| {
        l.contains("User time") || l.contains("System time") || l.contains("Maximum resident")
    }) {
        eprintln!("{}", l.trim());
    }
    let user = time_field(&rep, "User time (seconds):");
    let sys = time_field(&rep, "System time (seconds):");
    let peak = time_field(&rep, "Maximum resident set size (kbytes):") / 1024.0;
    println!(
        "{{\"tokens\":{tokens},\"hidden\":{hidden},\"requests\":{requests},\"stream\":{stream},\"idle_rss_mb\":{idle_rss:.1},\"peak_rss_mb\":{peak:.1},\"user_s\":{user:.2},\"sys_s\":{sys:.2},\"cpu_s\":{:.2},\"wall_s\":{wall:.2}}}",
        user + sys
    );
    Ok(())
}
