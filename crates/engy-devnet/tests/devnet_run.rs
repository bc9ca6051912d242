//! The whole devnet (`engy-devnet run`) as a test: honest proofs pass, int4 cheats are caught.
//! It drives the real `engy-miner` binary, which this package cannot build, so it is opt-in:
//! `cargo build -p engy-miner && cargo test -p engy-devnet --test devnet_run -- --ignored`
//! (or set ENGY_MINER_BIN).
use std::time::Duration;

use engy_devnet::devnet::{locate_miner, render_table, run, DevnetOptions};
use engy_model::audit::AuditParams;
use engy_model::{Compute, GenArch};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the engy-miner binary: cargo build -p engy-miner, then run with --ignored"]
async fn honest_passes_and_int4_is_caught_end_to_end() {
    end_to_end(GenArch::Qwen3Moe).await;
}

/// The same run on a generated Qwen3.5/3.6-MoE checkpoint (Gated DeltaNet + gated attention,
/// shared expert): the serve's candle model, the miner's proofs and the auditor all go through
/// the architecture layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the engy-miner binary: cargo build -p engy-miner, then run with --ignored"]
async fn qwen3_5_moe_honest_passes_and_int4_is_caught_end_to_end() {
    end_to_end(GenArch::Qwen3_5Moe).await;
}

async fn end_to_end(arch: GenArch) {
    let miner = locate_miner(std::env::var_os("ENGY_MINER_BIN").map(Into::into)).unwrap();
    let rows = run(&DevnetOptions {
        seed: 53,
        arch,
        model_dir: None,
        miner_bin: miner,
        gen_chunk: 64,
        int4_group: 32,
        serve_compute: Compute::Bf16,
        audit: AuditParams::default(),
        request_timeout: Duration::from_secs(120),
        save_commitments: None,
    })
    .await
    .unwrap();
    eprintln!("{}", render_table(&rows));
    assert_eq!(rows.len(), 20);
    assert!(rows.iter().all(|r| r.ok), "{}", render_table(&rows));
    // The long requests took more than one GEN_CHUNK.
    assert!(rows.iter().any(|r| r.completion_tokens > 64));
}
