//! The chain killed and restarted in the middle of a tick (issue 8), with real processes:
//! the real `engy-validator` daemon, its OWN chopsticks node started with
//! `$ENGY_SHARED_DIR/chain/start-subtensor.sh PORT --restart` on a port this test holds for
//! the node's whole life, restarts included ([`ReservedPort`]: never a guessed one, never the
//! shared instance of `tests/run.sh`), and the provider double on 127.0.0.1.
//!
//! The tick is stopped at a known point by holding the payload fetch in the provider double
//! ([`ProviderDouble::hold_fetches`]): the node is SIGKILLed while the fetch is held, then
//! the fetch is let go, so the tick reaches the chain while it is down. The daemon must
//! stay up, say the chain is unreachable and when it retries, and leave the state file
//! byte-identical; after the restart (chopsticks comes back from its seeded state, head
//! #202, no weights stored, `LastUpdate` at registration) the new epoch lands once, reads
//! back from `Weights`, and the state advances exactly once. Then the same with the node
//! killed while the daemon's `set_weights` sits in its pool (manual block building,
//! `author_pendingExtrinsics` non-empty): the submit FAILS by name, the state is unchanged,
//! and after the restart that epoch lands exactly once.
//!
//! Runs when chain tests are requested (`ENGY_SUBTENSOR_URL` set, as `tests/run.sh` does);
//! unset → a visible skip, like `chain.rs`. The harness script missing → a visible skip;
//! the script failing to start the node → FAIL. The hold itself is also checked without a
//! chain (always runs).

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;
use engy_devnet::ports::ReservedPort;
use engy_devnet::provider::ProviderDouble;
use engy_validator::chain::Chain;
use engy_validator::schedule;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc::UnboundedReceiver;

const NETUID: u16 = 53;
/// Above the harness's weights_rate_limit (100).
const RESUBMIT: u64 = 101;
/// Bound on one start of the node (npm cache warm: ~18 s measured; slack for a busy box).
const START_LIMIT: Duration = Duration::from_secs(300);
/// Bound on any one expected log line of the daemon.
const LINE_LIMIT: Duration = Duration::from_secs(120);

/// `$ENGY_SHARED_DIR/chain`, default `<workspace>/../shared/chain`.
fn harness_dir() -> PathBuf {
    let shared = std::env::var_os("ENGY_SHARED_DIR")
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    shared.join("chain")
}

/// A chopsticks node of this test only: its own port and run directory (pid file, log).
/// Dropping it stops the node (`stop-subtensor.sh`, which kills only the recorded pid).
struct OwnChain {
    harness: PathBuf,
    port: u16,
    /// `port`, held while the node lives and between its runs: chopsticks (node's libuv
    /// binds with SO_REUSEADDR) listens on it, nobody else is given it.
    _reserved: ReservedPort,
    run_dir: tempfile::TempDir,
}

impl OwnChain {
    fn url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.port)
    }

    /// A JSON-RPC call over HTTP; panics on an RPC error. Returns `result`.
    async fn rpc(&self, method: &str, params: serde_json::Value) -> serde_json::Value {
        common::chain::rpc(&self.url(), method, params).await
    }

    /// `start-subtensor.sh PORT --restart`: a node from genesis, seeded (head #202).
    ///
    /// The shared harness's seeding of a fresh node sometimes has its first signed extrinsic
    /// refused (`1010 {"invalid":{"badProof":null}}`, seen in 2 of 3 full runs on a loaded
    /// 2-core machine, 2026-12-06), a race of the harness's start outside this project: the
    /// start is tried again, once, when the script says the seeding failed, and any other
    /// failure fails the test at once.
    async fn start(&self) {
        let t = Instant::now();
        for attempt in 1..=2 {
            let mut cmd = tokio::process::Command::new("bash");
            cmd.arg(self.harness.join("start-subtensor.sh"))
                .arg(self.port.to_string())
                .arg("--restart")
                .env("SUBTENSOR_RUN_DIR", self.run_dir.path())
                .env_remove("SUBTENSOR_PORT")
                .stdin(Stdio::null())
                .kill_on_drop(true);
            let out = tokio::time::timeout(START_LIMIT, cmd.output())
                .await
                .unwrap_or_else(|_| {
                    panic!("start-subtensor.sh {} took over {START_LIMIT:?}", self.port)
                })
                .unwrap();
            let log = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if out.status.success() {
                break;
            }
            let seeding = log.contains("seeding failed") && log.contains("badProof");
            assert!(
                seeding && attempt < 2,
                "start-subtensor.sh {} failed ({}) on attempt {attempt}:\n{log}",
                self.port,
                out.status,
            );
            eprintln!(
                "start-subtensor.sh {}: the harness's seeding was refused (badProof); starting again",
                self.port
            );
        }
        eprintln!(
            "own chain on port {} up and seeded in {:.1} s",
            self.port,
            t.elapsed().as_secs_f64()
        );
    }

    /// SIGKILL of the node (a crash, not a shutdown); returns once its port refuses
    /// connections.
    async fn kill(&self) {
        let pid_file = self.run_dir.path().join("chopsticks.pid");
        let pid = std::fs::read_to_string(&pid_file).unwrap();
        let status = std::process::Command::new("kill")
            .args(["-KILL", pid.trim()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -KILL {pid}");
        let t = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .is_ok()
        {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "port {} still open after SIGKILL",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for OwnChain {
    fn drop(&mut self) {
        let _ = std::process::Command::new("bash")
            .arg(self.harness.join("stop-subtensor.sh"))
            .arg(self.port.to_string())
            .env("SUBTENSOR_RUN_DIR", self.run_dir.path())
            .stdout(Stdio::null())
            .status();
    }
}

/// What `Weights(53, uid)` holds after `vector` lands on this chain.
async fn stored(chain: &Chain, vector: &[(String, u16)]) -> Vec<(u16, u16)> {
    let mg = chain.metagraph(NETUID).await.unwrap();
    let r = schedule::resolve(vector, &mg);
    r.uids
        .iter()
        .copied()
        .zip(max_upscale(&r.weights))
        .collect()
}

/// `LastUpdate` of //Charlie on netuid 53 and its uid.
async fn charlie(chain: &Chain) -> (u16, u64) {
    let n = chain
        .neuron(NETUID, key(CHARLIE_SEED).public_key())
        .await
        .unwrap()
        .expect("//Charlie registered on 53");
    (n.uid, n.last_update)
}

/// The daemon's stdout, line by line, with everything seen so far for failure messages.
struct Lines {
    rx: UnboundedReceiver<String>,
    seen: String,
}

impl Lines {
    /// The next line matching `pred` (lines before it are kept in `seen`); panics after
    /// [`LINE_LIMIT`] or when the daemon's stdout ends.
    async fn next_matching(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + LINE_LIMIT;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(line)) => {
                    self.seen.push_str(&line);
                    self.seen.push('\n');
                    if pred(&line) {
                        return line;
                    }
                }
                Ok(None) => panic!("daemon output ended waiting for {what}:\n{}", self.seen),
                Err(_) => panic!("no {what} within {LINE_LIMIT:?}:\n{}", self.seen),
            }
        }
    }

    /// The next tick line (every tick ends with one line naming the next poll).
    async fn next_tick(&mut self) -> String {
        self.next_matching("tick line", |l| {
            l.contains("next poll in") || l.contains("retry next poll in")
        })
        .await
    }
}

/// Waits until the provider double has seen more than `n` epoch GETs (`seen`: the
/// daemon's output so far, for the failure message).
async fn fetch_started(p: &ProviderDouble, n: u64, seen: &str) {
    let t = Instant::now();
    while p.fetches() <= n {
        assert!(
            t.elapsed() < LINE_LIMIT,
            "no payload fetch within {LINE_LIMIT:?}:\n{seen}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Without a chain (always runs): a tick held in its fetch waits, and once let go it goes
/// on with what is published at that moment, to the (dead) chain: one line, no state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_fetch_goes_on_with_what_is_published_when_let_go() {
    let bob = key(BOB_SEED);
    let p = ProviderDouble::start(bob.clone(), NETUID).await.unwrap();
    p.hold_fetches(true);
    let env = Env::new(CHARLIE_SEED, &p.url(), &bob.ss58(), "ws://127.0.0.1:9");
    let (out, ()) = tokio::join!(env.run(&["run", "--ticks", "1"]), async {
        fetch_started(&p, 0, "").await;
        p.publish(9, &[(key(DAVE_SEED).ss58(), 65535)]);
        p.hold_fetches(false);
    });
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    assert_eq!(p.fetches(), 1);
    assert!(
        text.contains("epoch 9 verified: chain unreachable (")
            && text.contains(
                "nothing submitted, state unchanged; no retry (--ticks limit reached, exiting)"
            ),
        "{text}"
    );
    assert!(!env.state_file().exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_killed_mid_tick_and_restarted() {
    if std::env::var("ENGY_SUBTENSOR_URL")
        .ok()
        .filter(|s| !s.is_empty())
        .is_none()
    {
        eprintln!("SKIP chain_killed_mid_tick_and_restarted: ENGY_SUBTENSOR_URL is not set (chain tests not requested; tests/run.sh sets it when ../shared/chain is available)");
        return;
    }
    let harness = harness_dir();
    if !harness.join("start-subtensor.sh").is_file() {
        eprintln!(
            "SKIP chain_killed_mid_tick_and_restarted: no chain harness at {} (set ENGY_SHARED_DIR)",
            harness.display()
        );
        return;
    }
    let reserved = ReservedPort::new().unwrap();
    let own = OwnChain {
        harness,
        port: reserved.port(),
        _reserved: reserved,
        run_dir: tempfile::tempdir().unwrap(),
    };
    own.start().await;
    let chain = Chain::connect(&own.url()).await.unwrap();
    let (uid, _) = charlie(&chain).await;

    let bob = key(BOB_SEED);
    let p = ProviderDouble::start(bob.clone(), NETUID).await.unwrap();
    let e0 = 7_000u64;
    let e1 = e0 + 1;
    let v0: Vec<(String, u16)> = vec![
        (key(DAVE_SEED).ss58(), 65535),
        (key(EVE_SEED).ss58(), 30000),
    ];
    let v1: Vec<(String, u16)> = vec![
        (key(EVE_SEED).ss58(), 40000),
        (key(FERDIE_SEED).ss58(), 20000),
        (key(DAVE_SEED).ss58(), 5535),
    ];
    p.publish(e0, &v0);
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &bob.ss58(), &own.url());
    env.set("ENGY_SN53_RESUBMIT_BLOCKS", &RESUBMIT.to_string());

    // -- the daemon (one long-lived process, poll 1 s) lands epoch e0
    let mut daemon = env
        .command(&["run"])
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let stdout = daemon.stdout.take().unwrap();
    tokio::spawn(async move {
        let mut r = BufReader::new(stdout).lines();
        while let Ok(Some(l)) = r.next_line().await {
            eprintln!("[validator] {l}");
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut lines = Lines {
        rx,
        seen: String::new(),
    };
    let line = lines.next_tick().await;
    assert!(
        line.contains(&format!("epoch {e0} verified (new epoch)"))
            && line.contains("landed in block #203"),
        "{}",
        lines.seen
    );
    let s0 = std::fs::read(env.state_file()).unwrap();
    let st0 = env.state();
    assert_eq!(st0.last_applied, Some(e0));
    assert_eq!(st0.last_submit_block, Some(202)); // read before submitting; landed in #203
    assert_eq!(
        chain.weights(NETUID, uid).await.unwrap(),
        stored(&chain, &v0).await
    );
    drop(chain);

    // -- hold the next tick in its payload fetch, publish e1, kill the node, let it go on
    p.hold_fetches(true);
    let n = p.fetches();
    fetch_started(&p, n, &lines.seen).await; // a tick that began after the hold: it is held
    p.publish(e1, &v1);
    own.kill().await;
    p.hold_fetches(false);
    // (lines of ticks before the hold: e0 skipped on the pre-gate)
    let line = lines
        .next_matching("the held tick", |l| l.contains(&format!("epoch {e1}")))
        .await;
    assert!(
        line.contains(&format!("epoch {e1} verified: chain unreachable ("))
            && line.contains("nothing submitted, state unchanged; retry next poll in 1 s"),
        "{}",
        lines.seen
    );
    assert!(line.contains(" WARN "), "{line}");
    assert_eq!(std::fs::read(env.state_file()).unwrap(), s0);
    // it keeps polling, each tick says the same, the heartbeat stays fresh, nothing lands
    for _ in 0..2 {
        let line = lines.next_tick().await;
        assert!(line.contains("chain unreachable"), "{}", lines.seen);
        assert_eq!(std::fs::read(env.state_file()).unwrap(), s0);
    }
    assert!(daemon.try_wait().unwrap().is_none(), "the daemon exited");
    let health = env.run(&["health"]).await;
    assert_eq!(health.status.code(), Some(0));

    // -- hold a tick again (no tick may reach the node while it seeds), restart, let it go
    p.hold_fetches(true);
    let n = p.fetches();
    fetch_started(&p, n, &lines.seen).await;
    own.start().await;
    let chain = Chain::connect(&own.url()).await.unwrap();
    assert_eq!(
        chain.block_number().await.unwrap(),
        202,
        "restarted from the seed"
    );
    assert_eq!(chain.weights(NETUID, uid).await.unwrap(), vec![]);
    // ticks whose held fetch timed out fell back to the cached e0 and skipped (pre-gate)
    assert_eq!(std::fs::read(env.state_file()).unwrap(), s0);
    let released = engy_validator::liveness::unix_now();
    p.hold_fetches(false);
    let line = lines
        .next_matching("the landing of e1", |l| l.contains("landed in block #"))
        .await;
    assert!(
        line.contains(&format!("epoch {e1} verified (new epoch): set_weights of 3 uids from payload landed in block #203")),
        "{}",
        lines.seen
    );
    let st1 = env.state();
    let s1 = std::fs::read(env.state_file()).unwrap();
    assert_eq!(st1.last_applied, Some(e1));
    // the block read before submitting (issue 13 item 7): one before the inclusion here
    assert_eq!(st1.last_submit_block, Some(charlie(&chain).await.1 - 1));
    // the landing's wall clock, not the start of the tick held through the restart
    assert!(
        st1.last_submit_ts >= Some(released),
        "last_submit_ts {:?} is before the held tick was let go ({released})",
        st1.last_submit_ts
    );
    assert_eq!(st1.cached_weights.as_deref(), Some(v1.as_slice()));
    assert_eq!(
        chain.weights(NETUID, uid).await.unwrap(),
        stored(&chain, &v1).await
    );

    // -- exactly once: the next ticks skip on the pre-gate and touch neither file nor chain
    let head = chain.block_number().await.unwrap();
    for _ in 0..2 {
        let line = lines.next_tick().await;
        assert!(
            line.contains(&format!(
                "epoch {e1} verified: already applied, resubmit due in ~"
            )) && line.contains("(pre-gate, chain not contacted)"),
            "{}",
            lines.seen
        );
    }
    assert_eq!(std::fs::read(env.state_file()).unwrap(), s1);
    assert_eq!(chain.block_number().await.unwrap(), head);
    assert_eq!(
        lines.seen.matches("landed in block #").count(),
        2,
        "{}",
        lines.seen
    );

    drop(chain);

    // -- the node dies with the extrinsic in its pool (submitted, not yet in a block): the
    //    node is switched to manual block building, so the daemon's set_weights waits for an
    //    inclusion that never comes until the node is killed under it
    let e2 = e1 + 1;
    let v2: Vec<(String, u16)> = vec![
        (key(FERDIE_SEED).ss58(), 65535),
        (key(DAVE_SEED).ss58(), 100),
    ];
    p.hold_fetches(true);
    let n = p.fetches();
    fetch_started(&p, n, &lines.seen).await;
    // past the chain's rate limit of e1's landing (LastUpdate #203 + 100), which the
    // validator now waits for instead of sending what the chain must refuse (issue 13 item 5)
    own.rpc(
        "dev_newBlock",
        serde_json::json!([{ "unsafeBlockHeight": 203 + 100 }]),
    )
    .await;
    own.rpc("dev_setBlockBuildMode", serde_json::json!(["Manual"]))
        .await;
    p.publish(e2, &v2);
    p.hold_fetches(false);
    let t = Instant::now();
    while own
        .rpc("author_pendingExtrinsics", serde_json::json!([]))
        .await
        .as_array()
        .is_none_or(Vec::is_empty)
    {
        assert!(
            t.elapsed() < LINE_LIMIT,
            "set_weights never reached the pool:\n{}",
            lines.seen
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    own.kill().await;
    let line = lines
        .next_matching("the failed submit", |l| l.contains(&format!("epoch {e2}")))
        .await;
    assert!(
        line.contains(&format!(
            "epoch {e2} verified (new epoch): set_weights of 2 uids FAILED: "
        )) && line.contains("state unchanged, retry next poll in 1 s"),
        "{}",
        lines.seen
    );
    // the socket dies under the status subscription: said as such (or as a transport error)
    assert!(
        line.contains("the node closed the status subscription before inclusion")
            || line.contains("FAILED: chain transport"),
        "{}",
        lines.seen
    );
    assert_eq!(std::fs::read(env.state_file()).unwrap(), s1);
    let line = lines.next_tick().await;
    assert!(
        line.contains(&format!("epoch {e2} verified: chain unreachable (")),
        "{}",
        lines.seen
    );
    assert_eq!(std::fs::read(env.state_file()).unwrap(), s1);

    p.hold_fetches(true);
    let n = p.fetches();
    fetch_started(&p, n, &lines.seen).await;
    own.start().await;
    let chain = Chain::connect(&own.url()).await.unwrap();
    assert_eq!(chain.weights(NETUID, uid).await.unwrap(), vec![]);
    let released = engy_validator::liveness::unix_now();
    p.hold_fetches(false);
    let line = lines
        .next_matching("the landing of e2", |l| l.contains("landed in block #"))
        .await;
    assert!(
        line.contains(&format!(
            "epoch {e2} verified (new epoch): set_weights of 2 uids from payload landed in block #203"
        )),
        "{}",
        lines.seen
    );
    let st2 = env.state();
    assert_eq!(st2.last_applied, Some(e2));
    assert_eq!(st2.last_submit_block, Some(charlie(&chain).await.1 - 1));
    assert!(st2.last_submit_ts >= Some(released));
    assert_eq!(st2.cached_weights.as_deref(), Some(v2.as_slice()));
    assert_eq!(
        chain.weights(NETUID, uid).await.unwrap(),
        stored(&chain, &v2).await
    );
    let s2 = std::fs::read(env.state_file()).unwrap();
    let line = lines.next_tick().await;
    assert!(
        line.contains("(pre-gate, chain not contacted)"),
        "{}",
        lines.seen
    );
    assert_eq!(std::fs::read(env.state_file()).unwrap(), s2);
    assert_eq!(
        lines.seen.matches("landed in block #").count(),
        3,
        "{}",
        lines.seen
    );

    // -- and it still stops cleanly
    signal(&daemon, "-TERM");
    let status = tokio::time::timeout(Duration::from_secs(10), daemon.wait())
        .await
        .expect("SIGTERM did not stop the daemon")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}
