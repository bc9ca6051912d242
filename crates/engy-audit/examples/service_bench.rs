//! Throughput and latency of `engy-audit serve` (bench/README.md §4, run by
//! bench/audit-service.sh): the real binary on the devnet model (CPU), reports posted over
//! HTTP on 127.0.0.1, verdicts read back from the API.
//!
//! ```text
//! cargo run -p engy-audit --example service_bench -- --bin target/debug/engy-audit \
//!     [--db sqlite|postgres://…] [--workers 1|2] [--reports 40] [--tokens 64] \
//!     [--checkpoint DIR --commitment FILE] [--device cpu|cuda|cuda:N] [--batch B]
//! ```
//!
//! With `--checkpoint` and `--commitment` (e.g. `synth_checkpoint`'s real-shape checkpoint and
//! its 4,096-token commitment, on a GPU): the reports carry that commitment, each copy with
//! one character of its last proof changed so that every report has its own SHA-256 (the
//! service is idempotent by it) while the recompute is the same; their verdicts are counted,
//! not required to be `pass` (a synthetic commitment is not a serve of the checkpoint).
//!
//! Two measurements, one JSON line:
//! * `audits_per_s`: `--reports` honest commitments posted at once into an empty queue,
//!   `--workers` processes (one CPU worker each) draining it; reports / (last verdict's
//!   `decided_ms` − the first worker's launch, start-up included), wall time;
//! * `latency_ms_p50` / `_max`: report-to-verdict (post → the verdict's `decided_ms`) of
//!   `--latency-reports` reports posted one at a time into an idle service.
//!
//! Wall time on a shared machine: publish the load average beside the numbers.
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use engy_core::toploc::Params;
use engy_model::audit::commit_greedy;
use engy_model::{gen_model, Checkpoint, GenConfig, Precision};
use serde_json::{json, Value};

const BEACON: &str = "0101010101010101010101010101010101010101010101010101010101010101";

fn http(addr: SocketAddr, method: &str, path: &str, body: &[u8]) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no HTTP status")?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    Ok((status, body))
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

struct Svc {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Svc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `engy-audit serve` on port 0 of 127.0.0.1 and reads the bound address from its
/// `listening` log line; returns once `/health` says the models are loaded (at once for
/// `--device none`). Its log is drained on a thread for as long as it runs.
fn start(
    bin: &str,
    db: &str,
    model: &str,
    checkpoint: &std::path::Path,
    device: &str,
    batch: Option<&str>,
) -> Result<Svc> {
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--db", db])
        .args(["--log-format", "json"])
        .args([
            "--fixed-beacon",
            BEACON,
            "--sample-rate",
            "1",
            "--floor",
            "0",
        ])
        .args(["--device", device])
        .arg("--model")
        .arg(format!("{model}={}", checkpoint.display()));
    if let Some(b) = batch.filter(|_| device != "none") {
        cmd.args(["--batch", b]);
    }
    let mut child = cmd
        .env("ENGY_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("spawn engy-audit serve")?;
    let stderr = child.stderr.take().context("the service's stderr")?;
    let (tx, rx) = mpsc::channel::<String>();
    // The last lines of the service's log, for the error when it does not come up.
    let tail = Arc::new(Mutex::new(VecDeque::<String>::new()));
    let keep = Arc::clone(&tail);
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let addr = serde_json::from_str::<Value>(&line).ok().and_then(|v| {
                (v["message"] == "listening").then(|| v["addr"].as_str().map(str::to_owned))?
            });
            if let Some(a) = addr {
                let _ = tx.send(a);
            }
            if let Ok(mut t) = keep.lock() {
                if t.len() == 40 {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }
    });
    let log = move || {
        tail.lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n"))
            .unwrap_or_default()
    };
    let Ok(addr) = rx.recv_timeout(Duration::from_secs(300)) else {
        bail!(
            "the service logged no `listening` line; its log:\n{}",
            log()
        );
    };
    let mut svc = Svc {
        child,
        addr: addr.parse()?,
    };
    let t = Instant::now();
    loop {
        if let Ok((200, body)) = http(svc.addr, "GET", "/health", b"") {
            if body.contains("loaded") || device == "none" {
                return Ok(svc);
            }
        }
        if let Some(status) = svc.child.try_wait()? {
            bail!(
                "the service exited ({status}) before its models loaded; its log:\n{}",
                log()
            );
        }
        if t.elapsed() > Duration::from_secs(600) {
            bail!(
                "the service did not load its models in 600 s; its log:\n{}",
                log()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Copy `i` of `c`: one or two characters of its last proof moved along the base64 alphabet
/// (a different SHA-256, the same recompute).
fn variant(c: &Value, i: usize) -> Result<Value> {
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut c = c.clone();
    let proof = c["toploc"]["proofs"]
        .as_array_mut()
        .and_then(|p| p.last_mut())
        .context("the commitment has no toploc.proofs")?;
    let mut bytes = proof
        .as_str()
        .context("a proof is not a string")?
        .as_bytes()
        .to_vec();
    let at = bytes.len() / 2;
    for (k, step) in [(at, i % 63 + 1), (at + 1, i / 63 % 64)] {
        let pos = bytes
            .get(k)
            .and_then(|b| B64.iter().position(|x| x == b))
            .context("the last proof is too short to vary")?;
        bytes[k] = B64[(pos + step) % 64];
    }
    *proof = Value::String(String::from_utf8(bytes)?);
    Ok(c)
}

fn verdict(addr: SocketAddr, digest: &str, limit: Duration) -> Result<Value> {
    let t = Instant::now();
    loop {
        let (code, body) = http(addr, "GET", &format!("/v1/verdicts/{digest}"), b"")?;
        if code == 200 {
            return Ok(serde_json::from_str(&body)?);
        }
        if t.elapsed() > limit {
            bail!("no verdict for {digest}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn digest_of(c: &Value) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(
        serde_json::to_vec(c).unwrap_or_default(),
    ))
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let bin = arg(&args, "--bin").context("--bin PATH of engy-audit")?;
    let db_arg = arg(&args, "--db").unwrap_or_else(|| "sqlite".into());
    let workers: usize = arg(&args, "--workers").map_or(Ok(1), |s| s.parse())?;
    let n: usize = arg(&args, "--reports").map_or(Ok(40), |s| s.parse())?;
    let n_lat: usize = arg(&args, "--latency-reports").map_or(Ok(10), |s| s.parse())?;
    let tokens: usize = arg(&args, "--tokens").map_or(Ok(64), |s| s.parse())?;

    let device = arg(&args, "--device").unwrap_or_else(|| "cpu".into());
    let batch = arg(&args, "--batch");
    let given = arg(&args, "--checkpoint").zip(arg(&args, "--commitment"));

    let dir = tempfile::tempdir()?;
    let nonce = format!("{}-{}", std::process::id(), now_ms());
    let model = format!("bench-{nonce}");
    let (checkpoint, commitments, tokens) = match &given {
        Some((ck_dir, file)) => {
            let c: Value = serde_json::from_slice(
                &std::fs::read(file).with_context(|| format!("read {file}"))?,
            )
            .with_context(|| format!("{file} is not JSON"))?;
            let tokens = c["toploc"]["n_tokens"].as_u64().unwrap_or(0) as usize
                + c["toploc"]["prompt_ids"].as_array().map_or(0, Vec::len);
            let all = (0..n + n_lat)
                .map(|i| variant(&c, i))
                .collect::<Result<Vec<_>>>()?;
            (std::path::PathBuf::from(ck_dir), all, tokens)
        }
        None => {
            let checkpoint = dir.path().join("m");
            gen_model(&checkpoint, 3, &GenConfig::default())?;
            let ck = Checkpoint::open(&checkpoint, Precision::Bf16)?;
            let make = |i: usize| -> Result<Value> {
                let prompt = ck
                    .tokenizer
                    .encode(
                        format!("<|im_start|>user\nbench {nonce} request {i}<|im_end|>\n<|im_start|>assistant\n"),
                        false,
                    )
                    .map_err(|e| anyhow::anyhow!("{e}"))?
                    .get_ids()
                    .to_vec();
                Ok(commit_greedy(
                    &ck.model,
                    &ck.model_root,
                    &prompt,
                    tokens,
                    &[],
                    &Params::ENGY,
                )?)
            };
            let all = (0..n + n_lat).map(make).collect::<Result<Vec<_>>>()?;
            (checkpoint, all, tokens)
        }
    };
    let hotkey = engy_core::keys::ss58_encode(&[7u8; 32]);
    let report = |i: usize, c: &Value| {
        serde_json::to_vec(&json!({
            "request_id": format!("bench-{i}"), "hotkey": hotkey, "model": model,
            "commitment": c, "timing": {"ttft_ms": 1, "total_ms": 2},
        }))
        .unwrap_or_default()
    };
    let db = if db_arg == "sqlite" {
        format!("sqlite://{}", dir.path().join("audit.db").display())
    } else {
        db_arg.clone()
    };

    // Intake first (no worker), so the queue is full before any worker starts.
    let intake = start(&bin, &db, &model, &checkpoint, "none", None)?;
    let t0 = now_ms();
    for (i, c) in commitments[..n].iter().enumerate() {
        let (code, body) = http(intake.addr, "POST", "/v1/requests", &report(i, c))?;
        if code != 202 {
            bail!("report {i}: {code} {body}");
        }
    }
    let posted_ms = now_ms() - t0;
    // Workers: one process each, one CPU worker each, on the one queue.
    let mut procs = Vec::new();
    let started = now_ms();
    for _ in 0..workers {
        procs.push(start(
            &bin,
            &db,
            &model,
            &checkpoint,
            &device,
            batch.as_deref(),
        )?);
    }
    let ready = now_ms();
    let mut last = 0i64;
    let mut by_worker = std::collections::BTreeMap::<String, usize>::new();
    let mut verdicts = std::collections::BTreeMap::<String, usize>::new();
    for c in &commitments[..n] {
        let v = verdict(intake.addr, &digest_of(c), Duration::from_secs(3600))?;
        if given.is_none() && v["verdict"] != "pass" {
            bail!("an honest commitment got {v}");
        }
        *verdicts
            .entry(v["verdict"].as_str().unwrap_or("?").to_owned())
            .or_default() += 1;
        last = last.max(v["decided_ms"].as_i64().unwrap_or(0));
        *by_worker
            .entry(v["worker"].as_str().unwrap_or("").to_owned())
            .or_default() += 1;
    }
    // The drain is timed from the first worker's launch (its start-up included): a later
    // worker starts while the first already audits, so "all workers up" would undercount.
    let drain_s = (last - started) as f64 / 1000.0;
    let audits_per_s = n as f64 / drain_s;

    // Latency: one report at a time into the idle service.
    let mut lat = Vec::new();
    for (i, c) in commitments[n..].iter().enumerate() {
        let sent = now_ms();
        let (code, body) = http(intake.addr, "POST", "/v1/requests", &report(n + i, c))?;
        if code != 202 {
            bail!("latency report {i}: {code} {body}");
        }
        let v = verdict(intake.addr, &digest_of(c), Duration::from_secs(600))?;
        lat.push(v["decided_ms"].as_i64().unwrap_or(0) - sent);
    }
    lat.sort_unstable();
    let p50 = lat.get(lat.len() / 2).copied().unwrap_or(0);
    let max = lat.last().copied().unwrap_or(0);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{}",
        json!({
            "db": if db_arg == "sqlite" { "sqlite" } else { "postgres" },
            "workers": workers, "device": device, "batch": batch, "reports": n, "tokens": tokens,
            "checkpoint": given.as_ref().map(|(d, _)| d), "verdicts": verdicts,
            "post_ms": posted_ms, "workers_up_ms": ready - started,
            "drain_s": drain_s, "audits_per_s": audits_per_s,
            "per_worker": by_worker.values().collect::<Vec<_>>(),
            "latency_reports": n_lat, "latency_ms_p50": p50, "latency_ms_max": max,
            "loadavg": load.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
        })
    );
    drop(procs);
    drop(intake);
    Ok(())
}
