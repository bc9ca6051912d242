//! Integration tests that need no chain: the real binary and the real provider double on
//! 127.0.0.1 (fetch faults, cache/replay/pre-gate decisions taken before the chain, the
//! provider heartbeat, `health`, SIGTERM, configuration refusals).

mod common;

use std::time::Duration;

use common::*;
use engy_devnet::provider::{Fault, ProviderDouble};
use engy_validator::provider::{fetch_latest, fetch_latest_within, FetchError};
use engy_validator::state::{self, State};

/// A node URL where nothing listens (connection refused at once).
const DEAD_CHAIN: &str = "ws://127.0.0.1:9";

fn weights() -> Vec<(String, u16)> {
    vec![
        (key(DAVE_SEED).ss58(), 40000),
        (key(EVE_SEED).ss58(), 25535),
    ]
}

#[tokio::test]
async fn fetch_faults_are_fetch_failures() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let http = engy_validator::provider::client().unwrap();
    // nothing published yet
    assert!(matches!(
        fetch_latest(&http, &p.url()).await,
        Err(FetchError::Status(404))
    ));
    p.publish(3, &weights());
    let body = fetch_latest(&http, &p.url()).await.unwrap();
    let v = engy_core::payload::verify(&body, &p.master_ss58(), 53).unwrap();
    assert_eq!((v.epoch_index, v.weights), (3, weights()));
    // a different master does not verify
    let other = key(ALICE_SEED).ss58();
    assert_eq!(
        engy_core::payload::verify(&body, &other, 53)
            .unwrap_err()
            .reason_word(),
        "signature"
    );

    p.set_fault(Fault::Status500);
    assert!(matches!(
        fetch_latest(&http, &p.url()).await,
        Err(FetchError::Status(500))
    ));
    p.set_fault(Fault::OversizeByHeader);
    match fetch_latest(&http, &p.url()).await {
        Err(FetchError::TooLarge(how)) => assert!(how.contains("Content-Length"), "{how}"),
        other => panic!("{other:?}"),
    }
    p.set_fault(Fault::OversizeStreaming);
    match fetch_latest(&http, &p.url()).await {
        Err(FetchError::TooLarge(how)) => assert!(how.contains("streaming"), "{how}"),
        other => panic!("{other:?}"),
    }
    p.set_fault(Fault::Hang);
    match fetch_latest_within(&http, &p.url(), Duration::from_millis(300)).await {
        Err(FetchError::Transport(m)) => assert!(m.contains("timed out"), "{m}"),
        other => panic!("{other:?}"),
    }
    p.set_fault(Fault::Slowloris {
        interval: Duration::from_millis(20),
    });
    match fetch_latest_within(&http, &p.url(), Duration::from_millis(400)).await {
        Err(FetchError::Transport(m)) => assert!(m.contains("timed out"), "{m}"),
        other => panic!("{other:?}"),
    }
    p.set_fault(Fault::Malformed);
    let body = fetch_latest(&http, &p.url()).await.unwrap();
    assert!(engy_core::payload::verify(&body, &p.master_ss58(), 53).is_err());
    p.set_fault(Fault::None);
    assert!(fetch_latest(&http, &p.url()).await.is_ok());
}

#[tokio::test]
async fn provider_outage_without_cache_submits_nothing_and_stays_healthy() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.set_fault(Fault::Status500);
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    // health before any tick: no heartbeat → unhealthy
    assert!(!env.run(&["health"]).await.status.success());
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("fetch failed: HTTP 500; no cached vector, nothing submitted"),
        "{out}"
    );
    assert_eq!(env.state(), State::default());
    assert!(!env.state_file().exists());
    // the heartbeat file was stamped and health passes
    assert!(engy_validator::liveness::read_ts(&env.heartbeat_file()).is_some());
    let h = env.run(&["health"]).await;
    assert!(h.status.success(), "{h:?}");
    // a stale heartbeat fails health
    std::fs::write(env.heartbeat_file(), r#"{"ts": 1000}"#).unwrap();
    assert!(!env.run(&["health"]).await.status.success());

    // the provider heartbeat was POSTed, signed by the validator hotkey (§6)
    let hbs = p.heartbeats();
    assert_eq!(hbs.len(), 1);
    let signed = hbs[0].verified.as_ref().unwrap();
    assert_eq!(signed.ss58, key(CHARLIE_SEED).ss58());
    let body: serde_json::Value = serde_json::from_slice(&hbs[0].body).unwrap();
    assert_eq!(body["v"], 1);
    assert!(body["version"].as_str().unwrap().starts_with("engy-lv "));
    assert!(body.get("synced_epoch").is_none() && body.get("consensus").is_none());
}

#[tokio::test]
async fn rejected_payload_falls_back_to_cache_and_replay_is_refused_before_the_chain() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let now = engy_validator::liveness::unix_now();
    let cached = State {
        last_applied: Some(10),
        last_submit_block: Some(500),
        last_submit_ts: Some(now),
        cached_weights: Some(weights()),
        cached_digest: Some("ab".repeat(32)),
    };
    state::write(&env.state_file(), &cached).unwrap();

    // An older, genuinely signed epoch: refused by the replay guard, nothing submitted.
    p.publish(9, &weights());
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("epoch 9 verified: older than last applied epoch 10, refused (replay guard)"),
        "{out}"
    );
    assert_eq!(env.state(), cached);

    // A payload signed by another key: rejected, the cached epoch is used; the pre-gate
    // skips (just submitted) without contacting the chain (which is down here).
    p.set_fault(Fault::Raw(
        engy_core::payload::sign_payload(
            &key(ALICE_SEED),
            53,
            11,
            &engy_core::payload::build_result_json(53, 11, &weights()),
        )
        .into_bytes(),
    ));
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(out.contains("payload rejected: signature; using cached epoch 10: already applied, resubmit due in ~"), "{out}");
    assert!(out.contains("pre-gate, chain not contacted"), "{out}");
    assert_eq!(env.state(), cached);

    // Once due, the chain is needed: it is down → contained, state unchanged, exit 0.
    env.age_state(3600);
    let aged = env.state();
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(out.contains("chain unreachable"), "{out}");
    assert!(out.contains("state unchanged"), "{out}");
    assert_eq!(env.state(), aged);
    // the heartbeat reports the synced epoch and the cached digest
    let hb = p.heartbeats().pop().unwrap();
    let body: serde_json::Value = serde_json::from_slice(&hb.body).unwrap();
    assert_eq!(body["synced_epoch"], 10);
    assert_eq!(body["consensus"]["digest"], "ab".repeat(32));
}

#[tokio::test]
async fn configuration_refusals() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    // a lone override of the protocol pair
    env.vars.retain(|(k, _)| k != "ENGY_SN53_MASTER_HOTKEY");
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("only be overridden together"));
    // no wallet names
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    env.vars.retain(|(k, _)| k != "ENGY_SN53_WALLET");
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--wallet"));
    // a bad network
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), "mainnet");
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ENGY_SN53_NETWORK"));
    // a missing wallet file
    env.set("ENGY_SN53_NETWORK", DEAD_CHAIN);
    env.set("ENGY_SN53_WALLET_HOTKEY", "nope");
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("wallet vali/nope"));
}

#[tokio::test]
async fn sigterm_exits_zero() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    env.set("ENGY_SN53_POLL_S", "300");
    let mut child = env.command(&["run"]).spawn().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // wait for the first tick's line, then SIGTERM while idle
    while let Some(line) = lines.next_line().await.unwrap() {
        if line.contains("next poll in 300 s") {
            break;
        }
    }
    signal(&child, "-TERM");
    let status = child.wait().await.unwrap();
    assert_eq!(status.code(), Some(0));
}
