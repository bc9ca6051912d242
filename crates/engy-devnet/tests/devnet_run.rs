//! The whole devnet (`engy-devnet run`) as a test: honest proofs pass, int4 cheats are caught.
//! It drives the real `engy-miner` and (the Qwen3-MoE run) `engy-audit serve` binaries, which
//! this package cannot build, so it is opt-in: `cargo build -p engy-miner -p engy-audit &&
//! cargo test -p engy-devnet --test devnet_run -- --ignored` (or set ENGY_MINER_BIN,
//! ENGY_AUDIT_BIN).
use std::time::Duration;

use engy_devnet::audit_service::{locate_audit, render_service_table};
use engy_devnet::devnet::{locate_miner, render_table, run, DevnetOptions, SERVICE_HOTKEYS};
use engy_model::audit::AuditParams;
use engy_model::{Compute, GenArch};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the engy-miner binary: cargo build -p engy-miner, then run with --ignored"]
async fn honest_passes_and_int4_is_caught_end_to_end() {
    end_to_end(GenArch::Qwen3Moe, true).await;
}

/// The same run on a generated Qwen3.5/3.6-MoE checkpoint (Gated DeltaNet + gated attention,
/// shared expert): the serve's candle model, the miner's proofs and the auditor all go through
/// the architecture layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the engy-miner binary: cargo build -p engy-miner, then run with --ignored"]
async fn qwen3_5_moe_honest_passes_and_int4_is_caught_end_to_end() {
    end_to_end(GenArch::Qwen3_5Moe, false).await;
}

/// The run; `with_service`: the honest and int4 miners' requests are also reported to a real
/// `engy-audit serve` (SQLite), and its per-miner table must show the honest miner audited on
/// every request with no cheat and §8's gate holding, the int4 miner caught with the gate
/// firing.
async fn end_to_end(arch: GenArch, with_service: bool) {
    let miner = locate_miner(std::env::var_os("ENGY_MINER_BIN").map(Into::into)).unwrap();
    let audit_bin = with_service
        .then(|| locate_audit(std::env::var_os("ENGY_AUDIT_BIN").map(Into::into)).unwrap());
    let out = run(&DevnetOptions {
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
        audit_bin,
    })
    .await
    .unwrap();
    let rows = out.rows;
    eprintln!("{}", render_table(&rows));
    assert_eq!(rows.len(), 20);
    assert!(rows.iter().all(|r| r.ok), "{}", render_table(&rows));
    // The long requests took more than one GEN_CHUNK.
    assert!(rows.iter().any(|r| r.completion_tokens > 64));
    if !with_service {
        assert!(out.service.is_empty());
        return;
    }
    let table = render_service_table(&out.service);
    eprintln!("{table}");
    assert_eq!(out.service.len(), 2, "{table}");
    let [honest, cheater] = [&out.service[0], &out.service[1]];
    assert_eq!(
        (honest.miner.as_str(), honest.hotkey.as_str()),
        SERVICE_HOTKEYS[0]
    );
    assert_eq!(
        (cheater.miner.as_str(), cheater.hotkey.as_str()),
        SERVICE_HOTKEYS[1]
    );
    // Every request of each miner was reported (rate 1) and got a verdict.
    let per_phase = |p: &str| rows.iter().filter(|r| r.phase == p).count() as u64;
    assert_eq!(honest.reported, per_phase("honest"), "{table}");
    assert_eq!(cheater.reported, per_phase("int4 cheat"), "{table}");
    assert_eq!(honest.audited, honest.reported, "{table}");
    assert_eq!(cheater.audited, cheater.reported, "{table}");
    // The honest miner: every verdict a pass, never a cheat, the gate holds.
    assert_eq!(
        (
            honest.pass,
            honest.cheat,
            honest.unanswered,
            honest.unproven
        ),
        (honest.reported, 0, 0, 0),
        "{table}"
    );
    assert!(!honest.gate_fires && honest.cheat_rate == 0.0, "{table}");
    // The int4 miner: caught on every request, the gate fires with certainty.
    assert_eq!(cheater.cheat, cheater.reported, "{table}");
    assert!(cheater.gate_fires && cheater.wilson95[0] > 0.01, "{table}");
}
