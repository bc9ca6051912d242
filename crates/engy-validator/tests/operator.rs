//! What an operator meets first, through the real binary: start-up refusals and warnings,
//! error texts that name the cause (once), and SIGTERM before the first tick.

mod common;

use common::*;
use engy_devnet::provider::ProviderDouble;

/// A node URL where nothing listens (connection refused at once).
const DEAD_CHAIN: &str = "ws://127.0.0.1:9";

#[tokio::test]
async fn sigterm_during_the_start_up_chain_connect_exits_zero() {
    use tokio::io::AsyncReadExt;
    // A "node" that accepts TCP and never answers: the start-up connect hangs (30 s timeout).
    let node = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("ws://{}", node.local_addr().unwrap());
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), &url);
    env.set("ENGY_SN53_POLL_S", "300");
    let mut child = env.command(&["run"]).spawn().unwrap();
    // The connect has started once the node sees the TCP connection.
    let (_held, _) = node.accept().await.unwrap();
    signal(&child, "-TERM");
    let status = child.wait().await.unwrap();
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0), "{out}");
    assert!(out.contains("SIGTERM during start-up; exiting 0"), "{out}");
    assert_eq!(p.fetches(), 0, "no tick ran");
}

#[tokio::test]
async fn an_unreachable_provider_is_reported_with_its_cause() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let closed = engy_devnet::ports::ReservedPort::new().unwrap();
    let api = format!("http://{}", closed.addr());
    let env = Env::new(CHARLIE_SEED, &api, &p.master_ss58(), DEAD_CHAIN);
    let out = env.run(&["check"]).await;
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("provider") && l.starts_with("FAIL"))
        .unwrap_or_else(|| panic!("no provider FAIL line: {stdout}"));
    // reqwest alone says only "error sending request"; the cause is what the operator needs.
    assert!(line.contains("Connection refused"), "{line}");
    // The daemon's tick line carries the same cause.
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("fetch failed: request failed: error sending request: "),
        "{out}"
    );
    assert!(out.contains("Connection refused"), "{out}");
}

#[tokio::test]
async fn an_unwritable_state_directory_is_named_at_start_up_and_by_check() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    // A parent that is a regular file: no write can succeed there (even as root).
    let blocker = env.home.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let state = blocker.join("state.json");
    env.set("ENGY_SN53_STATE_FILE", state.to_str().unwrap());
    // The daemon still runs (it keeps the vector on chain; see hardening_faults.rs), but
    // the start-up log says why nothing will be recorded and what to fix.
    let (ok, out) = env.tick().await;
    assert!(ok, "{out}");
    assert!(out.contains("ERROR"), "{out}");
    assert!(out.contains("the state file"), "{out}");
    assert!(out.contains("cannot be written"), "{out}");
    assert!(out.contains("ENGY_SN53_STATE_FILE"), "{out}");
    // `check` FAILs on it.
    let out = env.run(&["check"]).await;
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.lines().any(|l| l.starts_with("FAIL")
            && l.contains("state file")
            && l.contains("cannot be written")),
        "{stdout}"
    );
    // A writable location gives no such line.
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let (_, out) = env.tick().await;
    assert!(!out.contains("cannot be written"), "{out}");
}

#[tokio::test]
async fn a_damaged_state_file_is_named_at_start_up_and_by_check() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    std::fs::create_dir_all(env.state_file().parent().unwrap()).unwrap();
    std::fs::write(env.state_file(), b"\x00\xffnot json").unwrap();
    let (ok, out) = env.tick().await;
    assert!(ok, "a damaged state file does not stop the daemon");
    assert!(out.contains("is not valid JSON"), "{out}");
    assert!(out.contains("reads as empty"), "{out}");
    let out = env.run(&["check"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("FAIL") && l.contains("would read as empty")),
        "{stdout}"
    );
    // A good (absent) state file gives no such line.
    std::fs::remove_file(env.state_file()).unwrap();
    let (_, out) = env.tick().await;
    assert!(!out.contains("reads as empty"), "{out}");
}

#[tokio::test]
async fn an_error_cause_is_printed_once() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    // The hotkey "file" is a directory: the OS error is part of the message and its source.
    let dir = env.home.path().join(".bittensor/wallets/vali/hotkeys/adir");
    std::fs::create_dir_all(&dir).unwrap();
    env.set("ENGY_SN53_WALLET_HOTKEY", "adir");
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read hotkey file"), "{err}");
    assert_eq!(err.matches("os error").count(), 1, "{err}");
}

#[tokio::test]
async fn a_one_tick_run_says_it_exits_names_dropped_state_fields_and_the_chain_cause_once() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &[(key(DAVE_SEED).ss58(), 65535)]);
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    std::fs::create_dir_all(env.state_file().parent().unwrap()).unwrap();
    std::fs::write(
        env.state_file(),
        br#"{"last_applied": "x", "last_submit_ts": 5, "cached_digest": 7}"#,
    )
    .unwrap();
    let (ok, out) = env.tick().await;
    assert!(ok, "{out}");
    // One WARN at start-up naming the dropped fields, and only those.
    let warn: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("read as absent"))
        .collect();
    assert_eq!(warn.len(), 1, "{out}");
    assert!(warn[0].contains("WARN"), "{out}");
    assert!(warn[0].contains("last_applied, cached_digest"), "{out}");
    assert!(!warn[0].contains("last_submit_ts"), "{out}");
    // The chain error names the URL and the innermost cause, once.
    let tick = out
        .lines()
        .find(|l| l.contains("chain unreachable"))
        .unwrap_or_else(|| panic!("no tick line: {out}"));
    assert!(
        tick.contains("cannot reach the chain at ws://127.0.0.1:9: "),
        "{tick}"
    );
    assert!(tick.contains("refused"), "{tick}");
    assert!(!out.contains("RPC error"), "{out}");
    // The last tick of --ticks says the process exits, not when it polls next.
    assert!(tick.contains("--ticks limit reached, exiting"), "{tick}");
    assert!(!out.contains("next poll in"), "{out}");
}
