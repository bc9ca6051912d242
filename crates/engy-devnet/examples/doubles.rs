//! Runs the protocol doubles standalone on 127.0.0.1 for hands-on trials of the daemons:
//! a provider double (epoch payloads signed by a master key), a gateway double and an
//! sglang serve double over a generated synthetic checkpoint.
//!
//! ```sh
//! cargo run -p engy-devnet --example doubles -- <work dir> [<ss58>=<weight> ...]
//! ```
//!
//! Prints one `KEY=value` line per fact (URLs, master SS58, checkpoint folder), publishes
//! epoch 1 with the given weights (none: an empty vector), then serves until Ctrl-C. With
//! `DOUBLES_SUBMIT=1` it routes one chat request to the first miner leg that says HELLO and
//! prints `RESPONSE <frame>`.
//! The master key is a fixed test key (never use it for anything real).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use engy_core::keys::Hotkey;
use engy_devnet::gateway::{GatewayConfig, GatewayDouble};
use engy_devnet::provider::ProviderDouble;
use engy_devnet::sglang::synthetic::{
    write_checkpoint, CheckpointSpec, SyntheticBackend, SyntheticConfig,
};
use engy_devnet::sglang::{SglangConfig, SglangDouble};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(
        args.next()
            .context("usage: doubles <work dir> [<ss58>=<weight> ...]")?,
    );
    let mut weights = Vec::new();
    for a in args {
        let (hk, w) = a
            .split_once('=')
            .with_context(|| format!("{a:?}: expected <ss58>=<weight>"))?;
        weights.push((hk.to_owned(), w.parse::<u16>().context("weight")?));
    }
    let master = Hotkey::from_mini_secret(&[7u8; 32]).context("master key")?;
    let provider = ProviderDouble::start(master, 53).await?;
    provider.publish(1, &weights);

    let ckpt = dir.join("ckpt");
    write_checkpoint(
        &ckpt,
        &CheckpointSpec {
            hidden_size: 64,
            vocab_size: 500,
            ..Default::default()
        },
    )?;
    let backend = SyntheticBackend::from_checkpoint(&ckpt, SyntheticConfig::default())?;
    let sglang = SglangDouble::start(Arc::new(backend), SglangConfig::default()).await?;
    let gw = GatewayDouble::start(GatewayConfig::default()).await?;

    println!("ENGY_SN53_API={}", provider.url());
    println!("ENGY_SN53_MASTER_HOTKEY={}", provider.master_ss58());
    println!("SERVE_URL={}", sglang.url());
    println!("GW={}", gw.url());
    println!("CHECKPOINT={}", ckpt.display());
    if std::env::var_os("DOUBLES_SUBMIT").is_some() {
        // Route one chat request to the first miner leg and print what comes back.
        let t = std::time::Duration::from_secs(600);
        if let Some(legs) = gw.wait_legs(1, t).await {
            if let Some(leg) = legs.first() {
                gw.admit(leg.id);
            }
            let req = serde_json::json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8});
            if let Some((_, corr)) = gw.submit(req, false) {
                match gw.wait_response(&corr, t).await {
                    Some(r) => println!("RESPONSE {r}"),
                    None => println!("RESPONSE none within {t:?}"),
                }
            }
        }
    }
    tokio::signal::ctrl_c().await?;
    Ok(())
}
