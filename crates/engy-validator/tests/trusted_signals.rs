//! Issue 21 (signals an operator can trust), the parts without a chain, through the real
//! binary: settings that cannot work are refused at start-up (exit 2, naming the variable,
//! item 5); in JSON mode every line, fatal start-up errors included, is a JSON object
//! (item 4); `health` names a state that lands nothing and `health --landing` fails on it
//! (item 3); `/metrics` answers both content types validly after a provider 5xx, every
//! family present from start-up (items 1–2). The chain parts are in
//! `trusted_signals_chain.rs`.

mod common;

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

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Item 5: a value that parses but cannot work is refused before anything runs.
#[tokio::test]
async fn unworkable_settings_are_refused_at_start_up_naming_the_variable() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    for (var, value) in [("ENGY_SN53_MAX_TICKS", "0"), ("ENGY_SN53_NETUID", "0")] {
        let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
        env.set(var, value);
        let out = env.run(&["run"]).await;
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}={value}: {err}");
        assert!(err.contains(var), "{var}={value}: {err}");
        assert!(
            !text(&out.stdout).contains("starting"),
            "{var}={value} started"
        );
        assert_eq!(p.fetches(), 0, "{var}={value} ran a tick");
    }
}

/// Item 4: `ENGY_SN53_LOG_FORMAT=json` (or `--log-format json`): a usage error, a bad
/// setting, a bad log filter and a wallet that cannot be read are each one JSON line naming
/// the problem, and the run's own lines are JSON too.
#[tokio::test]
async fn json_mode_writes_only_json_lines_fatal_errors_included() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    let cases: Vec<(&str, &str, Vec<&str>, u8, &str)> = vec![
        (
            "ENGY_SN53_NETWORK",
            "mainnet",
            vec!["run"],
            2,
            "ENGY_SN53_NETWORK must be",
        ),
        (
            "ENGY_SN53_MAX_TICKS",
            "-1",
            vec!["run"],
            2,
            "ENGY_SN53_MAX_TICKS",
        ),
        ("ENGY_LOG", "garbage===", vec!["run"], 2, "ENGY_LOG="),
        (
            "ENGY_SN53_WALLET_HOTKEY",
            "missing",
            vec!["run"],
            1,
            "missing",
        ),
        (
            "ENGY_SN53_POLL_S",
            "1",
            vec!["run", "--no-such-flag"],
            2,
            "--no-such-flag",
        ),
    ];
    for (var, value, args, code, names) in cases {
        let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
        env.set("ENGY_SN53_LOG_FORMAT", "json");
        env.set(var, value);
        let out = env.run(&args).await;
        let (o, e) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(
            out.status.code(),
            Some(i32::from(code)),
            "{var}={value}: {e}"
        );
        assert_json_lines(&o);
        assert_json_lines(&e);
        let fatal: serde_json::Value = serde_json::from_str(e.lines().last().unwrap_or(""))
            .unwrap_or_else(|_| panic!("{var}={value}: no JSON fatal line: {e}"));
        assert_eq!(fatal["level"], "ERROR", "{fatal}");
        assert_eq!(fatal["exit_code"], code, "{fatal}");
        assert!(
            fatal["message"].as_str().is_some_and(|m| m.contains(names)),
            "{var}={value}: {fatal}"
        );
    }
    // the flag works like the variable, and a run's lines are JSON as well
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let out = env
        .run(&["run", "--log-format", "json", "--ticks", "1"])
        .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_json_lines(&text(&out.stdout));
    assert_json_lines(&text(&out.stderr));
    assert!(text(&out.stdout).contains("chain unreachable"));
}

/// Item 3: `health` stays a liveness check (exit 0 while ticks complete) but names a
/// validator that lands nothing; `health --landing` exits 1 on it: a state file whose
/// replay guard refuses every vector, and a last landing older than half of
/// `activity_cutoff` (here from the state file on the wall clock, the chain unreachable).
#[tokio::test]
async fn health_names_what_lands_nothing_and_health_landing_fails_on_it() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.publish(5, &weights());
    let now = engy_validator::liveness::unix_now();

    // a fresh landing: both pass
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    state::write(
        &env.state_file(),
        &State {
            last_applied: Some(5),
            last_submit_block: Some(1000),
            last_submit_ts: Some(now - 600),
            cached_weights: Some(weights()),
            cached_digest: None,
        },
    )
    .unwrap();
    assert!(env.tick().await.0);
    let out = env.run(&["health"]).await;
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("landing ok: last landing 50 blocks ago"),
        "{}",
        text(&out.stdout)
    );
    let out = env.run(&["health", "--landing"]).await;
    assert!(out.status.success(), "{}", text(&out.stdout));

    // the replay guard refuses every vector
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    state::write(
        &env.state_file(),
        &State {
            last_applied: Some(900),
            last_submit_block: Some(1000),
            last_submit_ts: Some(now - 600),
            cached_weights: Some(weights()),
            cached_digest: None,
        },
    )
    .unwrap();
    let (ok, out) = env.tick().await;
    assert!(ok && out.contains("refused (replay guard)"), "{out}");
    let out = env.run(&["health"]).await;
    assert!(out.status.success(), "health is liveness only");
    let said = text(&out.stdout);
    assert!(said.starts_with("ok: last tick"), "{said}");
    assert!(
        said.contains("NOTHING LANDS: the state file refuses every vector"),
        "{said}"
    );
    let out = env.run(&["health", "--landing"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("replay guard"));

    // the last landing 40 000 s ago (3333 blocks) and the chain unreachable
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    state::write(
        &env.state_file(),
        &State {
            last_applied: Some(5),
            last_submit_block: Some(1000),
            last_submit_ts: Some(now - 40_000),
            cached_weights: Some(weights()),
            cached_digest: None,
        },
    )
    .unwrap();
    let (ok, out) = env.tick().await;
    assert!(ok && out.contains("chain unreachable"), "{out}");
    let out = env.run(&["health"]).await;
    assert!(out.status.success());
    let said = text(&out.stdout);
    assert!(
        // 40 000 s at 12 s a block, give or take the seconds this test takes
        said.contains("NOTHING LANDED for 333")
            && said.contains("blocks, more than half of activity_cutoff 5000"),
        "{said}"
    );
    let out = env.run(&["health", "--landing"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
}

/// Items 1–2 without a chain: every family the docs list is scraped at 0 from start-up;
/// after a provider 5xx and an unreachable chain both content types parse with a real
/// parser (promtool for 0.0.4, prometheus_client for OpenMetrics) and the failures are
/// counted by kind.
#[tokio::test]
async fn metrics_parse_in_both_formats_after_a_provider_5xx() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.set_fault(Fault::Status500);
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    env.set("ENGY_SN53_METRICS_ADDR", "127.0.0.1:0");
    env.set("ENGY_SN53_POLL_S", "1");
    let mut d = Running::spawn(&env, &["run"]);
    let at = d
        .wait_for("the metrics address", |l| l.contains("metrics at http://"))
        .await;
    let url = at
        .split("metrics at ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap()
        .to_owned();
    // before any tick: every family of docs/VALIDATOR.md "Metrics", the error kinds at 0
    let (_, first) = scrape(&url, Some("text/plain;version=0.0.4")).await;
    check_exposition("text", &first);
    for family in [
        "engy_validator_ticks_total{outcome=\"submitted\"}",
        "engy_validator_ticks_total{outcome=\"replay\"}",
        "engy_validator_landings_total",
        "engy_validator_last_landing_block",
        "engy_validator_last_landing_age_seconds",
        "engy_validator_blocks_since_landing",
        "engy_validator_activity_cutoff",
        "engy_validator_chain_errors_total{kind=\"unreachable\"}",
        "engy_validator_chain_errors_total{kind=\"ancient-birth-block\"}",
        "engy_validator_chain_errors_total{kind=\"pool-rejected\"}",
        "engy_validator_provider_errors_total{kind=\"http-5xx\"}",
        "engy_validator_provider_errors_total{kind=\"transport\"}",
        "engy_validator_epoch",
        "engy_validator_spec_version",
        "engy_validator_commits_total",
        "engy_validator_reveals_total{result=\"not_revealed\"}",
    ] {
        assert_eq!(
            sample(&first, family),
            Some(0.0),
            "{family} not 0 in:\n{first}"
        );
    }
    d.wait_for("a tick with the provider 5xx", |l| {
        l.contains("fetch failed: HTTP 500")
    })
    .await;
    p.set_fault(Fault::None);
    p.publish(7, &weights());
    d.wait_for("a tick with the chain unreachable", |l| {
        l.contains("chain unreachable")
    })
    .await;
    let (ct, om) = scrape(&url, None).await;
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    check_exposition("openmetrics", &om);
    let (ct, plain) = scrape(&url, Some("text/plain;version=0.0.4")).await;
    assert!(ct.starts_with("text/plain; version=0.0.4"), "{ct}");
    check_exposition("text", &plain);
    assert!(
        sample(
            &plain,
            "engy_validator_provider_errors_total{kind=\"http-5xx\"}"
        ) >= Some(1.0),
        "{plain}"
    );
    assert!(
        sample(
            &plain,
            "engy_validator_chain_errors_total{kind=\"unreachable\"}"
        ) >= Some(1.0),
        "{plain}"
    );
    assert!(d.stop().await.success());
}
