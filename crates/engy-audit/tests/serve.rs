//! `engy-audit serve`, the audit service, as a process (crates/engy-audit-service): reports in
//! over HTTP on 127.0.0.1, the real audit on the devnet model, verdicts and evidence out, on
//! SQLite and (with `$ENGY_TEST_POSTGRES_URL`, started by tests/run.sh) on PostgreSQL.
//!
//! Faults, each through the real binary: malformed / oversize / unknown-model reports (4xx,
//! nothing stored); a duplicate report (one job); a worker SIGKILLed mid-audit (the job is
//! redone by another, one verdict); two workers on one queue (no job audited twice); a model
//! that cannot be opened (a clear error, the job kept); PostgreSQL restarted mid-run (nothing
//! lost); the cell challenge through the gateway double (docs/PROTOCOL.md §11.3): an honest
//! opening, a cheat's, a refusal and a miner that never answers.
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use engy_core::toploc::Params;
use engy_model::audit::commit_greedy;
use engy_model::{gen_model, Checkpoint, GenConfig, Precision};
use serde_json::{json, Value};

mod cells_common;
mod service_common;

use service_common::{hotkey, http, run_nonce};

/// Every wait in these tests polls a condition under this deadline.
const DEADLINE: Duration = Duration::from_secs(180);
const BEACON: &str = "0101010101010101010101010101010101010101010101010101010101010101";
fn get_json(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (code, body) = http(addr, "GET", path, b"");
    (
        code,
        serde_json::from_str(&body).unwrap_or(Value::String(body)),
    )
}

/// Polls `f` until it gives `Some`, failing after [`DEADLINE`] with `what`.
fn wait_for<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < DEADLINE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The devnet model and commitments made on it.
struct Fixture {
    _dir: tempfile::TempDir,
    checkpoint: PathBuf,
    honest: Checkpoint,
    cheat: Checkpoint,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("m");
        gen_model(&checkpoint, 3, &GenConfig::default()).unwrap();
        let honest = Checkpoint::open(&checkpoint, Precision::Bf16).unwrap();
        let cheat = Checkpoint::open(&checkpoint, Precision::Int4 { group_size: 32 }).unwrap();
        Fixture {
            _dir: dir,
            checkpoint,
            honest,
            cheat,
        }
    }

    /// A commitment of `tokens` output tokens for the prompt `text`, honest or not. The
    /// prompt carries this process's id and start time, so that runs against one PostgreSQL
    /// database never report the same commitment twice.
    fn commitment(&self, text: &str, tokens: usize, honest: bool) -> Value {
        self.commitment_exact(&format!("{text} (run {})", run_nonce()), tokens, honest)
    }

    /// [`Fixture::commitment`] without the run's nonce: the same bytes in every run.
    fn commitment_exact(&self, text: &str, tokens: usize, honest: bool) -> Value {
        let ck = if honest { &self.honest } else { &self.cheat };
        let prompt = ck
            .tokenizer
            .encode(
                format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"),
                false,
            )
            .unwrap()
            .get_ids()
            .to_vec();
        commit_greedy(
            &ck.model,
            &self.honest.model_root,
            &prompt,
            tokens,
            &[],
            &Params::ENGY,
        )
        .unwrap()
    }
}

fn report(request_id: &str, hotkey: &str, model: &str, commitment: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "request_id": request_id,
        "hotkey": hotkey,
        "model": model,
        "commitment": commitment,
        "timing": {"ttft_ms": 12, "total_ms": 340},
    }))
    .unwrap()
}

/// SHA-256 of the commitment as `report` writes it (serde_json's compact form).
fn digest_of(commitment: &Value) -> String {
    use sha2::Digest as _;
    hex::encode(sha2::Sha256::digest(
        serde_json::to_vec(commitment).unwrap(),
    ))
}

/// A running `engy-audit serve`.
struct Service {
    child: Child,
    addr: SocketAddr,
    lines: mpsc::Receiver<Value>,
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Service {
    fn start(db: &str, models: &[(&str, &Path)], extra: &[&str]) -> Service {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_engy-audit"));
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--db", db])
            .args(["--fixed-beacon", BEACON])
            // Every report audited unless a test's flags say otherwise.
            .env("ENGY_AUDIT_SAMPLE_RATE", "1")
            .env("ENGY_AUDIT_FLOOR", "0")
            .args(["--log-format", "json"]);
        for (name, dir) in models {
            cmd.arg("--model").arg(format!("{name}={}", dir.display()));
        }
        cmd.args(extra)
            .env_remove("ENGY_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn engy-audit serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log2.lock().unwrap().push(line.clone());
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        let mut s = Service {
            child,
            addr: "127.0.0.1:1".parse().unwrap(),
            lines,
            log,
        };
        let listening = s.wait_line("the listening line", |v| v["message"] == "listening");
        s.addr = listening["addr"].as_str().unwrap().parse().unwrap();
        s
    }

    /// The next log line matching `f` (earlier ones are consumed).
    fn wait_line(&mut self, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let left = DEADLINE.saturating_sub(start.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(v) if f(&v) => return v,
                Ok(_) => {}
                Err(_) => panic!(
                    "timed out waiting for {what}; log:\n{}",
                    self.log.lock().unwrap().join("\n")
                ),
            }
        }
    }

    fn post(&self, body: &[u8]) -> (u16, Value) {
        let (code, text) = http(self.addr, "POST", "/v1/requests", body);
        (
            code,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn health(&self) -> Value {
        get_json(self.addr, "/health").1
    }

    /// Waits until the request of `digest` has a verdict; returns the verdict object.
    fn verdict(&self, digest: &str) -> Value {
        wait_for(&format!("the verdict of {digest}"), || {
            let (code, v) = get_json(self.addr, &format!("/v1/verdicts/{digest}"));
            (code == 200).then_some(v)
        })
    }

    fn metric(&self, name_and_labels: &str) -> f64 {
        let (_, text) = http(self.addr, "GET", "/metrics", b"");
        text.lines()
            .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
            .unwrap_or(0.0)
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then the exit status.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let pid = i32::try_from(self.child.id()).unwrap();
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        self.child.wait().unwrap()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.kill();
    }
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("audit.db").display())
}

/// The PostgreSQL URL tests/run.sh exported, or `None` (a visible skip). A URL that is set
/// but unreachable fails the test.
fn postgres_url(test: &str) -> Option<String> {
    match std::env::var("ENGY_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => {
            let host = url
                .rsplit_once('@')
                .map(|(_, h)| h)
                .unwrap_or(&url)
                .split('/')
                .next()
                .unwrap_or("");
            assert!(
                TcpStream::connect(host).is_ok(),
                "ENGY_TEST_POSTGRES_URL is set ({url}) but nothing answers at {host}"
            );
            Some(url)
        }
        _ => {
            eprintln!("SKIP {test}: ENGY_TEST_POSTGRES_URL is not set (tests/run.sh sets it)");
            None
        }
    }
}

/// A model name of this test only: tests sharing a PostgreSQL database never claim each
/// other's jobs (a claim names the models a worker holds).
fn model_name(test: &str) -> String {
    format!("devnet-{test}-{}", std::process::id())
}

#[test]
fn refused_reports_store_nothing_and_a_duplicate_is_one_job() {
    let fx = Fixture::new();
    let t = tempfile::tempdir().unwrap();
    let svc = Service::start(
        &sqlite_url(t.path()),
        &[("devnet", &fx.checkpoint)],
        &["--device", "none", "--max-report-bytes", "65536"],
    );
    let good = fx.commitment("Explain the audit?", 40, true);
    let mut no_toploc = good.clone();
    no_toploc.as_object_mut().unwrap().remove("toploc");
    let mut bad_n = good.clone();
    bad_n["toploc"]["n_tokens"] = json!("forty");
    let padded = {
        let mut c = good.clone();
        c["padding"] = json!("x".repeat(70_000));
        report("r-big", &hotkey("honest"), "devnet", &c)
    };
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{not json".to_vec(), 400, "body"),
        (b"[1, 2]".to_vec(), 400, "body"),
        (
            br#"{"request_id": "a", "request_id": "b"}"#.to_vec(),
            400,
            "body",
        ),
        (
            serde_json::to_vec(
                &json!({"hotkey": &hotkey("honest"), "model": "devnet", "commitment": good}),
            )
            .unwrap(),
            400,
            "request_id",
        ),
        (report("r1", "not-a-hotkey", "devnet", &good), 400, "hotkey"),
        (
            report("r1", &hotkey("honest"), "gpt-5", &good),
            422,
            "model",
        ),
        (
            report("r1", &hotkey("honest"), "devnet", &json!("text")),
            400,
            "commitment",
        ),
        (
            report("r1", &hotkey("honest"), "devnet", &no_toploc),
            400,
            "commitment",
        ),
        (
            report("r1", &hotkey("honest"), "devnet", &bad_n),
            400,
            "commitment.toploc.n_tokens",
        ),
        (padded, 413, "body"),
    ];
    for (body, code, field) in &cases {
        let (got, v) = svc.post(body);
        assert_eq!(got, *code, "{v}");
        assert_eq!(v["field"], *field, "{v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let h = svc.health();
    assert_eq!(h["requests"], 0, "a refused report stored something: {h}");
    assert_eq!(
        svc.metric("engy_audit_requests_total{outcome=\"refused\"}"),
        cases.len() as f64
    );

    let body = report("r1", &hotkey("honest"), "devnet", &good);
    let (code, v) = svc.post(&body);
    assert_eq!(code, 202, "{v}");
    assert_eq!(v["stored"], "new");
    assert_eq!(v["digest"], digest_of(&good));
    // The same commitment again, even under another request id: one request, one job.
    for id in ["r1", "r1-retry"] {
        let (code, v) = svc.post(&report(id, &hotkey("honest"), "devnet", &good));
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["stored"], "duplicate");
    }
    let digest = digest_of(&good);
    let status = wait_for("the sampling decision", || {
        let (_, s) = get_json(svc.addr, &format!("/v1/requests/{digest}"));
        (s["sampled"] == true).then_some(s)
    });
    assert_eq!(status["job_state"], "queued", "{status}");
    let h = svc.health();
    assert_eq!(h["requests"], 1, "{h}");
    assert_eq!(h["jobs"]["queued"], 1, "{h}");
}

/// Honest, cheating and malformed commitments audited to pass / cheat / unproven; the miner
/// summaries and §8's gate; a cheat's evidence re-checked by `engy-audit audit` on its own.
fn audits_to_verdicts(db: &str, model: &str) {
    let fx = Fixture::new();
    let mut svc = Service::start(db, &[(model, &fx.checkpoint)], &[]);
    let honest = fx.commitment("What is a Merkle tree?", 40, true);
    let cheat = fx.commitment("What is a Merkle tree?", 40, false);
    let mut broken = fx.commitment("And a hash?", 40, true);
    broken["toploc"]["n_tokens"] = json!(3);
    let mut digests = Vec::new();
    let (honest_key, cheat_key) = (
        hotkey(&format!("{model}/honest")),
        hotkey(&format!("{model}/cheat")),
    );
    for (i, (key, c)) in [
        (&honest_key, &honest),
        (&cheat_key, &cheat),
        (&honest_key, &broken),
    ]
    .into_iter()
    .enumerate()
    {
        let (code, v) = svc.post(&report(&format!("req-{i}"), key, model, c));
        assert_eq!(code, 202, "{v}");
        digests.push(v["digest"].as_str().unwrap().to_owned());
    }
    let verdicts: Vec<Value> = digests.iter().map(|d| svc.verdict(d)).collect();
    assert_eq!(verdicts[0]["verdict"], "pass", "{}", verdicts[0]);
    assert_eq!(verdicts[1]["verdict"], "cheat", "{}", verdicts[1]);
    assert!(verdicts[1]["reasons"][0]
        .as_str()
        .is_some_and(|r| r.starts_with("toploc:")));
    assert!(verdicts[1]["score"].as_f64().unwrap() > 0.2);
    assert_eq!(verdicts[2]["verdict"], "unproven", "{}", verdicts[2]);

    let (_, m) = get_json(svc.addr, &format!("/v1/miners/{cheat_key}"));
    assert_eq!(
        (m["cheat"].clone(), m["judged"].clone()),
        (json!(1), json!(1)),
        "{m}"
    );
    assert_eq!(m["cheat_rate"], 1.0);
    assert_eq!(m["models"][model]["cheat"], 1, "{m}");
    let (_, h) = get_json(svc.addr, &format!("/v1/miners/{honest_key}"));
    assert_eq!(
        (h["pass"].clone(), h["unproven"].clone()),
        (json!(1), json!(1)),
        "{h}"
    );
    assert_eq!(h["gate_fires"], false);
    let (_, all) = get_json(svc.addr, "/v1/verdicts?since=0");
    let listed: Vec<&str> = all["verdicts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["digest"].as_str())
        .collect();
    for d in &digests {
        assert!(listed.contains(&d.as_str()), "{d} not in {all}");
    }

    // The evidence: the commitment's bytes as reported, which the auditor re-checks alone.
    let (code, text) = http(
        svc.addr,
        "GET",
        &format!("/v1/evidence/{}/commitment.json", digests[1]),
        b"",
    );
    assert_eq!(code, 200);
    {
        use sha2::Digest as _;
        assert_eq!(
            hex::encode(sha2::Sha256::digest(text.as_bytes())),
            digests[1]
        );
    }
    let t = tempfile::tempdir().unwrap();
    let file = t.path().join("commitment.json");
    std::fs::write(&file, &text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(["audit", "--checkpoint"])
        .arg(&fx.checkpoint)
        .arg("--commitment")
        .arg(&file)
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "the evidence is a cheat on its own"
    );
    let (code, _) = http(
        svc.addr,
        "GET",
        &format!("/v1/evidence/{}/commitment.json", digests[0]),
        b"",
    );
    assert_eq!(code, 404, "a pass keeps no evidence");

    assert_eq!(
        svc.metric("engy_audit_audits_total{verdict=\"cheat\"}"),
        1.0
    );
    assert!(svc.metric("engy_audit_audit_seconds_count") >= 3.0);
    // SIGTERM with nothing in hand: a clean exit.
    assert!(svc.terminate().success());
}

#[test]
fn reports_are_audited_to_verdicts_on_sqlite() {
    let t = tempfile::tempdir().unwrap();
    audits_to_verdicts(&sqlite_url(t.path()), "devnet");
}

#[test]
fn reports_are_audited_to_verdicts_on_postgres() {
    let Some(url) = postgres_url("reports_are_audited_to_verdicts_on_postgres") else {
        return;
    };
    audits_to_verdicts(&url, &model_name("verdicts"));
}

/// A worker SIGKILLed while it audits: its lease runs out, a second process takes the job
/// and writes the one verdict.
fn killed_worker(db: &str, model: &str) {
    let fx = Fixture::new();
    let mut a = Service::start(db, &[(model, &fx.checkpoint)], &["--lease-s", "2"]);
    let c = fx.commitment("Tell me a long story about audits.", 400, true);
    let (code, v) = a.post(&report("long", &hotkey("honest"), model, &c));
    assert_eq!(code, 202, "{v}");
    let digest = v["digest"].as_str().unwrap().to_owned();
    let claimed = a.wait_line("the claim", |v| {
        v["message"] == "audit claimed" && v["digest"] == digest.as_str()
    });
    a.kill();
    let mut b = Service::start(db, &[(model, &fx.checkpoint)], &["--lease-s", "2"]);
    let verdict = b.verdict(&digest);
    assert_eq!(verdict["verdict"], "pass", "{verdict}");
    assert_ne!(
        verdict["worker"], claimed["worker"],
        "the killed worker wrote the verdict: the audit ended before the kill"
    );
    let (_, status) = get_json(b.addr, &format!("/v1/requests/{digest}"));
    assert_eq!(status["attempts"], 2, "{status}");
    assert_eq!(b.metric("engy_audit_lease_expiries_total"), 1.0);
    b.kill();
}

#[test]
fn a_killed_worker_loses_its_job_to_another_on_sqlite() {
    let t = tempfile::tempdir().unwrap();
    killed_worker(&sqlite_url(t.path()), "devnet");
}

#[test]
fn a_killed_worker_loses_its_job_to_another_on_postgres() {
    let Some(url) = postgres_url("a_killed_worker_loses_its_job_to_another_on_postgres") else {
        return;
    };
    killed_worker(&url, &model_name("killed"));
}

/// Two processes' workers on one queue: every job audited once.
fn two_workers(db: &str, model: &str) {
    let fx = Fixture::new();
    let a = Service::start(db, &[(model, &fx.checkpoint)], &[]);
    let b = Service::start(db, &[(model, &fx.checkpoint)], &[]);
    let mut digests = Vec::new();
    for i in 0..8 {
        let c = fx.commitment(&format!("Question number {i}?"), 24, true);
        let target = if i % 2 == 0 { &a } else { &b };
        let (code, v) = target.post(&report(&format!("q{i}"), &hotkey("honest"), model, &c));
        assert_eq!(code, 202, "{v}");
        digests.push(v["digest"].as_str().unwrap().to_owned());
    }
    for d in &digests {
        assert_eq!(a.verdict(d)["verdict"], "pass");
        let (_, s) = get_json(a.addr, &format!("/v1/requests/{d}"));
        assert_eq!(s["attempts"], 1, "audited more than once: {s}");
    }
    let total = a.metric("engy_audit_audits_total{verdict=\"pass\"}")
        + b.metric("engy_audit_audits_total{verdict=\"pass\"}");
    assert_eq!(
        total,
        digests.len() as f64,
        "audits done by the two processes"
    );
}

#[test]
fn two_workers_share_one_queue_on_sqlite() {
    let t = tempfile::tempdir().unwrap();
    two_workers(&sqlite_url(t.path()), "devnet");
}

#[test]
fn two_workers_share_one_queue_on_postgres() {
    let Some(url) = postgres_url("two_workers_share_one_queue_on_postgres") else {
        return;
    };
    two_workers(&url, &model_name("two"));
}

#[test]
fn a_model_that_cannot_be_opened_keeps_its_jobs() {
    let fx = Fixture::new();
    let t = tempfile::tempdir().unwrap();
    let missing = t.path().join("no-such-checkpoint");
    let mut svc = Service::start(
        &sqlite_url(t.path()),
        &[("devnet", &fx.checkpoint), ("other", &missing)],
        &[],
    );
    let error = svc.wait_line("the model error", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("model not loaded"))
    });
    assert_eq!(error["level"], "ERROR");
    assert!(
        error["error"]
            .as_str()
            .is_some_and(|e| e.contains("no-such-checkpoint") && e.contains("model other")),
        "{error}"
    );
    let c = fx.commitment("Which model?", 24, true);
    let (code, v) = svc.post(&report("o1", &hotkey("honest"), "other", &c));
    assert_eq!(code, 202, "{v}");
    let digest = v["digest"].as_str().unwrap().to_owned();
    // A report of the loaded model, sent after it, is audited: the worker runs on.
    let d = fx.commitment("Which model, again?", 24, true);
    let (_, v2) = svc.post(&report("d1", &hotkey("honest"), "devnet", &d));
    let done = svc.verdict(v2["digest"].as_str().unwrap());
    assert_eq!(done["verdict"], "pass");
    let (_, s) = get_json(svc.addr, &format!("/v1/requests/{digest}"));
    assert_eq!(s["job_state"], "queued", "{s}");
    assert!(
        s["note"]
            .as_str()
            .is_some_and(|n| n.contains("no worker of this process holds model other")),
        "{s}"
    );
    let h = svc.health();
    assert_eq!(h["status"], "degraded", "{h}");
}

/// A private PostgreSQL server (tests/postgres.sh), stopped on drop.
struct PrivatePostgres {
    dir: tempfile::TempDir,
    url: String,
}

impl PrivatePostgres {
    fn script() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/postgres.sh")
    }

    fn start() -> PrivatePostgres {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = tempfile::tempdir().unwrap();
        let out = Command::new("bash")
            .arg(Self::script())
            .args(["start", &port.to_string()])
            .arg(dir.path().join("pg"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tests/postgres.sh start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let url = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        PrivatePostgres { dir, url }
    }

    fn restart(&self) {
        let out = Command::new("bash")
            .arg(Self::script())
            .arg("restart")
            .arg(self.dir.path().join("pg"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tests/postgres.sh restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(Self::script())
            .arg("stop")
            .arg(self.dir.path().join("pg"))
            .output();
    }
}

/// PostgreSQL restarted while reports come in and audits run: every report the service
/// accepted gets its one verdict (reports sent while the server is down are answered 503 and
/// sent again, as a gateway does).
#[test]
fn postgres_restarted_mid_run_loses_nothing() {
    if postgres_url("postgres_restarted_mid_run_loses_nothing").is_none() {
        return;
    }
    let pg = PrivatePostgres::start();
    let fx = Fixture::new();
    let model = model_name("restart");
    let svc = Service::start(&pg.url, &[(&model, &fx.checkpoint)], &["--lease-s", "3"]);
    let key = hotkey(&model);
    let mut digests = Vec::new();
    let mut unavailable = 0;
    for i in 0..6 {
        if i == 3 {
            pg.restart();
        }
        let c = fx.commitment(&format!("Restart question {i}?"), 24, true);
        let body = report(&format!("pg{i}"), &key, &model, &c);
        let v = wait_for("the report to be accepted", || {
            let (code, v) = svc.post(&body);
            if code == 503 {
                unavailable += 1;
            }
            (code == 202).then_some(v)
        });
        digests.push(v["digest"].as_str().unwrap().to_owned());
    }
    for d in &digests {
        let v = svc.verdict(d);
        assert_eq!(v["verdict"], "pass", "{v}");
    }
    let (_, m) = get_json(svc.addr, &format!("/v1/miners/{key}"));
    assert_eq!(m["pass"], digests.len(), "{m}; 503 answers: {unavailable}");
}

/// `u64le(seed[0..8]) / 2^64`, the number the rate compares (docs/PROTOCOL.md §11.2),
/// computed here from the spec's formula and the fixed beacon.
fn seed_of(digest: &str) -> [u8; 32] {
    let beacon = engy_core::commit::parse_digest(BEACON).unwrap();
    let d = engy_core::commit::parse_digest(digest).unwrap();
    engy_core::cells::production_seed(&beacon, &d)
}

fn uniform(seed: &[u8; 32]) -> f64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&seed[..8]);
    u64::from_le_bytes(b) as f64 / 18_446_744_073_709_551_616.0
}

/// The rate samples exactly the requests whose production seed falls under it, and the
/// floor tops a miner up at the window's end with its requests of lowest seed, not its first
/// ones: a miner that serves its first K requests of a window honestly and cheats on the
/// rest is audited on requests it could not pick.
#[test]
fn sampling_follows_the_production_seed_and_the_floor_is_unpredictable() {
    let fx = Fixture::new();
    let t = tempfile::tempdir().unwrap();
    let svc = Service::start(
        &sqlite_url(t.path()),
        &[("devnet", &fx.checkpoint)],
        &[
            "--device",
            "none",
            "--sample-rate",
            "0.3",
            "--floor",
            "7",
            "--window-s",
            &WINDOW_S.to_string(),
        ],
    );
    let key = hotkey("sampled");
    // The same commitments in every run (a private database): the seeds, and so the case
    // below (some sampled by the rate, some by the floor), are fixed. They are made first, so
    // that the ten reports are posted together, inside one window (windows start on multiples
    // of their length on the service's clock, this machine's): the floor is per window.
    const WINDOW_S: u64 = 6;
    let commitments: Vec<Value> = (0..10)
        .map(|i| fx.commitment_exact(&format!("Sampling question {i}?"), 8, true))
        .collect();
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let window_ms = WINDOW_S * 1000;
    // Start in the first sixth of a window, leaving five seconds for ten local posts.
    while now_ms() % window_ms > window_ms / 6 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let started = now_ms();
    let mut digests = Vec::new();
    for (i, c) in commitments.iter().enumerate() {
        let (code, v) = svc.post(&report(&format!("s{i}"), &key, "devnet", c));
        assert_eq!(code, 202, "{v}");
        digests.push(v["digest"].as_str().unwrap().to_owned());
    }
    assert_eq!(
        started / window_ms,
        now_ms() / window_ms,
        "the ten reports took longer than a window to post; the case needs them in one"
    );
    let status = |d: &str| get_json(svc.addr, &format!("/v1/requests/{d}")).1;
    // Every decision is the rate's, until the window has ended.
    let first: Vec<Value> = digests
        .iter()
        .map(|d| {
            wait_for("the decision", || {
                Some(status(d)).filter(|s| !s["sampled"].is_null())
            })
        })
        .collect();
    let by_rate: Vec<bool> = digests.iter().map(|d| uniform(&seed_of(d)) < 0.3).collect();
    for ((s, rate), d) in first.iter().zip(&by_rate).zip(&digests) {
        if *rate {
            assert_eq!(s["sampled"], true, "{d}: {s}");
            assert_eq!(s["sample_reason"], "rate", "{d}: {s}");
        }
    }
    // After the window: at least 7 sampled, the extra ones those of lowest seed.
    let want = by_rate.iter().filter(|r| **r).count().max(7);
    let finals: Vec<Value> = wait_for("the floor's top-up", || {
        let all: Vec<Value> = digests.iter().map(|d| status(d)).collect();
        let n = all.iter().filter(|s| s["sampled"] == true).count();
        (n >= want).then_some(all)
    });
    let mut unsampled_by_rate: Vec<(String, &str)> = digests
        .iter()
        .zip(&by_rate)
        .filter(|(_, r)| !**r)
        .map(|(d, _)| (hex::encode(seed_of(d)), d.as_str()))
        .collect();
    unsampled_by_rate.sort();
    let floor_picks = want - by_rate.iter().filter(|r| **r).count();
    assert!(
        floor_picks > 0 && floor_picks < want,
        "the fixed commitments exercise both the rate and the floor: {by_rate:?}"
    );
    for (i, (_, d)) in unsampled_by_rate.iter().enumerate() {
        let s = &finals[digests.iter().position(|x| x == d).unwrap()];
        if i < floor_picks {
            assert_eq!(s["sampled"], true, "{s}");
            assert_eq!(s["sample_reason"], "floor", "{s}");
        } else {
            assert_eq!(s["sampled"], false, "{s}");
        }
    }
    assert_eq!(
        finals.iter().filter(|s| s["sampled"] == true).count(),
        want,
        "{finals:?}"
    );
}

/// SIGTERM while an audit runs and `--drain-s 0`: the job goes back to the queue (its claim
/// not counted), the process exits 0, and the next process audits it.
#[test]
fn sigterm_gives_the_job_in_hand_back() {
    let fx = Fixture::new();
    let t = tempfile::tempdir().unwrap();
    let db = sqlite_url(t.path());
    let mut a = Service::start(&db, &[("devnet", &fx.checkpoint)], &["--drain-s", "0"]);
    let c = fx.commitment("Tell me a long story about shutdowns.", 400, true);
    let (code, v) = a.post(&report("term", &hotkey("term"), "devnet", &c));
    assert_eq!(code, 202, "{v}");
    let digest = v["digest"].as_str().unwrap().to_owned();
    a.wait_line("the claim", |v| v["message"] == "audit claimed");
    assert!(a.terminate().success(), "SIGTERM exits 0");
    assert!(
        a.log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("its job is back in the queue")),
        "the job was not given back"
    );
    let b = Service::start(&db, &[("devnet", &fx.checkpoint)], &[]);
    let (_, s) = get_json(b.addr, &format!("/v1/requests/{digest}"));
    assert!(
        s["job_state"] == "queued" || s["job_state"] == "leased",
        "{s}"
    );
    assert_eq!(b.verdict(&digest)["verdict"], "pass");
    let (_, s) = get_json(b.addr, &format!("/v1/requests/{digest}"));
    assert_eq!(
        s["attempts"], 1,
        "the interrupted claim is not counted: {s}"
    );
}

/// How a scripted miner answers `open_cells` (docs/PROTOCOL.md §10).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Opens {
    /// The cells it committed, honestly computed.
    Honest,
    /// The cells it committed, of a serve that fabricated its block outputs: the openings
    /// verify against its root, the values do not against the weights.
    Fabricated,
    /// `cells_error unknown_request` inside the retention window.
    Refuses,
    /// Nothing.
    Silent,
}

/// One miner: its leg to the gateway double (HELLO with its key), the cells it committed
/// (tree and cells) by request id, and how it answers.
async fn miner_leg(
    url: String,
    key: String,
    held: std::collections::HashMap<
        String,
        (engy_core::cells::CellTree, Vec<engy_core::cells::Cell>),
    >,
    how: Opens,
) {
    use futures_util::{SinkExt as _, StreamExt as _};
    use tokio_tungstenite::tungstenite::Message;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("{url}/"))
        .await
        .expect("the miner's leg connects");
    let hello = json!({
        "type": "hello", "miner_key": key, "model": "devnet", "model_root": "00",
        "hw": {}, "versions": {}, "capacity": {"max_inflight": 1},
        "worker_name": "w", "instance_id": "w", "worker_id": "0",
    });
    ws.send(Message::Text(hello.to_string().into()))
        .await
        .unwrap();
    while let Some(Ok(m)) = ws.next().await {
        let Message::Text(t) = m else { continue };
        let v: Value = serde_json::from_str(t.as_str()).unwrap();
        if v["type"] != "open_cells" {
            continue;
        }
        let rid = v["request_id"].as_str().unwrap_or("").to_owned();
        let answer = match (how, held.get(&rid)) {
            (Opens::Silent, _) => continue,
            (Opens::Refuses, _) | (_, None) => json!({
                "type": "cells_error", "request_id": rid, "reason": "unknown_request",
                "error": "no cells held for that request",
            }),
            (Opens::Honest | Opens::Fabricated, Some((tree, cells))) => {
                let seed = engy_core::commit::parse_digest(v["seed"].as_str().unwrap()).unwrap();
                let n = v["n"].as_u64().unwrap();
                let b = cells_common::bundle(tree, cells, seed, n);
                let openings = serde_json::to_value(&b).unwrap()["openings"].clone();
                json!({"type": "cells", "request_id": rid,
                       "root": hex::encode(tree.root()), "openings": openings})
            }
        };
        ws.send(Message::Text(answer.to_string().into()))
            .await
            .unwrap();
    }
}

/// The cell challenge through the gateway (docs/PROTOCOL.md §11.3), four miners, one report
/// each, every commitment carrying cells: the service sends `open_cells` with the auditor's
/// seed (`production_seed(beacon, digest)`) and `n`; the honest opening passes, the
/// fabricated one is a cheat whose evidence `engy-audit cells` re-checks alone, a refusal
/// inside the retention window is a cheat, and a miner that never answers is `unanswered`
/// once the deadline has passed.
#[test]
fn the_cell_challenge_goes_through_the_gateway_and_judges_each_answer() {
    let fx = Fixture::new();
    let t = tempfile::tempdir().unwrap();
    let spec = t.path().join("spec");
    let o = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(["spec", "build", "--quiet", "--checkpoint"])
        .arg(&fx.checkpoint)
        .arg("--out")
        .arg(&spec)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{o:?}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let gw = rt
        .block_on(engy_devnet::gateway::GatewayDouble::start(
            engy_devnet::gateway::GatewayConfig::default(),
        ))
        .unwrap();
    let mut reports = Vec::new();
    for (i, how) in [
        Opens::Honest,
        Opens::Fabricated,
        Opens::Refuses,
        Opens::Silent,
    ]
    .into_iter()
    .enumerate()
    {
        let mut c = fx.commitment(&format!("Open your cells, miner {i}?"), 12, true);
        let ids: Vec<u32> = c["toploc"]["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .chain(c["output_token_ids"].as_array().unwrap())
            .map(|v| u32::try_from(v.as_u64().unwrap()).unwrap())
            .collect();
        let serve = if how == Opens::Fabricated {
            engy_model::cells::CellServe::FabricatedY
        } else {
            engy_model::cells::CellServe::Honest
        };
        let (tree, cells) = cells_common::serve(&fx.honest.model, &ids, serve);
        c["cells"] = json!({
            "scheme": engy_core::cells::SCHEME,
            "root": hex::encode(tree.root()),
            "shape": serde_json::to_value(tree.shape()).unwrap(),
        });
        let key = format!("miner-key-{i}");
        let hk = hotkey(&format!("cells-{how:?}"));
        gw.register_miner(&key, &hk);
        let rid = format!("req-{i}-{}", run_nonce());
        let held = std::collections::HashMap::from([(rid.clone(), (tree, cells))]);
        rt.spawn(miner_leg(gw.url(), key, held, how));
        reports.push((how, rid, hk, c));
    }
    rt.block_on(gw.wait_legs(4, DEADLINE)).expect("four legs");

    let svc = Service::start(
        &sqlite_url(t.path()),
        &[("devnet", &fx.checkpoint)],
        &[
            "--gateway",
            &format!("http://{}", gw.addr()),
            "--challenge-deadline-s",
            "3",
            "--spec",
            &format!("devnet={}", spec.display()),
        ],
    );
    for (_, rid, hk, c) in &reports {
        let (code, v) = svc.post(&report(rid, hk, "devnet", c));
        assert_eq!(code, 202, "{v}");
    }
    let mut verdicts = std::collections::HashMap::new();
    for (how, rid, hk, c) in &reports {
        let digest = digest_of(c);
        let v = svc.verdict(&digest);
        // The challenge the gateway carried is the auditor's: its seed, its n.
        let sent: Vec<Value> = gw
            .frames()
            .iter()
            .filter(|f| f.kind() == "open_cells" && f.value["request_id"] == json!(rid))
            .map(|f| f.value.clone())
            .collect();
        assert_eq!(sent.len(), 1, "{how:?}: {sent:?}");
        assert_eq!(sent[0]["seed"], hex::encode(seed_of(&digest)), "{how:?}");
        assert_eq!(sent[0]["n"], 32, "{how:?}");
        let (_, m) = get_json(svc.addr, &format!("/v1/miners/{hk}"));
        verdicts.insert(*how, (digest, v, m));
    }
    let (_, honest, m) = &verdicts[&Opens::Honest];
    assert_eq!(honest["verdict"], "pass", "{honest}");
    assert_eq!(honest["report"]["cells"]["outcome"], "pass", "{honest}");
    assert_eq!(m["pass"], 1, "{m}");
    // The answered bundle's counts enter the miner's near-tie ledger.
    let stats = &honest["report"]["cells"]["bundle"]["stats"];
    assert_eq!(honest["cells_judged"], stats["n"], "{honest}");
    assert_eq!(honest["near_ties"], stats["near_ties"], "{honest}");
    assert_eq!(m["near_ties"]["bundles"], 1, "{m}");
    assert_eq!(m["near_ties"]["cells"], stats["n"], "{m}");
    assert_eq!(m["near_tie_flagged"], false, "{m}");

    let (digest, cheat, m) = &verdicts[&Opens::Fabricated];
    assert_eq!(cheat["verdict"], "cheat", "{cheat}");
    assert_eq!(cheat["report"]["cells"]["outcome"], "cheat", "{cheat}");
    assert!(cheat["reasons"].to_string().contains("cells:"), "{cheat}");
    assert_eq!(m["cheat"], 1, "{m}");
    // Anyone re-checks the cheat from the exported evidence, without the service.
    for name in ["commitment.json", "bundle.json"] {
        let (code, body) = http(
            svc.addr,
            "GET",
            &format!("/v1/evidence/{digest}/{name}"),
            b"",
        );
        assert_eq!(code, 200, "{name}: {body}");
        std::fs::write(t.path().join(name), body).unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(["cells", "--checkpoint"])
        .arg(&fx.checkpoint)
        .arg("--spec")
        .arg(&spec)
        .arg("--commitment")
        .arg(t.path().join("commitment.json"))
        .arg("--bundle")
        .arg(t.path().join("bundle.json"))
        .args(["--beacon", BEACON])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "engy-audit cells: {o:?}");

    let (_, refused, m) = &verdicts[&Opens::Refuses];
    assert_eq!(refused["verdict"], "cheat", "{refused}");
    assert!(
        refused["reasons"]
            .to_string()
            .contains("cells_error unknown_request"),
        "{refused}"
    );
    assert_eq!(m["cheat"], 1, "{m}");

    let (_, silent, m) = &verdicts[&Opens::Silent];
    assert_eq!(silent["verdict"], "unanswered", "{silent}");
    assert_eq!(
        silent["report"]["cells"]["outcome"], "unanswered",
        "{silent}"
    );
    assert!(
        silent["reasons"].to_string().contains("by the deadline"),
        "{silent}"
    );
    assert_eq!(m["unanswered"], 1, "{m}");
    assert!(svc.metric("engy_audit_challenges_total{outcome=\"unanswered\"}") >= 1.0);
    drop(svc);
    drop(gw);
}

/// The `ENGY_*` names `engy-audit serve --help` documents.
fn serve_help_env() -> std::collections::BTreeSet<String> {
    let o = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("ENGY_"))
        .map(str::to_owned)
        .collect()
}

/// docker/compose.audit.yml as `compose config` resolves it (podman-compose here; CI installs
/// it with `bash docker/ci-images.sh tools`): the service reaches the compose file's
/// PostgreSQL with the operator's password, waits for it to be healthy, and every setting it
/// passes is one `engy-audit serve --help` documents; without the password nothing resolves.
#[test]
fn the_audit_compose_file_runs_the_service_on_its_postgres() {
    let compose = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docker/compose.audit.yml");
    let have = Command::new("podman-compose")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but podman-compose is missing (bash docker/ci-images.sh tools installs it)"
        );
        println!("skipped: no podman-compose here (bash docker/ci-images.sh tools)");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let config = |env: &str| {
        let f = t.path().join(".env.audit");
        std::fs::write(&f, env).unwrap();
        Command::new("podman-compose")
            .arg("--env-file")
            .arg(&f)
            .arg("-f")
            .arg(&compose)
            .arg("config")
            .current_dir(t.path())
            .env_remove("ENGY_AUDIT_DB_PASSWORD")
            .output()
            .unwrap()
    };
    let o = config("ENGY_AUDIT_DB_PASSWORD=pw-4711\nENGY_AUDIT_MODELS=devnet=/models/m\n");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{o:?}");
    assert!(
        out.contains("ENGY_AUDIT_DB: postgres://engy:pw-4711@postgres:5432/engy"),
        "{out}"
    );
    assert!(out.contains("POSTGRES_PASSWORD: pw-4711"), "{out}");
    assert!(out.contains("condition: service_healthy"), "{out}");
    assert!(out.contains("dockerfile: docker/Dockerfile.audit"), "{out}");
    let documented = serve_help_env();
    let passed: Vec<String> = out
        .lines()
        .filter_map(|l| l.trim().split_once(':').map(|(k, _)| k.to_owned()))
        .filter(|k| k.starts_with("ENGY_AUDIT_") && k != "ENGY_AUDIT_DB_PASSWORD")
        .collect();
    assert!(passed.len() >= 15, "{out}");
    for k in &passed {
        assert!(
            documented.contains(k),
            "compose passes {k}, which `engy-audit serve --help` does not name"
        );
    }
    let o = config("ENGY_AUDIT_MODELS=devnet=/models/m\n");
    assert!(
        !o.status.success()
            && String::from_utf8_lossy(&o.stderr).contains("set ENGY_AUDIT_DB_PASSWORD"),
        "{o:?}"
    );
}

/// `--batch 4`: eight queued reports of one model (honest, cheating, one not provable) are
/// audited in two TOPLOC passes over the weights, each job once, and every verdict is the
/// one `--batch 1` (eight passes) gives.
#[test]
fn a_batch_of_one_models_jobs_gets_the_verdicts_each_gets_alone() {
    let fx = Fixture::new();
    let model = "devnet";
    let commitments: Vec<Value> = (0..8)
        .map(|i| {
            let mut c = fx.commitment(&format!("Batched question {i}?"), 24, i % 3 != 1);
            if i == 5 {
                c["toploc"]["n_tokens"] = json!(3);
            }
            c
        })
        .collect();
    let mut runs = Vec::new();
    for batch in ["1", "4"] {
        let dir = tempfile::tempdir().unwrap();
        let db = sqlite_url(dir.path());
        // Every report queued first, by a process with no worker, so that the worker finds
        // all eight at once.
        let mut intake = Service::start(&db, &[(model, &fx.checkpoint)], &["--device", "none"]);
        let digests: Vec<String> = commitments
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (code, v) = intake.post(&report(&format!("b{i}"), &hotkey("batch"), model, c));
                assert_eq!(code, 202, "{v}");
                v["digest"].as_str().unwrap().to_owned()
            })
            .collect();
        assert!(intake.terminate().success());
        let svc = Service::start(&db, &[(model, &fx.checkpoint)], &["--batch", batch]);
        let verdicts: Vec<Value> = digests
            .iter()
            .map(|d| {
                let v = svc.verdict(d);
                let (_, s) = get_json(svc.addr, &format!("/v1/requests/{d}"));
                assert_eq!(s["attempts"], 1, "audited more than once: {s}");
                json!([v["verdict"], v["reasons"], v["score"]])
            })
            .collect();
        let written: f64 = ["pass", "cheat", "unproven", "unanswered"]
            .iter()
            .map(|k| svc.metric(&format!("engy_audit_audits_total{{verdict=\"{k}\"}}")))
            .sum();
        assert_eq!(written, 8.0, "each verdict written exactly once");
        runs.push((verdicts, svc.metric("engy_audit_audit_passes_total")));
    }
    let kinds: Vec<&Value> = runs[0].0.iter().map(|v| &v[0]).collect();
    assert!(kinds.contains(&&json!("pass")), "{kinds:?}");
    assert!(kinds.contains(&&json!("cheat")), "{kinds:?}");
    assert_eq!(kinds[5], &json!("unproven"));
    assert_eq!(
        runs[0].0, runs[1].0,
        "batched verdicts differ from one-by-one"
    );
    assert_eq!(runs[0].1, 8.0, "--batch 1: one pass per job");
    assert_eq!(runs[1].1, 2.0, "--batch 4: two passes for eight jobs");
}

/// The near-tie ledger: a miner whose answered bundles each stay under the near-tie limit of
/// their own 32 cells, but whose running total over all its audits reaches the limit of the
/// summed cells (`engy_model::cells::stats::near_ties_flagged`), is marked in
/// `GET /v1/miners/{hotkey}`; after one such bundle it is not. The reports are real and queued
/// by the binary; each verdict, with its bundle's recorded (near-tie cells, judged cells), is
/// written through the store's lease-and-finish path as a worker writes it.
#[test]
fn near_ties_that_pass_alone_are_flagged_over_the_miners_ledger_on_sqlite() {
    let t = tempfile::tempdir().unwrap();
    near_tie_ledger(&sqlite_url(t.path()), "devnet");
}

#[test]
fn near_ties_that_pass_alone_are_flagged_over_the_miners_ledger_on_postgres() {
    let Some(url) =
        postgres_url("near_ties_that_pass_alone_are_flagged_over_the_miners_ledger_on_postgres")
    else {
        return;
    };
    near_tie_ledger(&url, &model_name("near-tie"));
}

fn near_tie_ledger(db: &str, model: &str) {
    use engy_audit_service::store::{now_ms, Store, VerdictRow};
    use engy_model::cells::stats::{near_tie_limit, near_ties_flagged, StatsPolicy};
    let policy = StatsPolicy::default();
    const CELLS: usize = 32;
    let per_bundle = near_tie_limit(CELLS, policy.near_tie_rate, policy.false_flag) - 1;
    assert!(per_bundle >= 1 && !near_ties_flagged(per_bundle, CELLS, &policy));

    let fx = Fixture::new();
    let key = hotkey("near-tie");
    let mut intake = Service::start(db, &[(model, &fx.checkpoint)], &["--device", "none"]);
    for i in 0..8 {
        let c = fx.commitment(&format!("Near-tie question {i}?"), 16, true);
        let (code, v) = intake.post(&report(&format!("nt{i}"), &key, model, &c));
        assert_eq!(code, 202, "{v}");
    }
    assert!(intake.terminate().success());

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = rt.block_on(Store::open(db)).unwrap();
    // Writes `count` verdicts, each a pass whose bundle had `per_bundle` near-ties of CELLS.
    let record = |count: usize| {
        rt.block_on(async {
            for _ in 0..count {
                let job = store
                    .claim("recorder", &[model.to_owned()], now_ms(), 60_000)
                    .await
                    .unwrap()
                    .expect("a queued job");
                let row = VerdictRow {
                    digest: job.digest.clone(),
                    request_id: job.request_id.clone(),
                    hotkey: job.hotkey.clone(),
                    model: job.model.clone(),
                    verdict: "pass".into(),
                    reasons: vec![],
                    score: Some(0.0),
                    worker: "recorder".into(),
                    audit_seconds: 0.0,
                    decided_ms: now_ms(),
                    near_ties: Some(per_bundle as u64),
                    cells_judged: Some(CELLS as u64),
                    report: None,
                };
                assert!(store.finish(&job, &row, "{}", None).await.unwrap());
            }
        })
    };
    let miner = || {
        let mut svc = Service::start(db, &[(model, &fx.checkpoint)], &["--device", "none"]);
        let (code, m) = get_json(svc.addr, &format!("/v1/miners/{key}"));
        assert_eq!(code, 200, "{m}");
        assert!(svc.terminate().success());
        m
    };

    record(1);
    let m = miner();
    assert_eq!(m["pass"], 1, "{m}");
    assert_eq!(m["near_ties"]["near_ties"], per_bundle, "{m}");
    assert_eq!(m["near_ties"]["cells"], CELLS, "{m}");
    assert_eq!(
        m["near_tie_flagged"], false,
        "one bundle under its limit: {m}"
    );
    assert!(m["near_tie_reason"].is_null(), "{m}");

    record(7);
    let total = 8 * per_bundle;
    assert!(
        near_ties_flagged(total, 8 * CELLS, &policy),
        "the fixture's total must reach the ledger's limit"
    );
    let m = miner();
    assert_eq!(m["pass"], 8, "{m}");
    assert_eq!(m["near_ties"]["bundles"], 8, "{m}");
    assert_eq!(m["near_ties"]["near_ties"], total, "{m}");
    assert_eq!(m["near_tie_flagged"], true, "{m}");
    assert!(
        m["near_tie_reason"]
            .as_str()
            .is_some_and(|r| r.contains(&format!("{total} of {}", 8 * CELLS))),
        "{m}"
    );
}
