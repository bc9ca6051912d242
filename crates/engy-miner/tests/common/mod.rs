//! Shared harness: a generated checkpoint, the sglang and gateway doubles, and the REAL
//! `engy-miner` binary as a child process.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use engy_core::toploc::{f32_to_bf16_bits, verify_proofs_base64, Dtype, Params};
use engy_devnet::gateway::{Dir, Frame, GatewayConfig, GatewayDouble};
use engy_devnet::sglang::synthetic::{
    write_checkpoint, CheckpointSpec, SyntheticBackend, SyntheticConfig,
};
use engy_devnet::sglang::{Element, GenerateRecord, SglangConfig, SglangDouble};
use serde_json::{json, Value};

pub const T: Duration = Duration::from_secs(60);

/// The binary under test: `ENGY_MINER_BIN` when set (a copy that a shared target directory
/// cannot swap mid-run), else the one cargo built for this test.
pub fn miner_bin() -> String {
    std::env::var("ENGY_MINER_BIN")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_engy-miner").to_owned())
}
pub const KEY: &str = "mk-test-secret-4f9a";

/// A 127.0.0.1 address nothing listens on while the returned value lives (connections are
/// refused), held so that no other process is given it meanwhile (engy_devnet::ports).
pub fn refused_addr() -> engy_devnet::ports::ReservedPort {
    engy_devnet::ports::ReservedPort::new().unwrap()
}

/// The miner binary with exactly these variables (plus PATH, RUST_LOG=info), no stdin.
pub fn miner_cmd(vars: &[(&str, &str)], args: &[&str]) -> Command {
    let mut cmd = Command::new(miner_bin());
    cmd.args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd
}

/// Wait (bounded by [`T`]) until a leg newer than `dropped` has a live session again.
pub async fn wait_redialed(gw: &GatewayDouble, dropped: u64) {
    next_leg(gw, dropped).await;
}

/// The id of a live leg with a HELLO newer than leg `after` (the double numbers legs in
/// dial order): the one the miner dialed after `after` ended. Fails after [`T`].
pub async fn next_leg(gw: &GatewayDouble, after: u64) -> u64 {
    gw.wait_for(T, |_, conns| {
        conns
            .iter()
            .find(|c| c.id > after && c.alive && c.hello.is_some())
            .map(|c| c.id)
    })
    .await
    .unwrap_or_else(|| panic!("no leg dialed after leg {after} within {T:?}"))
}

/// The synthetic serve's checkpoint (engy-devnet `write_checkpoint`: config.json, the
/// tokenizer with its ChatML template, weights) with `hidden_size` and a 500-token vocabulary,
/// written to `dir/ckpt`; returns that path. [`Fixture::new`] serves one.
pub fn checkpoint(dir: &Path, hidden_size: usize) -> PathBuf {
    let ckpt = dir.join("ckpt");
    write_checkpoint(&ckpt, &checkpoint_spec(hidden_size)).unwrap();
    ckpt
}

fn checkpoint_spec(hidden_size: usize) -> CheckpointSpec {
    CheckpointSpec {
        hidden_size,
        vocab_size: 500,
        ..CheckpointSpec::default()
    }
}

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub sglang: SglangDouble,
    pub gw: GatewayDouble,
}

impl Fixture {
    pub async fn new(hidden: usize, workers: usize, cfg: SglangConfig) -> Self {
        Self::with_spec(&checkpoint_spec(hidden), workers, cfg).await
    }

    /// A fixture over a checkpoint of `spec` (an MoE or DSA model for the traces).
    pub async fn with_spec(spec: &CheckpointSpec, workers: usize, cfg: SglangConfig) -> Self {
        let dir = tempfile::tempdir().unwrap();
        write_checkpoint(&dir.path().join("ckpt"), spec).unwrap();
        let b =
            SyntheticBackend::from_checkpoint(&dir.path().join("ckpt"), SyntheticConfig::default())
                .unwrap();
        let sglang = SglangDouble::start(Arc::new(b), cfg).await.unwrap();
        let gw = GatewayDouble::start(GatewayConfig {
            workers,
            meta: true,
        })
        .await
        .unwrap();
        Self { dir, sglang, gw }
    }

    pub fn ckpt(&self) -> PathBuf {
        self.dir.path().join("ckpt")
    }

    pub fn lock(&self) -> PathBuf {
        self.dir.path().join("miner.lock")
    }

    /// `engy-miner check` with the fixture's gateway, key and checkpoint, `SERVE_URL=serve`
    /// and `extra`, no stdin: (exit code, stdout).
    pub async fn check(&self, serve: &str, extra: &[(&str, &str)]) -> (Option<i32>, String) {
        let (gw, ckpt) = (self.gw.url(), self.ckpt());
        let mut vars = vec![
            ("GW", gw.as_str()),
            ("MINER_KEY", KEY),
            ("CHECKPOINT", ckpt.to_str().unwrap()),
            ("SERVE_URL", serve),
        ];
        vars.extend_from_slice(extra);
        let out = tokio::process::Command::from(miner_cmd(&vars, &["check"]))
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.code(), stdout)
    }

    /// Start the real miner with the fixture's env plus `extra`.
    pub fn miner(&self, extra: &[(&str, &str)]) -> Miner {
        let log = self
            .dir
            .path()
            .join(format!("miner-{}.log", uuid::Uuid::new_v4().simple()));
        let mut cmd = Command::new(miner_bin());
        cmd.env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("GW", self.gw.url())
            .env("MINER_KEY", KEY)
            .env("CHECKPOINT", self.ckpt())
            .env("SERVE_URL", self.sglang.url())
            .env("ENGY_MINER_LOCK", self.lock())
            .env("MAX_INFLIGHT", "8")
            .env("STREAM_FLUSH_S", "0")
            .env("ENGY_DRAIN_S", "5");
        for (k, v) in extra {
            cmd.env(k, v);
        }
        let f = std::fs::File::create(&log).unwrap();
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::from(f))
            .spawn()
            .unwrap();
        Miner { child, log }
    }
}

pub struct Miner {
    pub child: Child,
    pub log: PathBuf,
}

impl Miner {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM and wait (bounded) for the exit status.
    pub fn terminate(&mut self) -> Option<std::process::ExitStatus> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Miner {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn chat(text: &str, max_tokens: u64) -> Value {
    json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
           "max_tokens": max_tokens})
}

/// Submits `n` chats (`"{prefix} {i}?"`, `max_tokens` each, every other one streamed) as
/// the gateway routes them, then waits (bounded by [`T`]) until the serve is generating all
/// `n` at once. Returns each `(leg, corr_id)` in submission order. A slow fault set first
/// keeps them running while the test acts on them.
pub async fn submit_running(
    fx: &Fixture,
    n: usize,
    prefix: &str,
    max_tokens: u64,
) -> Vec<(u64, String)> {
    let reqs: Vec<(u64, String)> = (0..n)
        .map(|i| {
            fx.gw
                .submit(chat(&format!("{prefix} {i}?"), max_tokens), i % 2 == 0)
                .expect("capacity")
        })
        .collect();
    fx.sglang
        .wait_until(T, |recs, _, live| {
            (recs.len() == n && live == n).then_some(())
        })
        .await
        .unwrap_or_else(|| panic!("{n} calls not all generating within {T:?}"));
    reqs
}

/// The kept rows of a served reply (§2.6.4: last row of 2-D elements, leading empties skipped).
pub fn served_rows(rec: &GenerateRecord) -> Vec<Vec<f32>> {
    let mut out = Vec::new();
    for e in &rec.hidden_states {
        match e {
            Element::Block(b) => {
                if let Some(r) = b.last() {
                    out.push(r.clone());
                }
            }
            Element::Row(r) => out.push(r.clone()),
        }
    }
    out
}

pub fn to_bits(rows: &[Vec<f32>]) -> Vec<Vec<u16>> {
    rows.iter()
        .map(|r| r.iter().map(|v| f32_to_bf16_bits(*v)).collect())
        .collect()
}

/// Verify a commitment's proofs against rows; returns the number of proofs.
pub fn verify_against(commitment: &Value, rows: &[Vec<f32>]) -> usize {
    let t = &commitment["toploc"];
    let params = Params {
        topk: t["topk"].as_u64().unwrap() as usize,
        decode_batching_size: t["decode_batching_size"].as_u64().unwrap() as usize,
        skip_prefill: t["skip_prefill"].as_bool().unwrap(),
    };
    assert!(params.skip_prefill);
    assert_eq!(
        t["n_tokens"].as_u64().unwrap() as usize,
        rows.len(),
        "n_tokens = rows"
    );
    let proofs: Vec<String> = t["proofs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect();
    let bits = to_bits(rows);
    let elements: Vec<&[u16]> = bits.iter().map(Vec::as_slice).collect();
    let res = verify_proofs_base64(&elements, Dtype::Bf16, &proofs, &params).unwrap();
    for r in &res {
        assert_eq!(
            r.exp_mismatches, 0,
            "proof must match the served rows exactly"
        );
        assert_eq!(r.mant_err_mean, 0.0);
    }
    res.len()
}

/// Wait for a heartbeat from `conn` sent after a fresh ping, and return it.
pub async fn ping_heartbeat(gw: &GatewayDouble, conn: u64) -> Value {
    let before = gw.frames().len();
    assert!(gw.ping(conn));
    gw.wait_for(T, |frames, _| {
        frames
            .iter()
            .skip(before)
            .find(|f| f.conn == conn && f.dir == Dir::FromMiner && f.kind() == "heartbeat")
            .map(|f| f.value.clone())
    })
    .await
    .expect("heartbeat in answer to ping")
}

/// Ping until the leg reports `inflight == 0` (the job released its slot).
pub async fn wait_idle(gw: &GatewayDouble, conn: u64) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let hb = ping_heartbeat(gw, conn).await;
        if hb["inflight"] == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "leg {conn} never went idle: {hb}"
        );
        // Wait for the next recorded change before asking again.
        let n = gw.frames().len();
        let _ = gw
            .wait_for(Duration::from_millis(200), |f, _| {
                (f.len() > n + 1).then_some(())
            })
            .await;
    }
}

pub fn python_has_transformers() -> bool {
    Command::new("python3")
        .args(["-c", "import transformers"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

pub fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name)
}

/// The `(commitment, output)` of a successful `response` (panics on an `error`).
pub fn assert_ok(resp: &Value) -> (&Value, &Value) {
    assert!(resp.get("error").is_none(), "unexpected error: {resp}");
    (&resp["commitment"], &resp["output"])
}

/// Frames the miner sent for `corr` after the fence of the `n`-th (0-based) cancel of
/// `corr` (see [`cancel_fenced`]); `None` until that fence is recorded.
pub fn after_nth_cancel_fence(frames: &[Frame], corr: &str, n: usize) -> Option<Vec<Value>> {
    let at = frames
        .iter()
        .enumerate()
        .filter(|(_, f)| f.dir == Dir::ToMiner && f.kind() == "cancel" && f.corr_id() == corr)
        .nth(n)?
        .0;
    let conn = frames[at].conn;
    let k = frames[..at]
        .iter()
        .filter(|f| f.conn == conn && f.dir == Dir::ToMiner && f.kind() == "ping")
        .count();
    let fence = frames
        .iter()
        .enumerate()
        .filter(|(_, f)| f.conn == conn && f.dir == Dir::FromMiner && f.kind() == "heartbeat")
        .nth(k)?
        .0;
    Some(
        frames[fence..]
            .iter()
            .filter(|f| f.dir == Dir::FromMiner && f.corr_id() == corr)
            .map(|f| f.value.clone())
            .collect(),
    )
}

/// Frames the miner sent for `corr` after it handled the gateway's first cancel of it, sent
/// with [`cancel_fenced`] to a miner started with [`NO_PERIODIC_HEARTBEAT`]; waits (bounded)
/// for the fence.
pub async fn frames_after_cancel(fx: &Fixture, corr: &str) -> Vec<Value> {
    fx.gw
        .wait_for(T, |frames, _| after_nth_cancel_fence(frames, corr, 0))
        .await
        .unwrap_or_else(|| panic!("{corr}: no cancel, or no heartbeat behind it"))
}

/// Wait for an `/abort_request` naming `rid`.
pub async fn wait_abort_of(fx: &Fixture, rid: &str) {
    fx.sglang
        .wait_until(T, |_, aborts, _| {
            aborts.iter().any(|a| a["rid"] == rid).then_some(())
        })
        .await
        .unwrap_or_else(|| panic!("no /abort_request for {rid}"));
}

/// Env that keeps the periodic heartbeat out of a test (the longest period the miner
/// accepts, under the gateway's 90 s staleness; every test ends sooner), so the n-th
/// heartbeat of a leg is the answer to its n-th `ping` (see [`cancel_fenced`]).
pub const NO_PERIODIC_HEARTBEAT: (&str, &str) = ("ENGY_HEARTBEAT_S", "89");

/// `cancel {corr_id}` followed by a `ping` on the same leg. A leg handles the gateway's
/// frames in order and writes its own through one FIFO, so the heartbeat answering that
/// ping was queued after the cancel took effect: docs/PROTOCOL.md §2 ("send NOTHING more for
/// that corr_id") means no frame for `corr` may be recorded after it.
pub fn cancel_fenced(gw: &GatewayDouble, conn: u64, corr: &str) -> bool {
    gw.cancel(conn, corr) && gw.ping(conn)
}

/// What [`cancel_fence_check`] found.
#[derive(Debug, Default)]
pub struct FenceCheck {
    /// `cancel` frames sent (recorded) so far.
    pub cancel_frames: usize,
    /// Cancelled corr_ids.
    pub cancelled: usize,
    /// Cancels whose fence heartbeat is not recorded yet.
    pub unfenced: Vec<String>,
    /// Frames the miner sent for a corr_id after the fence of its first cancel.
    pub violations: Vec<Value>,
}

/// Check every cancelled corr_id in one pass over `frames`: the fence of a cancel is the
/// heartbeat answering the first `ping` sent on its leg after it (the n-th heartbeat of a
/// leg answers its n-th ping: needs [`NO_PERIODIC_HEARTBEAT`]).
pub fn cancel_fence_check(frames: &[Frame]) -> FenceCheck {
    use std::collections::HashMap;
    let mut pings: HashMap<u64, usize> = HashMap::new();
    let mut heartbeats: HashMap<u64, Vec<usize>> = HashMap::new();
    // corr → (conn, ordinal of the fencing ping)
    let mut cancels: HashMap<&str, (u64, usize)> = HashMap::new();
    let mut last_from_miner: HashMap<&str, usize> = HashMap::new();
    let mut cancel_frames = 0;
    for (i, f) in frames.iter().enumerate() {
        match (f.dir, f.kind()) {
            (Dir::ToMiner, "ping") => *pings.entry(f.conn).or_default() += 1,
            (Dir::ToMiner, "cancel") => {
                cancel_frames += 1;
                let k = pings.get(&f.conn).copied().unwrap_or(0);
                cancels.entry(f.corr_id()).or_insert((f.conn, k));
            }
            (Dir::FromMiner, "heartbeat") => heartbeats.entry(f.conn).or_default().push(i),
            (Dir::FromMiner, _) if !f.corr_id().is_empty() => {
                last_from_miner.insert(f.corr_id(), i);
            }
            _ => {}
        }
    }
    let mut out = FenceCheck {
        cancel_frames,
        cancelled: cancels.len(),
        ..FenceCheck::default()
    };
    for (corr, (conn, k)) in &cancels {
        let fence = heartbeats.get(conn).and_then(|h| h.get(*k)).copied();
        match fence {
            None => out.unfenced.push((*corr).to_string()),
            Some(at) => {
                if last_from_miner.get(corr).is_some_and(|&l| l > at) {
                    out.violations.extend(
                        frames[at..]
                            .iter()
                            .filter(|f| f.dir == Dir::FromMiner && f.corr_id() == *corr)
                            .map(|f| f.value.clone()),
                    );
                }
            }
        }
    }
    out
}

/// Wait until the `sent` cancel frames and every cancel's fence heartbeat are recorded
/// (the double records a frame when its connection task sends it), then return the check.
pub async fn settled_fence_check(gw: &GatewayDouble, sent: usize) -> FenceCheck {
    gw.wait_for(T, |frames, _| {
        let c = cancel_fence_check(frames);
        (c.cancel_frames >= sent && c.unfenced.is_empty()).then_some(c)
    })
    .await
    .unwrap_or_else(|| {
        let c = cancel_fence_check(&gw.frames());
        panic!(
            "{} of {sent} cancels recorded; no heartbeat behind {:?}",
            c.cancel_frames, c.unfenced
        )
    })
}

/// The first frame from the miner for `corr` of one of `kinds`, recorded at or after index
/// `from`; scans only new frames on each change (cheap with many waiters).
pub async fn wait_frame_of(
    gw: &GatewayDouble,
    corr: &str,
    from: usize,
    kinds: &[&str],
    timeout: Duration,
) -> Option<Value> {
    let mut seen = from;
    gw.wait_for(timeout, |frames, _| {
        let start = seen.min(frames.len());
        seen = frames.len();
        frames[start..]
            .iter()
            .find(|f| f.dir == Dir::FromMiner && f.corr_id() == corr && kinds.contains(&f.kind()))
            .map(|f| f.value.clone())
    })
    .await
}

/// Peak resident set of `pid` in kB (`VmHWM` of /proc/<pid>/status).
pub fn vm_hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// SIGTERM the miner; it must exit 0 having had nothing in flight (no leaked slot: the
/// drain line reports `inflight=0` and the drain never timed out) and never panicked.
pub async fn terminate_idle(m: Miner) {
    let (code, log) = stop(m).await;
    assert_eq!(code, Some(0), "{log}");
    let drain = log
        .lines()
        .find(|l| l.contains("signal received"))
        .unwrap_or_else(|| panic!("no drain line: {log}"));
    assert!(
        drain.contains("inflight=0"),
        "leaked in-flight request: {drain}"
    );
    assert!(!log.contains("drain timed out"), "{log}");
    assert!(!log.contains("panicked"), "{log}");
}

/// Frames recorded so far (without copying them).
pub async fn frame_count(gw: &GatewayDouble) -> usize {
    gw.wait_for(T, |frames, _| Some(frames.len()))
        .await
        .unwrap_or(0)
}

/// SIGTERM the miner from async code ([`Miner::terminate`] off the runtime's threads):
/// its exit code and whole log.
pub async fn stop(mut m: Miner) -> (Option<i32>, String) {
    tokio::task::spawn_blocking(move || {
        let c = m.terminate().and_then(|s| s.code());
        (c, m.log_text())
    })
    .await
    .unwrap()
}

/// Wait (bounded by [`T`]) until the miner's log contains `needle`.
pub async fn wait_log(m: &Miner, needle: &str) -> String {
    let deadline = std::time::Instant::now() + T;
    loop {
        let log = m.log_text();
        if log.contains(needle) {
            return log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{needle:?} never logged: {log}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The miner with `extra` and its metrics endpoint on a port the kernel picks
/// (`ENGY_METRICS_ADDR=127.0.0.1:0`), and that endpoint's address as the miner logged it. A
/// port picked here and handed over could be taken by another process first.
pub async fn miner_with_metrics(fx: &Fixture, extra: &[(&str, &str)]) -> (Miner, String) {
    let mut vars = extra.to_vec();
    vars.push(("ENGY_METRICS_ADDR", "127.0.0.1:0"));
    let m = fx.miner(&vars);
    let log = wait_log(&m, "/metrics").await;
    let addr = log
        .split("metrics at http://")
        .nth(1)
        .and_then(|rest| rest.split("/metrics").next())
        .unwrap_or_else(|| panic!("no metrics address in the log: {log}"))
        .to_string();
    (m, addr)
}

/// `GET /metrics` of a miner's `--metrics-addr` (must answer 2xx).
pub async fn scrape(addr: &str) -> String {
    let r = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    r.text().await.unwrap()
}

/// Scrapes `addr` until `engy_miner_inflight` is 0: every job, on every leg (a dropped one's
/// included, which no heartbeat reports), released its slot. Fails after `T`.
pub async fn wait_no_inflight(addr: &str) {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let n = sample(&scrape(addr).await, "engy_miner_inflight");
        if n == 0.0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} requests still in flight after {T:?}"
        );
        // Polled, not slept on: the next scrape asks again.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the sample whose name and labels are exactly `series`.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no {series} in\n{text}"))
}
