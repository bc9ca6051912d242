//! Helpers of the tests on the real subtensor runtime (chopsticks, `../shared/chain/`):
//! the chain URL from `ENGY_SUBTENSOR_URL`, chopsticks dev RPCs, sudo knobs, block jumps.

use engy_validator::chain::Chain;
use engy_validator::daemon::HotkeySigner;
use subxt::dynamic::Value;

use super::{key, ALICE_SEED};

/// The netuid the harness seeds.
pub const NETUID: u16 = 53;

/// `ENGY_SUBTENSOR_URL`, when chain tests are requested.
pub fn chain_url() -> Option<String> {
    std::env::var("ENGY_SUBTENSOR_URL")
        .ok()
        .filter(|s| !s.is_empty())
}

/// The HTTP form of a ws:// node URL (chopsticks serves both on one port).
pub fn http_url(ws: &str) -> String {
    ws.replacen("ws://", "http://", 1)
        .replacen("wss://", "https://", 1)
}

/// One JSON-RPC call over HTTP; panics on an RPC error.
pub async fn rpc(url: &str, method: &str, params: serde_json::Value) -> serde_json::Value {
    let r: serde_json::Value = reqwest::Client::new()
        .post(http_url(url))
        .json(&serde_json::json!({"id":1,"jsonrpc":"2.0","method":method,"params":params}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(r.get("error").is_none(), "{method}: {r}");
    r["result"].clone()
}

/// chopsticks `dev_newBlock` with `params` (e.g. `{"count":1}` or `{"unsafeBlockHeight":H}`).
pub async fn new_block(url: &str, params: serde_json::Value) {
    rpc(url, "dev_newBlock", serde_json::json!([params])).await;
}

/// A sudo `AdminUtils` call signed by //Alice (the harness's sudo key).
pub async fn sudo(chain: &Chain, call: &str, args: Vec<Value>) {
    let inner = subxt::dynamic::tx("AdminUtils", call, args).into_value();
    let tx = subxt::dynamic::tx("Sudo", "sudo", vec![inner]);
    let alice = key(ALICE_SEED);
    chain
        .submit(&tx, &HotkeySigner(&alice))
        .await
        .unwrap_or_else(|e| panic!("sudo {call}: {e}"));
}

/// A sudo knob of netuid 53 set to `value`.
pub async fn sudo_netuid(chain: &Chain, call: &str, value: Value) {
    sudo(chain, call, vec![Value::u128(NETUID.into()), value]).await;
}

/// The knobs the scenarios rely on (rate limit 100, commit-reveal off, version key 0),
/// checked by reading them back.
pub async fn baseline(chain: &Chain) {
    sudo_netuid(chain, "sudo_set_weights_set_rate_limit", Value::u128(100)).await;
    sudo_netuid(
        chain,
        "sudo_set_commit_reveal_weights_enabled",
        Value::bool(false),
    )
    .await;
    sudo_netuid(chain, "sudo_set_weights_version_key", Value::u128(0)).await;
    let h = chain.hyperparams(NETUID).await.unwrap();
    assert_eq!(
        (
            h.weights_rate_limit,
            h.commit_reveal_weights_enabled,
            h.weights_version_key
        ),
        (100, false, 0)
    );
}

/// The chain's head block number.
pub async fn head(chain: &Chain) -> u64 {
    chain.block_number().await.unwrap()
}

/// Jumps the chain so that the head is at least `height`.
pub async fn jump_to(url: &str, chain: &Chain, height: u64) {
    if head(chain).await < height {
        new_block(url, serde_json::json!({ "unsafeBlockHeight": height })).await;
    }
    assert!(head(chain).await >= height);
}

/// `(uid, LastUpdate)` of `hotkey` on netuid 53 (it must be registered).
pub async fn neuron_of(chain: &Chain, hotkey: &engy_core::keys::Hotkey) -> (u16, u64) {
    let n = chain
        .neuron(NETUID, hotkey.public_key())
        .await
        .unwrap()
        .expect("hotkey registered on netuid 53");
    (n.uid, n.last_update)
}
