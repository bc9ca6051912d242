//! Issue 13 (never silently earning nothing) on the REAL subtensor runtime
//! (`../shared/chain/`, chopsticks), through the real binary: an extrinsic that landed after
//! its daemon was stopped is recorded as landed, not resubmitted (item 4); a vector the
//! subnet's weight rules must refuse is never sent (item 6); a validator whose vector has no
//! registered hotkey names the dropped hotkeys (item 8) and says at ERROR, with the blocks
//! left, once its last landing is older than half of `activity_cutoff` (item 3), in `run`
//! and in `check`. Items 5 and 7 are steps of `chain.rs`.
//!
//! Needs `ENGY_SUBTENSOR_URL` (as `tests/run.sh` exports it); unset → a visible skip.
//! One scenario test on the shared chain: each step makes the chain state it needs.

mod common;

use std::time::{Duration, Instant};

use common::chain::*;
use common::*;
use engy_devnet::provider::ProviderDouble;
use engy_validator::chain::Chain;
use engy_validator::schedule;
use subxt::dynamic::Value;
use tokio::io::AsyncReadExt;

/// Above the harness's weights_rate_limit (100) so a due resubmit lands.
const RESUBMIT: u64 = 101;
/// Bound on the daemon reaching the node's pool.
const POOL_LIMIT: Duration = Duration::from_secs(120);

/// Makes a submission due for `env` (wall clock and blocks) and the chain's rate limit pass.
async fn make_due(url: &str, chain: &Chain, env: &Env) {
    env.age_state(3600);
    let (_, lu) = neuron_of(chain, &key(CHARLIE_SEED)).await;
    let lsb = env.state().last_submit_block.unwrap_or(0);
    jump_to(url, chain, lu.max(lsb) + RESUBMIT).await;
}

/// The Weights row the runtime stores for `vector` (the harness's max-upscale).
async fn stored(chain: &Chain, vector: &[(String, u16)]) -> Vec<(u16, u16)> {
    let r = schedule::resolve(vector, &chain.metagraph(NETUID).await.unwrap());
    r.uids
        .iter()
        .copied()
        .zip(max_upscale(&r.weights))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_lands_silently_on_real_subtensor() {
    let Some(url) = chain_url() else {
        eprintln!("SKIP nothing_lands_silently_on_real_subtensor: ENGY_SUBTENSOR_URL is not set (start ../shared/chain/start-subtensor.sh PORT and export ENGY_SUBTENSOR_URL=ws://127.0.0.1:PORT)");
        return;
    };
    let chain = Chain::connect(&url).await.unwrap_or_else(|e| {
        panic!("ENGY_SUBTENSOR_URL={url} is set but the node is unreachable: {e}")
    });
    baseline(&chain).await;
    let (bob, charlie) = (key(BOB_SEED), key(CHARLIE_SEED));
    let (uid, _) = neuron_of(&chain, &charlie).await;
    let provider = ProviderDouble::start(bob.clone(), NETUID).await.unwrap();
    // far from the epochs chain.rs publishes on the same chain
    let epoch = engy_validator::liveness::unix_now() + 1_000_000;
    let v1: Vec<(String, u16)> = vec![
        (key(DAVE_SEED).ss58(), 30000),
        (key(EVE_SEED).ss58(), 20000),
        (key(FERDIE_SEED).ss58(), 10000),
    ];
    provider.publish(epoch, &v1);
    let mut env = Env::new(CHARLIE_SEED, &provider.url(), &bob.ss58(), &url);
    env.set("ENGY_SN53_RESUBMIT_BLOCKS", &RESUBMIT.to_string());
    make_due(&url, &chain, &env).await;
    let (ok, out) = env.tick().await;
    assert!(ok && out.contains("landed in block #"), "{out}");

    // -- item 4: SIGTERM while the set_weights waits for inclusion; the block is built
    //    afterwards: the extrinsic landed, the state was not written. The next run reads
    //    the chain's Weights row and LastUpdate, records the landing, and submits nothing.
    let v2: Vec<(String, u16)> = vec![(key(DAVE_SEED).ss58(), 1), (key(EVE_SEED).ss58(), 3)];
    provider.publish(epoch + 1, &v2);
    make_due(&url, &chain, &env).await;
    let state_before = std::fs::read(env.state_file()).unwrap();
    rpc(&url, "dev_setBlockBuildMode", serde_json::json!(["Manual"])).await;
    let mut daemon = env
        .command(&["run"])
        .env("ENGY_SN53_POLL_S", "300")
        .spawn()
        .unwrap();
    let t = Instant::now();
    while rpc(&url, "author_pendingExtrinsics", serde_json::json!([]))
        .await
        .as_array()
        .is_none_or(Vec::is_empty)
    {
        assert!(
            t.elapsed() < POOL_LIMIT,
            "set_weights never reached the pool"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&daemon, "-TERM");
    let status = daemon.wait().await.unwrap();
    let mut text = String::new();
    daemon
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut text)
        .await
        .unwrap();
    eprintln!("--- the daemon stopped while waiting for inclusion:\n{text}");
    assert_eq!(status.code(), Some(0), "{text}");
    assert!(
        text.contains("signal during a tick: abandoned it"),
        "{text}"
    );
    // the block is built after the process is gone
    new_block(&url, serde_json::json!({"count": 1})).await;
    rpc(
        &url,
        "dev_setBlockBuildMode",
        serde_json::json!(["Instant"]),
    )
    .await;
    let (_, landed) = neuron_of(&chain, &charlie).await;
    assert_eq!(
        chain.weights(NETUID, uid).await.unwrap(),
        stored(&chain, &v2).await
    );
    assert_eq!(std::fs::read(env.state_file()).unwrap(), state_before);
    let h = head(&chain).await;
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains(&format!(
            "the chain already holds this vector (Weights row of uid {uid} matches, LastUpdate #{landed}): recorded as landed in block #{landed}, nothing submitted"
        )),
        "{out}"
    );
    assert!(!out.contains("SettingWeightsTooFast"), "{out}");
    assert_eq!(head(&chain).await, h, "no second extrinsic");
    let st = env.state();
    assert_eq!(st.last_applied, Some(epoch + 1));
    assert_eq!(st.last_submit_block, Some(landed));
    assert_eq!(st.cached_weights.as_deref(), Some(v2.as_slice()));

    // -- item 6: a vector the subnet's weight rules refuse is never sent; the reason is
    //    said in full once per epoch (the second tick of one process is short)
    let hp0 = chain.hyperparams(NETUID).await.unwrap();
    sudo_netuid(&chain, "sudo_set_min_allowed_weights", Value::u128(2)).await;
    let v3: Vec<(String, u16)> = vec![(key(DAVE_SEED).ss58(), 65535)];
    provider.publish(epoch + 2, &v3);
    make_due(&url, &chain, &env).await;
    let (h, lu) = (head(&chain).await, neuron_of(&chain, &charlie).await.1);
    let out = env.run(&["run", "--ticks", "2"]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    let ticks: Vec<&str> = text
        .lines()
        .filter(|l| l.contains(&format!("epoch {} verified", epoch + 2)))
        .collect();
    assert_eq!(ticks.len(), 2, "{text}");
    assert!(ticks[0].contains(" ERROR "), "{text}");
    assert!(
        ticks[0].contains("1 dest uid(s) but the subnet's min_allowed_weights is 2")
            && ticks[0].contains("WeightVecLengthIsLow")
            && ticks[0].contains("nothing submitted"),
        "{text}"
    );
    assert!(ticks[1].contains(" WARN "), "{text}");
    assert!(
        ticks[1].contains("still breaks the subnet's weight rules"),
        "{text}"
    );
    assert!(!ticks[1].contains("WeightVecLengthIsLow"), "{text}");
    assert_eq!(
        (head(&chain).await, neuron_of(&chain, &charlie).await.1),
        (h, lu)
    );
    let out = env.run(&["check"]).await;
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.starts_with("FAIL")
                && l.contains("would land")
                && l.contains("WeightVecLengthIsLow")),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    sudo_netuid(
        &chain,
        "sudo_set_min_allowed_weights",
        Value::u128(hp0.min_allowed_weights.into()),
    )
    .await;
    // a single 65535 weight against max_weight_limit < 65535
    sudo_netuid(&chain, "sudo_set_max_weight_limit", Value::u128(32768)).await;
    let h = head(&chain).await;
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains(" ERROR ")
            && out.contains("MaxWeightExceeded")
            && out.contains("nothing submitted"),
        "{out}"
    );
    assert_eq!(head(&chain).await, h);
    sudo_netuid(
        &chain,
        "sudo_set_max_weight_limit",
        Value::u128(hp0.max_weight_limit.into()),
    )
    .await;

    // -- items 8 and 3: a validator whose vector has no registered hotkey and whose master
    //    (the owner hotkey for the burn) is not registered: nothing lands. The dropped
    //    hotkeys are named; once the last landing is older than half of activity_cutoff,
    //    the tick is an ERROR with the blocks left, and check FAILs the same way.
    let owner = stranger("unregistered master");
    let lost = ProviderDouble::start(owner.clone(), NETUID).await.unwrap();
    let ghosts: Vec<(String, u16)> = vec![
        (stranger("ghost-a").ss58(), 9),
        (stranger("ghost-b").ss58(), 1),
    ];
    lost.publish(epoch, &ghosts);
    let fresh = Env::new(CHARLIE_SEED, &lost.url(), &owner.ss58(), &url);
    let cutoff = u64::from(chain.hyperparams(NETUID).await.unwrap().activity_cutoff);
    let (_, lu) = neuron_of(&chain, &charlie).await;
    jump_to(&url, &chain, lu + cutoff / 2 + 1).await;
    let since = head(&chain).await - lu;
    let (ok, out) = fresh.tick().await;
    assert!(ok);
    let line = out
        .lines()
        .find(|l| l.contains("nothing lands (0 of 2 hotkeys registered)"))
        .unwrap_or_else(|| panic!("no nothing-lands line: {out}"));
    assert!(
        line.contains("[dropped 2 unregistered hotkey(s) holding 100.0% of the weight: ")
            && line.contains("=9,")
            && line.contains("=1"),
        "{line}"
    );
    assert!(line.contains(" ERROR "), "{line}");
    assert!(
        line.contains(&format!(
            "NOTHING HAS LANDED for more than half of activity_cutoff {cutoff}: its LastUpdate is block #{lu}, {since} blocks ago; it drops out of consensus in {} blocks",
            cutoff - since
        )),
        "{line}"
    );
    let out = fresh.run(&["check"]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(!out.status.success());
    assert!(
        text.lines().any(|l| l.starts_with("FAIL")
            && l.contains(&format!(
                "{since} blocks since last_update (block #{lu}) vs activity_cutoff {cutoff}"
            ))
            && l.contains(&format!(
                "drops out of consensus in {} blocks",
                cutoff - since
            ))),
        "{text}"
    );

    // the validator with a landing vector recovers and the alarm is gone
    make_due(&url, &chain, &env).await;
    provider.publish(epoch + 3, &v1);
    let (ok, out) = env.tick().await;
    assert!(ok && out.contains("landed in block #"), "{out}");
    assert!(!out.contains("NOTHING HAS LANDED"), "{out}");
    baseline(&chain).await;
}
