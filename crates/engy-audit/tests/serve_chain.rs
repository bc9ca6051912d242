//! `engy-audit serve --chain` on the REAL subtensor runtime (chopsticks, `../shared/chain/`,
//! started by tests/run.sh, which exports `ENGY_SUBTENSOR_URL`): the sampling beacon is the
//! hash of the first block produced after the report (docs/PROTOCOL.md §11.2,
//! specs/CELLS.md §5). `ENGY_SUBTENSOR_URL` unset → a visible skip; set but unreachable →
//! FAIL.
//!
//! Each test reports requests at rate 0.5, makes the chain produce blocks (chopsticks
//! `dev_newBlock`) and checks every sampling decision against
//! `u64le(production_seed(hash, digest)[0..8]) / 2^64 < 0.5`, the hash read here over RPC:
//! the hash of the first block after the report, never one that existed before it. The
//! chain dropping (every connection to it cut, new ones refused) and coming back loses no
//! report: the decision waits and is then made from the right block. A node whose head goes
//! back (chopsticks `dev_setHead`) does not make the beacon a block seen before the report.
//! The cell challenge's seed that the gateway double carries in `open_cells` is the same
//! `production_seed`.
use std::io::{BufRead, BufReader};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use engy_core::toploc::Params;
use engy_model::audit::commit_greedy;
use engy_model::{gen_model, Checkpoint, GenConfig, Precision};
use serde_json::{json, Value};

mod cells_common;
mod service_common;

use service_common::{hotkey, http, run_nonce};

/// Every wait polls a condition under this deadline.
const DEADLINE: Duration = Duration::from_secs(180);
/// The sampling rate of these tests: each decision is one bit of the seed.
const RATE: f64 = 0.5;
/// Reports per test: a decision pattern made from another block matches by chance with
/// probability 2^-REPORTS.
const REPORTS: usize = 16;

/// The tests of this file produce blocks on one chain: one at a time, so that "the first
/// block after the report" is the one each test makes.
static CHAIN: Mutex<()> = Mutex::new(());

/// `ENGY_SUBTENSOR_URL` (tests/run.sh), or `None` with a visible skip; set but unreachable
/// fails the test.
fn chain_url(test: &str) -> Option<String> {
    match std::env::var("ENGY_SUBTENSOR_URL") {
        Ok(u) if !u.is_empty() => {
            let at = host_port(&u);
            assert!(
                TcpStream::connect(&at).is_ok(),
                "ENGY_SUBTENSOR_URL is set ({u}) but nothing answers at {at}"
            );
            Some(u)
        }
        _ => {
            eprintln!(
                "SKIP {test}: ENGY_SUBTENSOR_URL is not set (tests/run.sh starts chopsticks and \
                 sets it; or start ../shared/chain/start-subtensor.sh PORT and export \
                 ENGY_SUBTENSOR_URL=ws://127.0.0.1:PORT)"
            );
            None
        }
    }
}

/// `host:port` of a ws:// URL.
fn host_port(url: &str) -> String {
    url.trim_start_matches("ws://")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned()
}

/// One JSON-RPC call to the node over HTTP (chopsticks serves HTTP and websockets on one
/// port); panics on an RPC error.
fn rpc(url: &str, method: &str, params: Value) -> Value {
    let body =
        serde_json::to_vec(&json!({"id": 1, "jsonrpc": "2.0", "method": method, "params": params}))
            .unwrap();
    let (code, text) = http(host_port(url), "POST", "/", &body);
    let r: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{method}: HTTP {code}, not JSON ({e}): {text}"));
    assert!(r.get("error").is_none(), "{method}: {r}");
    r["result"].clone()
}

/// The best block's number.
fn best_number(url: &str) -> u64 {
    let h = rpc(url, "chain_getHeader", json!([]));
    let n = h["number"].as_str().expect("header number");
    u64::from_str_radix(n.trim_start_matches("0x"), 16).unwrap()
}

/// The hash of block `number` on the node's canonical chain.
fn hash_of(url: &str, number: u64) -> [u8; 32] {
    let h = rpc(url, "chain_getBlockHash", json!([number]));
    let s = h
        .as_str()
        .unwrap_or_else(|| panic!("no block {number}: {h}"));
    engy_core::commit::parse_digest(s.trim_start_matches("0x")).unwrap()
}

/// chopsticks `dev_newBlock`: one new block.
fn new_block(url: &str) {
    rpc(url, "dev_newBlock", json!([{"count": 1}]));
}

/// Whether the spec's rule samples the request of `digest` when the beacon is `beacon`:
/// `u64le(production_seed(beacon, digest)[0..8]) / 2^64 < RATE` (docs/PROTOCOL.md §11.2).
fn expected_sampled(beacon: &[u8; 32], digest: &str) -> bool {
    let d = engy_core::commit::parse_digest(digest).unwrap();
    let seed = engy_core::cells::production_seed(beacon, &d);
    let mut b = [0u8; 8];
    b.copy_from_slice(&seed[..8]);
    (u64::from_le_bytes(b) as f64 / 18_446_744_073_709_551_616.0) < RATE
}

/// The devnet model and commitments made on it.
struct Fixture {
    _dir: tempfile::TempDir,
    checkpoint: PathBuf,
    honest: Checkpoint,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let checkpoint = dir.path().join("m");
        gen_model(&checkpoint, 3, &GenConfig::default()).unwrap();
        let honest = Checkpoint::open(&checkpoint, Precision::Bf16).unwrap();
        Fixture {
            _dir: dir,
            checkpoint,
            honest,
        }
    }

    /// An honest commitment for the prompt `text` (with this run's nonce, so that a chain
    /// shared by several runs never sees the same digest twice).
    fn commitment(&self, text: &str) -> Value {
        let ck = &self.honest;
        let prompt = ck
            .tokenizer
            .encode(
                format!(
                    "<|im_start|>user\n{text} (run {})<|im_end|>\n<|im_start|>assistant\n",
                    run_nonce()
                ),
                false,
            )
            .unwrap()
            .get_ids()
            .to_vec();
        commit_greedy(&ck.model, &ck.model_root, &prompt, 8, &[], &Params::ENGY).unwrap()
    }
}

fn report(request_id: &str, commitment: &Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "request_id": request_id,
        "hotkey": hotkey("chain"),
        "model": "devnet",
        "commitment": commitment,
        "timing": {"ttft_ms": 12, "total_ms": 340},
    }))
    .unwrap()
}

/// A running `engy-audit serve --chain URL` (rate 0.5, no floor, no workers).
struct Service {
    child: Child,
    addr: SocketAddr,
    lines: mpsc::Receiver<Value>,
    log: Arc<Mutex<Vec<String>>>,
}

impl Service {
    fn start(db_dir: &Path, model: &Path, chain: &str) -> Service {
        Service::start_with(db_dir, model, chain, RATE, &["--device", "none"])
    }

    /// [`Service::start`] at sampling rate `rate`, with `extra` flags.
    fn start_with(db_dir: &Path, model: &Path, chain: &str, rate: f64, extra: &[&str]) -> Service {
        let mut child = Command::new(env!("CARGO_BIN_EXE_engy-audit"))
            .arg("serve")
            .args(["--listen", "127.0.0.1:0"])
            .arg("--db")
            .arg(format!("sqlite://{}", db_dir.join("audit.db").display()))
            .args(["--chain", chain])
            .arg("--model")
            .arg(format!("devnet={}", model.display()))
            .args(["--log-format", "json"])
            .args(extra)
            .env("ENGY_AUDIT_SAMPLE_RATE", rate.to_string())
            .env("ENGY_AUDIT_FLOOR", "0")
            .env_remove("ENGY_AUDIT_FIXED_BEACON")
            // The beacon's reads, each logged at debug (crates/engy-audit-service/src/beacon.rs).
            .env("ENGY_LOG", "info,engy_audit_service::beacon=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn engy-audit serve");
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
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
        let l = s.wait_line("the listening line", |v| v["message"] == "listening");
        s.addr = l["addr"].as_str().unwrap().parse().unwrap();
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

    /// Waits for the service's read of block `number` as a beacon and checks the hash it
    /// read against the node's.
    fn wait_beacon(&mut self, url: &str, number: u64) {
        let used = self.wait_line(&format!("the read of beacon block {number}"), |v| {
            v["message"] == "beacon block" && v["block"] == json!(number)
        });
        assert_eq!(
            used["hash"],
            json!(hex::encode(hash_of(url, number))),
            "{used}"
        );
    }

    fn post(&self, body: &[u8]) -> (u16, Value) {
        let (code, text) = http(self.addr, "POST", "/v1/requests", body);
        (
            code,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    fn status(&self, digest: &str) -> Value {
        let (code, text) = http(self.addr, "GET", &format!("/v1/requests/{digest}"), b"");
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// Every request's `sampled` once all are decided.
    fn decisions(&self, digests: &[String]) -> Vec<bool> {
        let start = Instant::now();
        loop {
            let all: Vec<Value> = digests
                .iter()
                .map(|d| self.status(d)["sampled"].clone())
                .collect();
            if all.iter().all(Value::is_boolean) {
                return all.iter().map(|v| v == &Value::Bool(true)).collect();
            }
            assert!(
                start.elapsed() < DEADLINE,
                "timed out waiting for the sampling decisions: {all:?}; log:\n{}",
                self.log.lock().unwrap().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Posts one report per commitment; returns their digests (each stored as new).
fn report_all(svc: &Service, commitments: &[Value]) -> Vec<String> {
    commitments
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let (code, v) = svc.post(&report(&format!("r{i}"), c));
            assert_eq!(code, 202, "{v}");
            v["digest"].as_str().unwrap().to_owned()
        })
        .collect()
}

/// The reports, posted while no block is produced: the head every one of them saw is `h`
/// (the test holds [`CHAIN`], and nothing else produces blocks on the harness's chain,
/// which builds blocks only when asked).
fn report_at_fixed_head(url: &str, svc: &Service, commitments: &[Value]) -> (u64, Vec<String>) {
    let before = best_number(url);
    let digests = report_all(svc, commitments);
    let after = best_number(url);
    assert_eq!(before, after, "a block was produced while reporting");
    (before, digests)
}

/// Asserts that `got` are the decisions the block after the report gives, and not the ones
/// the report's own head block (which the miner could see) would give.
fn assert_beacon_is_block_after(url: &str, head: u64, digests: &[String], got: &[bool]) {
    let next = hash_of(url, head + 1);
    let known = hash_of(url, head);
    let want: Vec<bool> = digests.iter().map(|d| expected_sampled(&next, d)).collect();
    let from_known: Vec<bool> = digests
        .iter()
        .map(|d| expected_sampled(&known, d))
        .collect();
    assert_eq!(
        got,
        want,
        "the decisions are not production_seed(hash of block {}, digest)",
        head + 1
    );
    assert_ne!(
        want,
        from_known,
        "block {head} and block {} give the same {REPORTS} decisions (chance 2^-{REPORTS})",
        head + 1
    );
}

#[test]
fn sampling_beacon_is_the_first_block_after_the_report() {
    let Some(url) = chain_url("sampling_beacon_is_the_first_block_after_the_report") else {
        return;
    };
    let _chain = CHAIN.lock().unwrap_or_else(|e| e.into_inner());
    let fx = Fixture::new();
    let commitments: Vec<Value> = (0..REPORTS)
        .map(|i| fx.commitment(&format!("beacon {i}")))
        .collect();
    let t = tempfile::tempdir().unwrap();
    let mut svc = Service::start(t.path(), &fx.checkpoint, &url);

    let (head, digests) = report_at_fixed_head(&url, &svc, &commitments);
    // The sampler asks for the block after the report and finds none: nothing is decided.
    svc.wait_line("a read of the not yet produced beacon block", |v| {
        v["message"] == "beacon block not finalized yet" && v["block"] == json!(head + 1)
    });
    for d in &digests {
        assert!(
            svc.status(d)["sampled"].is_null(),
            "decided before its block"
        );
    }
    new_block(&url);
    svc.wait_beacon(&url, head + 1);
    let got = svc.decisions(&digests);
    assert_beacon_is_block_after(&url, head, &digests, &got);
    // More blocks change nothing: a decision is made once.
    new_block(&url);
    assert_eq!(svc.decisions(&digests), got);
}

/// A TCP forwarder to the node that can cut every connection and refuse new ones (the
/// chain dropping) and then forward again (the chain coming back).
struct Link {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

impl Link {
    fn start(upstream: String) -> Link {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (up2, conns2) = (up.clone(), conns.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                if !up2.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let mut held = conns2.lock().unwrap();
                for s in [&client, &server] {
                    if let Ok(c) = s.try_clone() {
                        held.push(c);
                    }
                }
                drop(held);
                for (mut from, mut to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Link { addr, up, conns }
    }

    fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// Cuts every open connection; new ones are closed at once until [`Link::restore`].
    fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

#[test]
fn a_dropped_chain_loses_no_report_and_the_beacon_stays_the_block_after_it() {
    let test = "a_dropped_chain_loses_no_report_and_the_beacon_stays_the_block_after_it";
    let Some(url) = chain_url(test) else {
        return;
    };
    let _chain = CHAIN.lock().unwrap_or_else(|e| e.into_inner());
    let fx = Fixture::new();
    let commitments: Vec<Value> = (0..REPORTS)
        .map(|i| fx.commitment(&format!("dropped {i}")))
        .collect();
    let late = fx.commitment("reported while the chain is away");
    let link = Link::start(host_port(&url));
    let t = tempfile::tempdir().unwrap();
    let mut svc = Service::start(t.path(), &fx.checkpoint, &link.url());

    let (head, digests) = report_at_fixed_head(&url, &svc, &commitments);
    link.cut();
    // The beacon block is produced while the service cannot see the chain.
    new_block(&url);
    svc.wait_line("a sampling pass failing on the cut chain", |v| {
        v["message"] == "sampling pass failed; retrying"
    });
    for d in &digests {
        assert!(
            svc.status(d)["sampled"].is_null(),
            "decided without the chain"
        );
    }
    // A report the service cannot place on the chain is refused (the gateway retries), not
    // stored with a head it did not read.
    let (code, v) = svc.post(&report("late", &late));
    assert_eq!(code, 503, "{v}");
    link.restore();
    svc.wait_beacon(&url, head + 1);
    let got = svc.decisions(&digests);
    assert_eq!(got.len(), REPORTS, "a report was lost");
    assert_beacon_is_block_after(&url, head, &digests, &got);
}

/// The node's head going back (a lagging node behind a load-balanced endpoint, a reconnect
/// to another node, a reorganisation; here chopsticks `dev_setHead`) must not make the
/// beacon a block that existed before the report: chopsticks rebuilds the same blocks with
/// the same hashes, as a lagging node serves blocks everyone has seen. The service counts
/// from the newest head it has read.
#[test]
fn a_node_whose_head_goes_back_never_gives_a_block_seen_before_the_report() {
    let test = "a_node_whose_head_goes_back_never_gives_a_block_seen_before_the_report";
    let Some(url) = chain_url(test) else {
        return;
    };
    let _chain = CHAIN.lock().unwrap_or_else(|e| e.into_inner());
    let fx = Fixture::new();
    let commitments: Vec<Value> = (0..REPORTS)
        .map(|i| fx.commitment(&format!("head back {i}")))
        .collect();
    let first = fx.commitment("reported at the newest head");
    let t = tempfile::tempdir().unwrap();
    let mut svc = Service::start(t.path(), &fx.checkpoint, &url);

    let base = best_number(&url);
    rpc(&url, "dev_newBlock", json!([{"count": 3}]));
    // The service reads the newest head (base + 3) with a report.
    let (code, v) = svc.post(&report("first", &first));
    assert_eq!(code, 202, "{v}");
    let seen: Vec<[u8; 32]> = (base + 1..=base + 3).map(|n| hash_of(&url, n)).collect();
    rpc(&url, "dev_setHead", json!([base]));
    let (head, digests) = report_at_fixed_head(&url, &svc, &commitments);
    assert_eq!(head, base, "dev_setHead did not move the head back");
    rpc(&url, "dev_newBlock", json!([{"count": 4}]));
    assert_eq!(
        hash_of(&url, base + 1),
        seen[0],
        "chopsticks rebuilt block {} with another hash: the case is not exercised",
        base + 1
    );
    svc.wait_beacon(&url, base + 4);
    let got = svc.decisions(&digests);
    // The first block after every head the service had read: base + 4, not base + 1 (which
    // everyone had seen before these reports).
    let after = hash_of(&url, base + 4);
    let want: Vec<bool> = digests
        .iter()
        .map(|d| expected_sampled(&after, d))
        .collect();
    let from_seen: Vec<bool> = digests
        .iter()
        .map(|d| expected_sampled(&seen[0], d))
        .collect();
    assert_ne!(
        want,
        from_seen,
        "blocks {} and {} give the same decisions",
        base + 1,
        base + 4
    );
    assert_eq!(
        got,
        want,
        "the decisions are not production_seed(hash of block {}, digest)",
        base + 4
    );
}

/// A miner's leg to the gateway double that never answers `open_cells` (the test reads the
/// challenge the gateway carried, not the answer).
async fn silent_miner(url: String, key: String) {
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
    while let Some(Ok(_)) = ws.next().await {}
}

/// The cell challenge's seed, as the gateway carries it in `open_cells` (docs/PROTOCOL.md
/// §11.3), is `production_seed(hash of the first block after the report, digest)`, the hash
/// read here over RPC.
#[test]
fn the_cell_challenge_seed_comes_from_the_first_block_after_the_report() {
    let test = "the_cell_challenge_seed_comes_from_the_first_block_after_the_report";
    let Some(url) = chain_url(test) else {
        return;
    };
    let _chain = CHAIN.lock().unwrap_or_else(|e| e.into_inner());
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

    let mut c = fx.commitment("open your cells on the chain's seed");
    let ids: Vec<u32> = c["toploc"]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .chain(c["output_token_ids"].as_array().unwrap())
        .map(|v| u32::try_from(v.as_u64().unwrap()).unwrap())
        .collect();
    let (tree, _cells) =
        cells_common::serve(&fx.honest.model, &ids, engy_model::cells::CellServe::Honest);
    c["cells"] = json!({
        "scheme": engy_core::cells::SCHEME,
        "root": hex::encode(tree.root()),
        "shape": serde_json::to_value(tree.shape()).unwrap(),
    });

    let rt = tokio::runtime::Runtime::new().unwrap();
    let gw = rt
        .block_on(engy_devnet::gateway::GatewayDouble::start(
            engy_devnet::gateway::GatewayConfig::default(),
        ))
        .unwrap();
    gw.register_miner("miner-key-chain", &hotkey("chain"));
    rt.spawn(silent_miner(gw.url(), "miner-key-chain".into()));
    rt.block_on(gw.wait_legs(1, DEADLINE))
        .expect("the miner's leg");

    let mut svc = Service::start_with(
        t.path(),
        &fx.checkpoint,
        &url,
        1.0,
        &[
            "--device",
            "cpu",
            "--gateway",
            &format!("http://{}", gw.addr()),
            "--challenge-deadline-s",
            "3",
            "--spec",
            &format!("devnet={}", spec.display()),
        ],
    );
    let rid = format!("chain-{}", run_nonce());
    let before = best_number(&url);
    let (code, v) = svc.post(&report(&rid, &c));
    assert_eq!(code, 202, "{v}");
    let head = best_number(&url);
    assert_eq!(before, head, "a block was produced while reporting");
    let digest = v["digest"].as_str().unwrap().to_owned();
    new_block(&url);
    svc.wait_beacon(&url, head + 1);
    let start = Instant::now();
    let sent = loop {
        let sent: Vec<Value> = gw
            .frames()
            .iter()
            .filter(|f| f.kind() == "open_cells" && f.value["request_id"] == json!(rid))
            .map(|f| f.value.clone())
            .collect();
        if let Some(f) = sent.into_iter().next() {
            break f;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "no open_cells for {rid}; log:\n{}",
            svc.log.lock().unwrap().join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let d = engy_core::commit::parse_digest(&digest).unwrap();
    let after = engy_core::cells::production_seed(&hash_of(&url, head + 1), &d);
    let known = engy_core::cells::production_seed(&hash_of(&url, head), &d);
    assert_ne!(after, known);
    assert_eq!(sent["seed"], json!(hex::encode(after)), "{sent}");
}
