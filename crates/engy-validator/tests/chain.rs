//! The validator end to end on the REAL subtensor runtime (`../shared/chain/`, chopsticks).
//!
//! Needs `ENGY_SUBTENSOR_URL=ws://127.0.0.1:PORT` of a chain started with
//! `start-subtensor.sh PORT`. Unset → a visible skip; set but unreachable → FAIL.
//! One scenario test, because every step shares the one chain; each step makes the chain
//! state it needs (sudo knobs, `dev_newBlock` jumps) instead of assuming a fresh chain.

mod common;

use common::chain::*;
use common::*;
use engy_devnet::provider::{Fault, ProviderDouble};
use engy_validator::chain::{Chain, Sr25519Signer};
use engy_validator::schedule;
use subxt::dynamic::Value;

/// Above the harness's weights_rate_limit (100) so a due resubmit lands.
const RESUBMIT: u64 = 101;

/// Makes the validator's resubmit due (wall clock and blocks) and the chain's rate limit pass.
async fn make_due(url: &str, chain: &Chain, env: &Env, uid: u16) {
    env.age_state(3600);
    let lu = last_update(chain, uid).await;
    let lsb = env.state().last_submit_block.unwrap_or(0);
    jump_to(url, chain, lu.max(lsb) + RESUBMIT).await;
}

async fn last_update(chain: &Chain, uid: u16) -> u64 {
    let hk = key(CHARLIE_SEED);
    let n = chain
        .neuron(NETUID, hk.public_key())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.uid, uid);
    n.last_update
}

/// The on-chain Weights row equals what the runtime makes of `weights` on these uids.
async fn assert_weights(chain: &Chain, uid: u16, vector: &[(String, u16)]) {
    let mg = chain.metagraph(NETUID).await.unwrap();
    let r = schedule::resolve(vector, &mg);
    let want: Vec<(u16, u16)> = r
        .uids
        .iter()
        .copied()
        .zip(max_upscale(&r.weights))
        .collect();
    let got = chain.weights(NETUID, uid).await.unwrap();
    assert_eq!(got, want, "Weights({NETUID}, {uid}) vs the verified vector");
}

/// A TCP proxy to the node that drops the first `refuse` connections (a chain that went
/// away and came back).
async fn flaky_proxy(upstream: &str, refuse: usize) -> String {
    let target = upstream.trim_start_matches("ws://").to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut seen = 0usize;
        while let Ok((mut inbound, _)) = listener.accept().await {
            seen += 1;
            if seen <= refuse {
                drop(inbound);
                continue;
            }
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut out) = tokio::net::TcpStream::connect(&target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    });
    format!("ws://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validator_on_real_subtensor() {
    let Some(url) = chain_url() else {
        eprintln!("SKIP validator_on_real_subtensor: ENGY_SUBTENSOR_URL is not set (start ../shared/chain/start-subtensor.sh PORT and export ENGY_SUBTENSOR_URL=ws://127.0.0.1:PORT)");
        return;
    };
    let chain = Chain::connect(&url).await.unwrap_or_else(|e| {
        panic!("ENGY_SUBTENSOR_URL={url} is set but the node is unreachable: {e}")
    });
    assert!(
        engy_validator::chain::unsupported_extensions(&chain.metadata()).is_empty(),
        "extensions: {:?}",
        engy_validator::chain::extension_names(&chain.metadata())
    );
    baseline(&chain).await;

    let (bob, charlie) = (key(BOB_SEED), key(CHARLIE_SEED));
    let uid = chain
        .neuron(NETUID, charlie.public_key())
        .await
        .unwrap()
        .expect("//Charlie registered on 53")
        .uid;
    let provider = ProviderDouble::start(bob.clone(), NETUID).await.unwrap();
    let ghost = stranger("ghost").ss58();
    let epoch = engy_validator::liveness::unix_now();
    let v1: Vec<(String, u16)> = vec![
        (key(DAVE_SEED).ss58(), 30000),
        (key(EVE_SEED).ss58(), 20000),
        (key(FERDIE_SEED).ss58(), 10000),
        (ghost.clone(), 5535),
    ];
    provider.publish(epoch, &v1);
    let mut env = Env::new(CHARLIE_SEED, &provider.url(), &bob.ss58(), &url);
    env.set("ENGY_SN53_RESUBMIT_BLOCKS", &RESUBMIT.to_string());
    jump_to(&url, &chain, last_update(&chain, uid).await + 101).await;

    // -- preflight passes on a healthy setup
    let out = env.run(&["check"]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(&format!("registered on netuid 53 at uid {uid}")),
        "{text}"
    );
    assert!(text.contains("commit-reveal disabled"), "{text}");
    assert!(!text.contains("FAIL"), "{text}");

    // -- a new epoch lands; Weights reads back the vector; the ghost is dropped with its share
    let read_before = head(&chain).await;
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(out.contains(&format!("epoch {epoch} verified (new epoch): set_weights of 3 uids from payload landed in block #")), "{out}");
    assert!(
        out.contains("dropped 1 unregistered hotkey(s) holding 8.4% of the weight"),
        "{out}"
    );
    let st = env.state();
    assert_eq!(st.last_applied, Some(epoch));
    // issue 13 item 7: the cadence anchors on the block read before submitting (the
    // protocol leaves 20 of its 120 blocks for inclusion lag), not on the inclusion block
    assert_eq!(st.last_submit_block, Some(read_before));
    assert_eq!(last_update(&chain, uid).await, read_before + 1);
    assert_eq!(st.cached_weights.as_deref(), Some(v1.as_slice()));
    assert_weights(&chain, uid, &v1).await;

    // -- issue 13 item 5: a resubmit the chain's rate limit must refuse (RESUBMIT_BLOCKS 1,
    //    LastUpdate 2 blocks ago) is not sent poll after poll: the validator waits until
    //    LastUpdate + WeightsSetRateLimit, says so, and nothing reaches the chain
    env.age_state(3600);
    new_block(&url, serde_json::json!({"count": 1})).await;
    let before = std::fs::read(env.state_file()).unwrap();
    let mut eager = Env {
        home: tempfile::tempdir().unwrap(),
        vars: env.vars.clone(),
    };
    eager.set("HOME", env.home.path().to_str().unwrap());
    eager.set("ENGY_SN53_RESUBMIT_BLOCKS", "1");
    let lu = last_update(&chain, uid).await;
    let h0 = head(&chain).await;
    for _ in 0..2 {
        let (ok, out) = eager.tick().await;
        assert!(ok);
        assert!(
            out.contains(&format!(
                "the chain accepts weights from uid {uid} again at block #{} (LastUpdate #{lu} + WeightsSetRateLimit 100)",
                lu + 100
            )),
            "{out}"
        );
        assert!(out.contains("nothing submitted"), "{out}");
        assert!(!out.contains("SettingWeightsTooFast"), "{out}");
        // no extrinsic: instant block building would have made a block for it
        assert_eq!(head(&chain).await, h0);
        assert_eq!(last_update(&chain, uid).await, lu);
        assert_eq!(std::fs::read(env.state_file()).unwrap(), before);
    }
    // ... and from that block on it submits (the next block is #LastUpdate + 100)
    jump_to(&url, &chain, lu + 99).await;
    let (ok, out) = eager.tick().await;
    assert!(ok && out.contains("landed in block #"), "{out}");
    assert_eq!(last_update(&chain, uid).await, lu + 100);

    // -- and the daemon with the real interval lands once the chain has moved past it
    make_due(&url, &chain, &env, uid).await;
    let read_before = head(&chain).await;
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("(resubmit, ") && out.contains("landed in block #"),
        "{out}"
    );
    let st2 = env.state();
    assert!(st2.last_submit_block > st.last_submit_block);
    assert_eq!(st2.last_submit_block, Some(read_before));

    // -- a provider outage resubmits the cached vector
    provider.set_fault(Fault::Status500);
    make_due(&url, &chain, &env, uid).await;
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains(&format!(
            "fetch failed: HTTP 500; using cached epoch {epoch}"
        )),
        "{out}"
    );
    assert!(out.contains("from cache landed in block #"), "{out}");
    assert_eq!(env.state().cached_digest, st.cached_digest);
    assert_weights(&chain, uid, &v1).await;

    // -- a new epoch with another vector
    provider.set_fault(Fault::None);
    let v2: Vec<(String, u16)> = vec![(key(DAVE_SEED).ss58(), 1), (key(EVE_SEED).ss58(), 3)];
    provider.publish(epoch + 1, &v2);
    make_due(&url, &chain, &env, uid).await;
    let (ok, out) = env.tick().await;
    assert!(
        ok && out.contains("(new epoch)") && out.contains("landed"),
        "{out}"
    );
    assert_weights(&chain, uid, &v2).await;

    // -- a replayed older epoch never reaches the chain
    provider.set_fault(Fault::Replay { epoch });
    make_due(&url, &chain, &env, uid).await;
    let (lu, st) = (last_update(&chain, uid).await, env.state());
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(out.contains("refused (replay guard)"), "{out}");
    assert_eq!(last_update(&chain, uid).await, lu);
    assert_eq!(env.state(), st);
    assert_weights(&chain, uid, &v2).await;
    provider.set_fault(Fault::None);

    // -- standby: nothing of the new epoch is registered → the cached vector is submitted,
    //    the anchors advance and the cache is kept
    let ghosts: Vec<(String, u16)> = vec![
        (stranger("ghost-a").ss58(), 9),
        (stranger("ghost-b").ss58(), 1),
    ];
    provider.publish(epoch + 2, &ghosts);
    make_due(&url, &chain, &env, uid).await;
    let before = env.state();
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("standby: submitting the cache vector"),
        "{out}"
    );
    assert!(
        out.contains("dropped 2 unregistered hotkey(s) holding 100.0% of the weight"),
        "{out}"
    );
    assert!(out.contains("from cache landed in block #"), "{out}");
    let after = env.state();
    assert_eq!(after.last_applied, Some(epoch + 2));
    assert!(after.last_submit_block > before.last_submit_block);
    assert_eq!(
        (after.cached_weights, after.cached_digest),
        (before.cached_weights, before.cached_digest)
    );
    assert_weights(&chain, uid, &v2).await;

    // -- standby without a cache: burn 65535 to the subnet owner hotkey (the master, //Bob)
    let fresh = Env::new(CHARLIE_SEED, &provider.url(), &bob.ss58(), &url);
    make_due(&url, &chain, &env, uid).await;
    let (ok, out) = fresh.tick().await;
    assert!(ok);
    assert!(
        out.contains("standby: submitting the burn vector") && out.contains("landed"),
        "{out}"
    );
    let owner_uid = chain
        .neuron(NETUID, bob.public_key())
        .await
        .unwrap()
        .unwrap()
        .uid;
    assert_eq!(
        chain.weights(NETUID, uid).await.unwrap(),
        vec![(owner_uid, 65535)]
    );
    assert_eq!(fresh.state().cached_weights, None);
    provider.publish(epoch + 3, &v2);
    make_due(&url, &chain, &env, uid).await;
    let (ok, out) = env.tick().await;
    assert!(ok && out.contains("landed"), "{out}");

    // -- a version-key mismatch is refused by name
    sudo(
        &chain,
        "sudo_set_weights_version_key",
        vec![Value::u128(NETUID.into()), Value::u128(7)],
    )
    .await;
    make_due(&url, &chain, &env, uid).await;
    let st = env.state();
    let (ok, out) = env.tick().await;
    assert!(ok && out.contains("IncorrectWeightVersionKey"), "{out}");
    assert_eq!(env.state(), st);
    let out = env.run(&["check"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("FAIL  weights_version_key 7"));
    sudo(
        &chain,
        "sudo_set_weights_version_key",
        vec![Value::u128(NETUID.into()), Value::u128(0)],
    )
    .await;

    // -- commit-reveal switched on: this runtime (spec 218) predates CRv4, so no commit can
    //    be accepted: said plainly with the cause, nothing submitted, FAIL in check
    sudo(
        &chain,
        "sudo_set_commit_reveal_weights_enabled",
        vec![Value::u128(NETUID.into()), Value::bool(true)],
    )
    .await;
    make_due(&url, &chain, &env, uid).await;
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("commit-reveal is ENABLED on netuid 53")
            && out.contains(
                "neither commit_timelocked_mechanism_weights nor commit_timelocked_weights"
            )
            && out.contains("nothing submitted"),
        "{out}"
    );
    let out = env.run(&["check"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout)
        .contains("FAIL  commit-reveal ENABLED on netuid 53 and a commit could not be accepted"));
    sudo(
        &chain,
        "sudo_set_commit_reveal_weights_enabled",
        vec![Value::u128(NETUID.into()), Value::bool(false)],
    )
    .await;

    // -- a transaction-pool rejection (never in a block) keeps its name: stake below the
    //    global WeightsMinStake is refused by subtensor's transaction extension
    sudo(
        &chain,
        "sudo_set_weights_min_stake",
        vec![Value::u128(1_000_000_000_000_000_000)],
    )
    .await;
    make_due(&url, &chain, &env, uid).await;
    let (st, lu) = (env.state(), last_update(&chain, uid).await);
    let (ok, out) = env.tick().await;
    assert!(ok);
    assert!(
        out.contains("pool rejected: Invalid Transaction Custom(3)"),
        "{out}"
    );
    assert_eq!((env.state(), last_update(&chain, uid).await), (st, lu));
    sudo(&chain, "sudo_set_weights_min_stake", vec![Value::u128(0)]).await;

    // -- a hotkey not registered on the netuid
    let stranger_seed = hex::encode(sha2_seed("stranger"));
    let lost = Env::new(&stranger_seed, &provider.url(), &bob.ss58(), &url);
    let (ok, out) = lost.tick().await;
    assert!(ok && out.contains("HotKeyNotRegisteredInSubNet"), "{out}");
    assert!(lost.state().last_applied.is_none());
    let out = lost.run(&["check"]).await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("is not registered on netuid 53"));

    // -- the chain going away mid-run is contained and retried on the next tick
    let proxy = flaky_proxy(&url, 2).await; // start-up connect + tick 1 are dropped
    let mut flaky = Env {
        home: tempfile::tempdir().unwrap(),
        vars: env.vars.clone(),
    };
    flaky.set("HOME", env.home.path().to_str().unwrap());
    flaky.set("ENGY_SN53_NETWORK", &proxy);
    make_due(&url, &chain, &env, uid).await;
    let out = flaky.run(&["run", "--ticks", "2"]).await;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success());
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| {
            l.contains("next poll in") || l.contains("next resubmit") || l.contains("exiting")
        })
        .collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].contains("chain unreachable"), "{text}");
    assert!(lines[1].contains("landed in block #"), "{text}");

    baseline(&chain).await;
}

fn sha2_seed(label: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(format!("engy-validator tests: {label}").as_bytes()).into()
}

#[allow(dead_code)]
fn _signer_is_object_safe(s: &dyn Sr25519Signer) -> [u8; 32] {
    s.public_key()
}
