//! Issue 21 (signals an operator can trust) on the REAL subtensor runtime (chopsticks,
//! `../shared/chain/`), through the real binary, as one scenario on the shared chain:
//!
//! * items 1–3: with the last landing older than half of `activity_cutoff` and the pool
//!   refusing every extrinsic with chopsticks' JSON text (`{"invalid":{"custom":3}}`,
//!   quotes and braces) after a provider 5xx, `/metrics` still parses in both content types,
//!   counts the failures by kind, shows `blocks_since_landing` against `activity_cutoff`,
//!   and `health --landing` fails naming it;
//! * item 6: a pool rejection for an ancient birth block is rebuilt and resubmitted in the
//!   same tick (the rejection comes from `engy_devnet::chain_proxy`, a node answering as a
//!   lagging node of a load-balanced endpoint does; the resubmission lands on the real
//!   runtime); a call that dispatches and fails (`IncorrectWeightVersionKey`) backs off
//!   exponentially, says when the next try is, and retries at once when the hyperparameter
//!   changes;
//! * item 7: a runtime change under a running validator is announced once (spec 218 → 293,
//!   the extensions' change) and exposed as `spec_version`. chopsticks can execute
//!   `sudo(system.set_code_without_checks)` with the spec 293 wasm on the spec 218 chain
//!   (`CodeUpdated`, `state_getRuntimeVersion` answers 293), but the shared harness runs
//!   chopsticks without `--allow-unresolved-imports`, so the upgraded chain cannot serve
//!   its metadata (`ext_host_calls_bls12_381_final_exponentiation_version_1` is
//!   unresolved) and no client can use it. The step therefore moves the validator's node
//!   from the spec 218 chain to the spec 293 chain (`../shared/chain293/`,
//!   `ENGY_SUBTENSOR293_URL`) through the proxy between two ticks: the validator sees
//!   exactly what a runtime upgrade shows it (new spec, new metadata and extensions at the
//!   next connection) and must land there.
//!
//! Needs `ENGY_SUBTENSOR_URL` (and `ENGY_SUBTENSOR293_URL` for item 7), as `tests/run.sh`
//! exports them; unset → a visible skip.

mod common;

use common::chain::*;
use common::*;
use engy_devnet::chain_proxy::{ChainProxy, ANCIENT_BIRTH_BLOCK};
use engy_devnet::provider::{Fault, ProviderDouble};
use engy_validator::chain::Chain;
use subxt::dynamic::Value;

/// Above the harness's weights_rate_limit (100) so a due resubmit lands.
const RESUBMIT: u64 = 101;

/// Makes a submission due for `env` (wall clock and blocks) and the chain's rate limit pass.
async fn make_due(url: &str, chain: &Chain, env: &Env) {
    env.age_state(3600);
    let (_, lu) = neuron_of(chain, &key(CHARLIE_SEED)).await;
    let lsb = env.state().last_submit_block.unwrap_or(0);
    jump_to(url, chain, lu.max(lsb) + RESUBMIT).await;
}

fn metrics_url(line: &str) -> String {
    line.split("metrics at ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_hold_under_chain_faults_retries_and_a_runtime_change() {
    let Some(url) = chain_url() else {
        eprintln!("SKIP signals_hold_under_chain_faults_retries_and_a_runtime_change: ENGY_SUBTENSOR_URL is not set (start ../shared/chain/start-subtensor.sh PORT and export ENGY_SUBTENSOR_URL=ws://127.0.0.1:PORT)");
        return;
    };
    let chain = Chain::connect(&url).await.unwrap_or_else(|e| {
        panic!("ENGY_SUBTENSOR_URL={url} is set but the node is unreachable: {e}")
    });
    baseline(&chain).await;
    let (bob, charlie) = (key(BOB_SEED), key(CHARLIE_SEED));
    let provider = ProviderDouble::start(bob.clone(), NETUID).await.unwrap();
    // far from the epochs other chain tests publish on the same chain
    let epoch = engy_validator::liveness::unix_now() + 3_000_000;
    let v1: Vec<(String, u16)> = vec![
        (key(DAVE_SEED).ss58(), 30000),
        (key(EVE_SEED).ss58(), 20000),
        (key(FERDIE_SEED).ss58(), 10000),
    ];
    let mut env = Env::new(CHARLIE_SEED, &provider.url(), &bob.ss58(), &url);
    env.set("ENGY_SN53_RESUBMIT_BLOCKS", &RESUBMIT.to_string());

    // -- items 1–3: provider 5xx, then a pool that refuses everything with JSON text, the
    //    last landing more than half of activity_cutoff ago
    let cutoff = u64::from(chain.hyperparams(NETUID).await.unwrap().activity_cutoff);
    let (_, lu) = neuron_of(&chain, &charlie).await;
    jump_to(&url, &chain, lu + cutoff / 2 + 100).await;
    sudo(
        &chain,
        "sudo_set_weights_min_stake",
        vec![Value::u128(1_000_000_000_000_000_000)],
    )
    .await;
    provider.set_fault(Fault::Status500);
    let mut faulty = Env::new(CHARLIE_SEED, &provider.url(), &bob.ss58(), &url);
    faulty.set("ENGY_SN53_RESUBMIT_BLOCKS", &RESUBMIT.to_string());
    faulty.set("ENGY_SN53_METRICS_ADDR", "127.0.0.1:0");
    let mut d = Running::spawn(&faulty, &["run"]);
    let murl = metrics_url(
        &d.wait_for("the metrics address", |l| l.contains("metrics at http://"))
            .await,
    );
    d.wait_for("the provider 5xx", |l| l.contains("fetch failed: HTTP 500"))
        .await;
    provider.set_fault(Fault::None);
    provider.publish(epoch, &v1);
    let line = d
        .wait_for("the pool rejection", |l| {
            l.contains("pool rejected: Invalid Transaction Custom(3)")
        })
        .await;
    assert!(line.contains("NOTHING HAS LANDED"), "{line}");
    let since = head(&chain).await - lu;
    for (accept, format) in [
        (Some("text/plain;version=0.0.4"), "text"),
        (None, "openmetrics"),
    ] {
        let (_, text) = scrape(&murl, accept).await;
        check_exposition(format, &text);
        assert!(!text.contains("invalid"), "free text in a label:\n{text}");
        assert!(
            sample(
                &text,
                "engy_validator_chain_errors_total{kind=\"pool-rejected\"}"
            ) >= Some(1.0),
            "{text}"
        );
        assert!(
            sample(
                &text,
                "engy_validator_provider_errors_total{kind=\"http-5xx\"}"
            ) >= Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "engy_validator_activity_cutoff"),
            Some(cutoff as f64),
            "{text}"
        );
        assert_eq!(
            sample(&text, "engy_validator_spec_version"),
            Some(218.0),
            "{text}"
        );
        let b = sample(&text, "engy_validator_blocks_since_landing").unwrap();
        assert!(
            b >= (cutoff / 2 + 100) as f64 && b <= since as f64,
            "{b} vs {since}:\n{text}"
        );
    }
    assert!(d.stop().await.success());
    let out = faulty.run(&["health", "--landing"]).await;
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        said.contains("NOTHING LANDED for ")
            && said.contains(&format!("more than half of activity_cutoff {cutoff}")),
        "{said}"
    );
    let out = faulty.run(&["health"]).await;
    assert!(out.status.success(), "health stays a liveness check");
    sudo(&chain, "sudo_set_weights_min_stake", vec![Value::u128(0)]).await;

    // -- item 6a: an ancient birth block is rebuilt with a fresh era and resent at once
    let proxy = ChainProxy::start(&url).await.unwrap();
    let mut via_proxy = Env {
        home: tempfile::tempdir().unwrap(),
        vars: env.vars.clone(),
    };
    via_proxy.set("HOME", env.home.path().to_str().unwrap());
    via_proxy.set("ENGY_SN53_NETWORK", &proxy.url());
    make_due(&url, &chain, &env).await;
    proxy.reject_next_submit(ANCIENT_BIRTH_BLOCK);
    let (ok, out) = via_proxy.tick().await;
    assert!(ok, "{out}");
    assert_eq!((proxy.submits(), proxy.rejected()), (2, 1), "{out}");
    let warn = out
        .lines()
        .find(|l| l.contains("refused by the transaction pool"))
        .unwrap_or_else(|| panic!("no resubmit notice:\n{out}"));
    assert!(
        warn.contains("AncientBirthBlock (")
            && warn.contains("resubmitting now (once in this tick)"),
        "{warn}"
    );
    let landed = out
        .lines()
        .find(|l| l.contains("landed in block #"))
        .unwrap_or_else(|| panic!("not landed in the same tick:\n{out}"));
    assert!(landed.contains("resubmitted once with a fresh era after the pool refused the first as ancient-birth-block"), "{landed}");

    // -- item 6b: IncorrectWeightVersionKey backs off, says when, resets on the change
    sudo_netuid(&chain, "sudo_set_weights_version_key", Value::u128(5)).await;
    provider.publish(epoch + 1, &v1);
    make_due(&url, &chain, &env).await;
    let mut d = Running::spawn(&env, &["run"]);
    let first = d
        .wait_for("the first dispatch failure", |l| {
            l.contains("IncorrectWeightVersionKey (included")
        })
        .await;
    assert!(
        first.contains("dispatch failure 1 in a row: next try in 2 s"),
        "{first}"
    );
    let second = d
        .wait_for("the second dispatch failure", |l| {
            l.contains("IncorrectWeightVersionKey (included")
        })
        .await;
    assert!(
        second.contains("dispatch failure 2 in a row: next try in 4 s"),
        "{second}"
    );
    // between the two, the tick(s) inside the first wait sent nothing and said why
    let held: Vec<&String> = d
        .seen
        .iter()
        .filter(|l| l.contains("not submitted: the last submission dispatched and failed with IncorrectWeightVersionKey (1 time(s) in a row); next try in "))
        .collect();
    assert!(!held.is_empty(), "{}", d.seen.join("\n"));
    sudo_netuid(&chain, "sudo_set_weights_version_key", Value::u128(0)).await;
    let reset = d
        .wait_for("the backoff reset", |l| {
            l.contains("dispatch backoff reset")
        })
        .await;
    assert!(reset.contains("weights_version_key 5 → 0"), "{reset}");
    d.wait_for("the landing", |l| l.contains("landed in block #"))
        .await;
    let sent = d
        .seen
        .iter()
        .filter(|l| l.contains("IncorrectWeightVersionKey (included"))
        .count();
    let ticks = d
        .seen
        .iter()
        .filter(|l| l.contains(&format!("epoch {}", epoch + 1)))
        .count();
    assert!(
        sent < ticks,
        "{sent} sends in {ticks} ticks:\n{}",
        d.seen.join("\n")
    );
    assert!(d.stop().await.success());

    // -- item 7: the runtime under the validator changes between two ticks
    let Some(url293) = std::env::var("ENGY_SUBTENSOR293_URL")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        eprintln!("SKIP the runtime-change step: ENGY_SUBTENSOR293_URL is not set (start ../shared/chain293/start-subtensor.sh PORT and export it)");
        baseline(&chain).await;
        return;
    };
    let switch = ChainProxy::start(&url).await.unwrap();
    let mut moving = Env::new(CHARLIE_SEED, &provider.url(), &bob.ss58(), &switch.url());
    moving.set("ENGY_SN53_RESUBMIT_BLOCKS", &RESUBMIT.to_string());
    moving.set("ENGY_SN53_METRICS_ADDR", "127.0.0.1:0");
    provider.publish(epoch + 2, &v1);
    make_due(&url, &chain, &env).await;
    let mut d = Running::spawn(&moving, &["run"]);
    let murl = metrics_url(
        &d.wait_for("the metrics address", |l| l.contains("metrics at http://"))
            .await,
    );
    d.wait_for("the start-up runtime line", |l| {
        l.contains("runtime spec 218")
    })
    .await;
    d.wait_for("a landing on spec 218", |l| l.contains("landed in block #"))
        .await;
    switch.set_upstream(&url293);
    provider.publish(epoch + 3, &v1);
    let upgrade = d
        .wait_for("the runtime change", |l| l.contains("runtime upgraded"))
        .await;
    assert!(upgrade.contains("spec 218 → 293"), "{upgrade}");
    assert!(upgrade.contains("transaction extensions"), "{upgrade}");
    let after = d
        .wait_for("the tick on spec 293", |l| {
            l.contains(&format!("epoch {}", epoch + 3))
        })
        .await;
    let (_, text) = scrape(&murl, Some("text/plain;version=0.0.4")).await;
    check_exposition("text", &text);
    assert_eq!(
        sample(&text, "engy_validator_spec_version"),
        Some(293.0),
        "{text}"
    );
    assert!(after.contains("landed in block #"), "{after}");
    // said once: a later tick on the same runtime says nothing more
    provider.publish(epoch + 4, &v1);
    d.wait_for("a later tick", |l| {
        l.contains(&format!("epoch {}", epoch + 4))
    })
    .await;
    let announced = d
        .seen
        .iter()
        .filter(|l| l.contains("runtime upgraded"))
        .count();
    assert_eq!(announced, 1, "{}", d.seen.join("\n"));
    assert!(d.stop().await.success());
    baseline(&chain).await;
}
