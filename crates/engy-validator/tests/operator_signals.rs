//! Issue 13 (never silently earning nothing), the parts an operator meets without a chain,
//! through the real binary: a state file ahead of the provider is loud, future timestamps
//! are stale, and configuration mistakes are named by the variable the operator set.

mod common;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use common::*;
use engy_devnet::provider::{Fault, ProviderDouble};
use engy_validator::state::{self, State};

/// A node URL where nothing listens (connection refused at once).
const DEAD_CHAIN: &str = "ws://127.0.0.1:9";

fn weights() -> Vec<(String, u16)> {
    vec![
        (key(DAVE_SEED).ss58(), 40000),
        (key(EVE_SEED).ss58(), 25535),
    ]
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Item 1: `last_applied` far ahead of the provider (a state file from another network):
/// an ERROR with the recovery at start-up, an ERROR every tick, a FAIL in `check`.
#[tokio::test]
async fn a_state_file_ahead_of_the_provider_is_an_error_at_start_up_every_tick_and_in_check() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let now = engy_validator::liveness::unix_now();
    let copied = State {
        last_applied: Some(900),
        last_submit_block: Some(7_000_000),
        last_submit_ts: Some(now - 3600),
        cached_weights: Some(weights()),
        cached_digest: Some("ab".repeat(32)),
    };
    state::write(&env.state_file(), &copied).unwrap();
    let path = env.state_file().display().to_string();

    let out = env.run(&["run", "--ticks", "2"]).await;
    assert!(out.status.success());
    let text = stdout(&out);
    let startup: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("last_applied epoch 900 is 895 epoch(s) ahead"))
        .collect();
    assert_eq!(startup.len(), 1, "{text}");
    assert!(startup[0].contains(" ERROR "), "{text}");
    assert!(startup[0].contains("NOTHING LANDS"), "{text}");
    assert!(
        startup[0].contains(&format!("move it aside and restart (mv {path} {path}.bak)")),
        "{text}"
    );
    let ticks: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("refused (replay guard)"))
        .collect();
    assert_eq!(ticks.len(), 2, "{text}");
    for line in &ticks {
        assert!(line.contains(" ERROR "), "{line}");
        assert!(
            line.contains("895 epoch(s) ahead of the provider"),
            "{line}"
        );
        assert!(line.contains(&format!("move {path} aside")), "{line}");
    }
    // the guard stays: nothing was written
    assert_eq!(env.state(), copied);

    // check: one FAIL with the recovery
    let out = env.run(&["check"]).await;
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    let fails: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("FAIL") && l.contains("ahead of the provider"))
        .collect();
    assert_eq!(fails.len(), 1, "{text}");
    assert!(
        fails[0].contains(&format!("mv {path} {path}.bak")),
        "{text}"
    );

    // health is the loop's liveness (the reference's definition) and stays green
    assert!(env.run(&["health"]).await.status.success());

    // a provider that is simply current gives no such line
    p.publish(900, &weights());
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(
        !stdout(&out).contains("ahead of the provider"),
        "{}",
        stdout(&out)
    );
}

/// Item 2: a heartbeat or state timestamp in the future is invalid: WARN, treated as stale.
#[tokio::test]
async fn future_timestamps_warn_and_count_as_stale() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let now = engy_validator::liveness::unix_now();
    std::fs::create_dir_all(env.heartbeat_file().parent().unwrap()).unwrap();
    std::fs::write(
        env.heartbeat_file(),
        format!(r#"{{"ts": {}}}"#, now + 86_400),
    )
    .unwrap();
    // health: not "age 0 s" but unhealthy, with a WARN naming the cause
    let out = env.run(&["health"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("unhealthy: heartbeat timestamp"),
        "{}",
        stdout(&out)
    );
    assert!(stderr(&out).contains("WARN"), "{}", stderr(&out));
    assert!(stderr(&out).contains("in the future"), "{}", stderr(&out));

    // the state's last_submit_ts in the future: a start-up WARN, and the pre-gate does not
    // skip on it (the tick goes on to the chain, which is down here)
    let future = State {
        last_applied: Some(5),
        last_submit_block: Some(100),
        last_submit_ts: Some(now + 86_400),
        cached_weights: Some(weights()),
        cached_digest: None,
    };
    state::write(&env.state_file(), &future).unwrap();
    let (ok, out) = env.tick().await;
    assert!(ok, "{out}");
    let warn: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("last_submit_ts is") && l.contains("in the future"))
        .collect();
    assert_eq!(warn.len(), 1, "{out}");
    assert!(warn[0].contains(" WARN "), "{out}");
    assert!(warn[0].contains("treated as stale"), "{out}");
    let hb_warn = out.lines().any(|l| {
        l.contains(" WARN ") && l.contains("heartbeat file") && l.contains("in the future")
    });
    assert!(hb_warn, "{out}");
    assert!(!out.contains("pre-gate, chain not contacted"), "{out}");
    assert!(out.contains("chain unreachable"), "{out}");
    // the tick stamped the current time: health is green again
    assert!(env.run(&["health"]).await.status.success());
}

/// Runs the binary with exactly `vars` (plus PATH).
async fn run_with(vars: &[(&str, OsString)], args: &[&str]) -> std::process::Output {
    let mut cmd = tokio::process::Command::new(bin());
    cmd.args(args).env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().await.unwrap();
    eprintln!(
        "--- engy-validator {} → {}\n{}{}",
        args.join(" "),
        out.status,
        stdout(&out),
        stderr(&out)
    );
    out
}

/// Item 10: messages name the variable the operator set; usage errors exit 2.
#[tokio::test]
async fn configuration_errors_name_the_variable_and_exit_as_documented() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let base: Vec<(&str, OsString)> = env
        .vars
        .iter()
        .map(|(k, v)| (k.as_str(), OsString::from(v)))
        .collect();
    let with = |k: &'static str, v: OsString| {
        let mut vars: Vec<(&str, OsString)> =
            base.iter().filter(|(n, _)| *n != k).cloned().collect();
        vars.push((k, v));
        vars
    };

    // an empty ENGY_SN53_WALLET= (as .env.validator.example ships it): usage error, exit 2
    for sub in ["run", "check"] {
        let out = run_with(&with("ENGY_SN53_WALLET", "".into()), &[sub]).await;
        assert_eq!(out.status.code(), Some(2), "{sub}");
        assert!(stderr(&out).contains("ENGY_SN53_WALLET must not be empty"));
    }
    // a value that does not parse, from a variable: the variable is named, not the flag
    let out = run_with(&with("ENGY_SN53_POLL_S", "0".into()), &["run"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("for ENGY_SN53_POLL_S:"),
        "{}",
        stderr(&out)
    );
    assert!(
        !stderr(&out).contains("--poll-s <POLL_S>"),
        "{}",
        stderr(&out)
    );
    let out = run_with(&with("ENGY_SN53_NETUID", "fifty-three".into()), &["check"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("invalid value 'fifty-three' for ENGY_SN53_NETUID"),
        "{}",
        stderr(&out)
    );
    // ... and the flag when the operator typed the flag
    let out = run_with(&base, &["run", "--poll-s", "0"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("'--poll-s <POLL_S>'"),
        "{}",
        stderr(&out)
    );
    // a required setting nobody set: both spellings
    let none: Vec<(&str, OsString)> = base
        .iter()
        .filter(|(n, _)| *n != "ENGY_SN53_WALLET")
        .cloned()
        .collect();
    let out = run_with(&none, &["run"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("--wallet <WALLET> (or ENGY_SN53_WALLET)"),
        "{}",
        stderr(&out)
    );
    // a value that is not UTF-8 names its variable
    let out = run_with(
        &with("ENGY_SN53_WALLET", OsString::from_vec(b"va\xffli".to_vec())),
        &["run"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("not valid UTF-8: ENGY_SN53_WALLET"),
        "{}",
        stderr(&out)
    );
    // a bad network value is a usage error too (a value that does not parse)
    let out = run_with(&with("ENGY_SN53_NETWORK", "mainnet".into()), &["run"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("ENGY_SN53_NETWORK must be"));
    // under `spec` 2 is "roots differ": a usage error there is spec's "bad input", 1
    let out = run_with(&base, &["spec", "verify", "--bogus"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("--bogus"), "{}", stderr(&out));
}

/// Item 10: the payload reason word is the documented one.
#[tokio::test]
async fn a_payload_that_is_not_json_is_rejected_as_malformed() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.set_fault(Fault::Malformed);
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("payload rejected: malformed; no cached vector"),
        "{out}"
    );
    assert!(!out.contains("parse_error"), "{out}");
    let out = env.run(&["check"]).await;
    assert!(
        stdout(&out).contains("payload rejected: malformed"),
        "{}",
        stdout(&out)
    );
}

/// Item 10: a regular file where the state folder should be, and a directory where the
/// state file should be, are each named once, plainly.
#[tokio::test]
async fn a_state_path_blocked_by_a_file_or_a_directory_is_named_once() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let blocker = env.home.path().join("engy-data");
    std::fs::write(&blocker, b"not a folder").unwrap();
    let state = blocker.join("state.json");
    env.set("ENGY_SN53_STATE_FILE", state.to_str().unwrap());
    env.set(
        "ENGY_SN53_HEARTBEAT_FILE",
        env.home.path().join("hb.json").to_str().unwrap(),
    );
    let (ok, out) = env.tick().await;
    assert!(ok, "{out}");
    let want = format!(
        "{} is a regular file where a folder of the path should be",
        blocker.display()
    );
    assert!(
        out.lines()
            .any(|l| l.contains(" ERROR ") && l.contains(&want)),
        "{out}"
    );
    assert!(!out.contains("File exists"), "{out}");
    let out = env.run(&["check"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l.starts_with("FAIL") && l.contains(&want)),
        "{}",
        stdout(&out)
    );
    assert!(!stdout(&out).contains("File exists"), "{}", stdout(&out));

    // a directory at the state path: exactly one FAIL about the state file, no "ok"
    let dir = env.home.path().join("state-dir");
    std::fs::create_dir_all(dir.join("inner")).unwrap();
    env.set("ENGY_SN53_STATE_FILE", dir.to_str().unwrap());
    let out = env.run(&["check"]).await;
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    let about_state: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&format!("state file {}", dir.display())))
        .collect();
    assert_eq!(about_state.len(), 1, "{text}");
    assert!(about_state[0].starts_with("FAIL"), "{text}");
    assert!(
        about_state[0].contains("is a directory, not a file"),
        "{text}"
    );
    // run: one ERROR about it, no second WARN calling it damaged
    let (_, out) = env.tick().await;
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(&dir.display().to_string()) && !l.contains("starting:"))
        .collect();
    assert_eq!(lines.len(), 1, "{out}");
    assert!(
        lines[0].contains(" ERROR ") && lines[0].contains("is a directory"),
        "{out}"
    );
}

/// Item 3 with the chain unreachable for many ticks: the last landing recorded in the state
/// file, on the wall clock, against subtensor's default activity_cutoff (said as such: the
/// chain was never reached). `health` stays the loop's liveness.
#[tokio::test]
async fn an_unreachable_chain_for_half_the_activity_cutoff_is_an_error() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let now = engy_validator::liveness::unix_now();
    let old = State {
        last_applied: Some(5),
        last_submit_block: Some(1000),
        // 3333 × 12 s: the tick reads ~3333 blocks as long as it runs within 11 s.
        last_submit_ts: Some(now - 39_996),
        cached_weights: Some(weights()),
        cached_digest: None,
    };
    state::write(&env.state_file(), &old).unwrap();
    let (ok, out) = env.tick().await;
    assert!(ok);
    let line = out
        .lines()
        .find(|l| l.contains("chain unreachable"))
        .unwrap_or_else(|| panic!("no tick line: {out}"));
    assert!(line.contains(" ERROR "), "{line}");
    assert!(
        line.contains("NOTHING HAS LANDED for more than half of activity_cutoff 5000 (subtensor's default: not read from the chain yet)"),
        "{line}"
    );
    assert!(line.contains("~3333 blocks by the wall clock"), "{line}");
    assert!(
        line.contains("drops out of consensus in 1667 blocks"),
        "{line}"
    );
    assert!(env.run(&["health"]).await.status.success());
    // a recent landing: no alarm
    let recent = State {
        last_submit_ts: Some(now - 2_000),
        ..old
    };
    state::write(&env.state_file(), &recent).unwrap();
    let (_, out) = env.tick().await;
    assert!(!out.contains("NOTHING HAS LANDED"), "{out}");
}

/// `--log-format json` and `--metrics-addr` through the real binary: every log line is one
/// JSON object; /metrics on 127.0.0.1 counts the tick by outcome and the chain error by
/// name. `ENGY_LOG=garbage===` is a usage error naming ENGY_LOG.
#[tokio::test]
async fn json_logs_and_metrics() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    env.set("ENGY_SN53_POLL_S", "300");
    let mut child = env
        .command(&[
            "run",
            "--log-format",
            "json",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut addr = None;
    let mut tick = None;
    while let Some(line) = lines.next_line().await.unwrap() {
        eprintln!("[validator] {line}");
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
        let message = v["message"]
            .as_str()
            .or(v["fields"]["message"].as_str())
            .unwrap_or_else(|| panic!("no message: {line}"))
            .to_owned();
        assert!(
            v["level"].is_string() && v["timestamp"].is_string(),
            "{line}"
        );
        if let Some(rest) = message.strip_prefix("metrics at http://") {
            addr = Some(rest.trim_end_matches("/metrics").to_owned());
        }
        if message.contains("chain unreachable") && message.contains("next poll in 300 s") {
            assert_eq!(v["level"], "WARN", "{line}");
            tick = Some(message);
            break;
        }
    }
    assert!(tick.is_some());
    let addr = addr.expect("the metrics address is logged at start-up");
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    eprintln!("{text}");
    for want in [
        "engy_validator_ticks_total{outcome=\"chain-down\"} 1",
        "engy_validator_chain_errors_total{kind=\"unreachable\"} 1",
        "engy_validator_epoch 5",
        "engy_validator_landings_total 0",
        "engy_validator_commits_total 0",
    ] {
        assert!(text.contains(want), "{want} not in:\n{text}");
    }
    signal(&child, "-TERM");
    assert_eq!(child.wait().await.unwrap().code(), Some(0));

    // off by default: no metrics line
    env.set("ENGY_SN53_POLL_S", "1");
    let (_, out) = env.tick().await;
    assert!(!out.contains("metrics at"), "{out}");

    // a filter that does not parse: exit 2, the variable named
    env.set("ENGY_LOG", "garbage===");
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("ENGY_LOG=\"garbage===\" is not a log filter"),
        "{}",
        stderr(&out)
    );
}
