//! What the whole-process benches (`serve`, `latency`) and `ingest_bench` share: their
//! command-line numbers, and the two doubles the real miner runs between.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use engy_devnet::gateway::{GatewayConfig, GatewayDouble};
use engy_devnet::sglang::synthetic::{
    write_checkpoint, CheckpointSpec, SyntheticBackend, SyntheticConfig,
};
use engy_devnet::sglang::{SglangConfig, SglangDouble};

/// The number after `name` on the command line (`--tokens 4096`), if any.
pub fn arg(name: &str) -> Option<usize> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

/// A synthetic checkpoint (`hidden` wide, vocabulary 500) in a temp dir, the sglang double
/// serving it in engy's trimmed shape (§8), and the gateway double with `workers` workers.
pub struct Doubles {
    /// Holds the checkpoint (and anything else the bench puts there) until dropped.
    pub dir: tempfile::TempDir,
    pub ckpt: PathBuf,
    pub sglang: SglangDouble,
    pub gw: GatewayDouble,
}

impl Doubles {
    pub async fn start(hidden: usize, workers: usize) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let ckpt = dir.path().join("ckpt");
        write_checkpoint(
            &ckpt,
            &CheckpointSpec {
                hidden_size: hidden,
                vocab_size: 500,
                ..Default::default()
            },
        )?;
        let backend = SyntheticBackend::from_checkpoint(&ckpt, SyntheticConfig::default())?;
        let sglang = SglangDouble::start(
            Arc::new(backend),
            SglangConfig {
                engy_trimmed: true,
                ..SglangConfig::default()
            },
        )
        .await?;
        let gw = GatewayDouble::start(GatewayConfig {
            workers,
            meta: true,
        })
        .await?;
        Ok(Self {
            dir,
            ckpt,
            sglang,
            gw,
        })
    }
}
