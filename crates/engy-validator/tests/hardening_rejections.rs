//! "Rejected for the right reason" (issue 8, PROTOCOL.md §6): every tampering of a valid
//! payload, served over real HTTP by the provider double on 127.0.0.1, is refused by the
//! validator's fetch + verify path with the exact reason, and nothing reaches the chain:
//! the tick ends before connecting (a TCP listener standing in for the node counts zero
//! connections) and the state file is never created.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use engy_core::payload::{build_result_json, sha256_hex, sign_payload};
use engy_devnet::provider::{Fault, ProviderDouble};
use engy_validator::config::Settings;
use engy_validator::daemon::Daemon;
use engy_validator::provider::{fetch_latest_within, FetchError};
use serde_json::{json, Value};

const NETUID: u16 = 53;
const EPOCH: u64 = 77;

fn weights() -> Vec<(String, u16)> {
    vec![
        (key(DAVE_SEED).ss58(), 40000),
        (key(EVE_SEED).ss58(), 25535),
    ]
}

/// A "node" that only counts the connections it is offered (none may arrive).
async fn chain_stand_in() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .unwrap();
    let url = format!("ws://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            drop(sock);
        }
    });
    (url, count)
}

fn settings(api: &str, master: &str, chain_url: &str, dir: &Path) -> Settings {
    Settings {
        wallet: "vali".into(),
        wallet_hotkey: "default".into(),
        wallet_path: dir.join("wallets"),
        api: api.into(),
        master_hotkey: master.into(),
        netuid: NETUID,
        network: chain_url.into(),
        chain_url: chain_url.into(),
        poll_s: 1,
        resubmit_blocks: 120,
        state_file: dir.join("state.json"),
        heartbeat_file: dir.join("heartbeat.json"),
    }
}

/// The genuine body as a JSON object (field order kept by re-serialising with serde_json's
/// map; verification does not depend on order).
fn genuine(p: &ProviderDouble) -> serde_json::Map<String, Value> {
    let body = p.publish(EPOCH, &weights());
    serde_json::from_str(&body).unwrap()
}

fn to_body(obj: &serde_json::Map<String, Value>) -> Vec<u8> {
    serde_json::to_vec(obj).unwrap()
}

/// What a case must produce.
#[derive(Debug)]
enum Want {
    /// Verified with the genuine weights (the tampering is of a display-only field).
    Verified,
    /// Rejected by verify with this reason word (`malformed` also for non-JSON).
    Reason(&'static str),
    /// The fetch fails with a cap / timeout, before verification.
    TooLarge(&'static str),
    TimedOut,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_tampering_is_rejected_for_the_right_reason_and_never_reaches_the_chain() {
    let master = key(BOB_SEED);
    let p = ProviderDouble::start(master.clone(), NETUID).await.unwrap();
    let base = genuine(&p);
    let rj = base["result_json"].as_str().unwrap().to_owned();
    let set = |field: &str, v: Value| {
        let mut o = base.clone();
        o.insert(field.into(), v);
        Fault::Raw(to_body(&o))
    };
    // result_json variants, genuinely signed by the master (only the inner content is wrong)
    let signed = |epoch: u64, inner: &str| {
        Fault::Raw(sign_payload(&master, NETUID, epoch, inner).into_bytes())
    };
    let genuine_body = to_body(&base);

    let cases: Vec<(&str, Fault, Want)> = vec![
        (
            "digest of other bytes",
            set("digest", json!(sha256_hex(b"other"))),
            Want::Reason("digest"),
        ),
        (
            "digest uppercase",
            set(
                "digest",
                json!(base["digest"].as_str().unwrap().to_uppercase()),
            ),
            Want::Reason("digest"),
        ),
        (
            "result_json edited, digest kept",
            set("result_json", json!(rj.replace("40000", "40001"))),
            Want::Reason("digest"),
        ),
        (
            "signature from another key",
            Fault::Raw(sign_payload(&key(ALICE_SEED), NETUID, EPOCH, &rj).into_bytes()),
            Want::Reason("signature"),
        ),
        (
            "signature not hex",
            set("signature", json!("zz".repeat(64))),
            Want::Reason("signature"),
        ),
        (
            "signature truncated",
            set(
                "signature",
                json!(&base["signature"].as_str().unwrap()[..126]),
            ),
            Want::Reason("signature"),
        ),
        (
            "top-level epoch_index changed (signature covers it)",
            set("epoch_index", json!(EPOCH + 1)),
            Want::Reason("signature"),
        ),
        (
            "epoch mismatch inside result_json (signed)",
            signed(EPOCH, &build_result_json(NETUID, EPOCH + 1, &weights())),
            Want::Reason("malformed"),
        ),
        (
            "netuid mismatch inside result_json (signed)",
            signed(EPOCH, &build_result_json(NETUID + 1, EPOCH, &weights())),
            Want::Reason("malformed"),
        ),
        (
            "top-level netuid",
            set("netuid", json!(NETUID + 1)),
            Want::Reason("netuid"),
        ),
        (
            "top-level netuid as string",
            set("netuid", json!("53")),
            Want::Reason("netuid"),
        ),
        ("version 2", set("v", json!(2)), Want::Reason("version")),
        (
            "version true",
            set("v", json!(true)),
            Want::Reason("version"),
        ),
        (
            "weights shape: triple",
            signed(
                EPOCH,
                &format!(
                    r#"{{"epoch_index":{EPOCH},"netuid":53,"weights":[["{}",1,2]]}}"#,
                    key(DAVE_SEED).ss58()
                ),
            ),
            Want::Reason("malformed"),
        ),
        (
            "weights shape: weight 65536",
            signed(
                EPOCH,
                &format!(
                    r#"{{"epoch_index":{EPOCH},"netuid":53,"weights":[["{}",65536]]}}"#,
                    key(DAVE_SEED).ss58()
                ),
            ),
            Want::Reason("malformed"),
        ),
        (
            "weights shape: boolean weight",
            signed(
                EPOCH,
                &format!(
                    r#"{{"epoch_index":{EPOCH},"netuid":53,"weights":[["{}",true]]}}"#,
                    key(DAVE_SEED).ss58()
                ),
            ),
            Want::Reason("malformed"),
        ),
        (
            "weights shape: object instead of list",
            signed(
                EPOCH,
                &format!(
                    r#"{{"epoch_index":{EPOCH},"netuid":53,"weights":{{"{}":1}}}}"#,
                    key(DAVE_SEED).ss58()
                ),
            ),
            Want::Reason("malformed"),
        ),
        (
            "top-level weights forged (display only: ignored)",
            set("weights", json!([[key(ALICE_SEED).ss58(), 65535]])),
            Want::Verified,
        ),
        (
            "signed_hotkey forged (display only: ignored)",
            set("signed_hotkey", json!(key(ALICE_SEED).ss58())),
            Want::Verified,
        ),
        (
            "truncated body",
            Fault::Raw(genuine_body[..genuine_body.len() / 2].to_vec()),
            Want::Reason("malformed"),
        ),
        (
            "truncated by one byte",
            Fault::Raw(genuine_body[..genuine_body.len() - 1].to_vec()),
            Want::Reason("malformed"),
        ),
        ("not JSON", Fault::Malformed, Want::Reason("malformed")),
        (
            "oversize by Content-Length",
            Fault::OversizeByHeader,
            Want::TooLarge("Content-Length"),
        ),
        (
            "oversize while streaming (no Content-Length)",
            Fault::OversizeStreaming,
            Want::TooLarge("streaming"),
        ),
        (
            "slow body",
            Fault::Slowloris {
                interval: Duration::from_millis(50),
            },
            Want::TimedOut,
        ),
    ];

    let http = engy_validator::provider::client().unwrap();
    let master_ss58 = p.master_ss58();
    let mut failures = Vec::new();
    for (name, fault, want) in cases {
        p.set_fault(fault);
        // 1. the fetch + verify path
        let got = fetch_latest_within(&http, &p.url(), Duration::from_millis(1500)).await;
        let verdict = match (&want, &got) {
            (Want::TooLarge(how), Err(FetchError::TooLarge(m))) => m.contains(how),
            (Want::TimedOut, Err(FetchError::Transport(m))) => m.contains("timed out"),
            (Want::Verified, Ok(body)) => engy_core::payload::verify(body, &master_ss58, NETUID)
                .map(|v| v.weights == weights() && v.epoch_index == EPOCH)
                .unwrap_or(false),
            (Want::Reason(r), Ok(body)) => engy_core::payload::verify(body, &master_ss58, NETUID)
                .err()
                .is_some_and(|e| e.reason_word() == *r),
            _ => false,
        };
        if !verdict {
            let detail = match &got {
                Ok(body) => format!(
                    "{:?}",
                    engy_core::payload::verify(body, &master_ss58, NETUID).map(|v| v.epoch_index)
                ),
                Err(e) => e.to_string(),
            };
            failures.push(format!("{name}: want {want:?}, got {detail}"));
            continue;
        }
        // 2. a whole daemon tick (no cache): the exact line, no chain contact, no state.
        //    (The slow body is left out here: the daemon's own fetch timeout is 30 s.)
        if matches!(want, Want::TimedOut | Want::Verified) {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let (chain_url, contacts) = chain_stand_in().await;
        let s = settings(&p.url(), &master_ss58, &chain_url, dir.path());
        let mut d = Daemon::new(s.clone(), key(CHARLIE_SEED)).unwrap();
        let report = d.tick(engy_validator::liveness::unix_now()).await;
        let expect = match want {
            Want::Reason(r) => {
                format!("payload rejected: {r}; no cached vector, nothing submitted")
            }
            Want::TooLarge(_) => "fetch failed: body larger than".to_owned(),
            _ => unreachable!(),
        };
        if report.outcome != "nothing" || !report.line.contains(&expect) {
            failures.push(format!(
                "{name}: tick said {:?} {:?}, want {expect:?}",
                report.outcome, report.line
            ));
        }
        if contacts.load(Ordering::SeqCst) != 0 {
            failures.push(format!("{name}: the tick contacted the chain"));
        }
        if s.state_file.exists() {
            failures.push(format!("{name}: the state file was written"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// With a cached vector the rejection falls back to the cache for the SAME epoch it landed
/// (never the tampered content): the tampered weights never reach the submit path, and the
/// pre-gate keeps the chain untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_payload_with_cache_uses_the_cache_not_the_tampered_weights() {
    let master = key(BOB_SEED);
    let p = ProviderDouble::start(master.clone(), NETUID).await.unwrap();
    let base = genuine(&p);
    let mut forged = base.clone();
    let rj = base["result_json"].as_str().unwrap().replace("40000", "1");
    forged.insert("result_json".into(), json!(rj));
    p.set_fault(Fault::Raw(to_body(&forged)));
    let dir = tempfile::tempdir().unwrap();
    let (chain_url, contacts) = chain_stand_in().await;
    let s = settings(&p.url(), &p.master_ss58(), &chain_url, dir.path());
    let now = engy_validator::liveness::unix_now();
    let cached = engy_validator::state::State {
        last_applied: Some(EPOCH - 1),
        last_submit_block: Some(10),
        last_submit_ts: Some(now),
        cached_weights: Some(weights()),
        cached_digest: Some("cd".repeat(32)),
    };
    engy_validator::state::write(&s.state_file, &cached).unwrap();
    let before = std::fs::read(&s.state_file).unwrap();
    let mut d = Daemon::new(s.clone(), key(CHARLIE_SEED)).unwrap();
    let r = d.tick(now).await;
    assert_eq!(r.outcome, "skipped", "{}", r.line);
    assert!(
        r.line.contains(&format!(
            "payload rejected: digest; using cached epoch {}",
            EPOCH - 1
        )),
        "{}",
        r.line
    );
    assert_eq!(contacts.load(Ordering::SeqCst), 0);
    assert_eq!(std::fs::read(&s.state_file).unwrap(), before);
}
