//! Several commitments audited in one pass over streamed weights
//! ([`engy_model::audit::audit_many`], `engy-audit audit --batch N`) get exactly the reports
//! they get one by one: the same verdicts, scores, batches, recomputes and routing records.
//! Only the order of the work changes (each decoder layer for every sequence before the next
//! layer, its weights read and decoded once: `Weights::hold`).
//!
//! Every architecture, honest serves and cheats mixed (so that some commitments run the rest
//! of the recompute plan alone after the batched first recompute), plus commitments that are
//! unproven before any recompute (another `model_root`, a null commitment), in one batch.
//! On `$ENGY_TEST_DEVICE` (scripts/gpu-check.sh runs it on a GPU, where the batched pass also
//! stacks and holds each layer's routed experts).
mod common;

use std::path::Path;

use engy_model::audit::{
    audit_many, audit_with, AuditParams, AuditReport, Recompute, Verdict, W8A8_NOISE,
};
use engy_model::{LoadOptions, Model, Residency};

/// Up to `per_variant` commitments of each of `variants` from the audit oracle's `case`.
fn commitments(case: &Path, variants: &[&str], per_variant: usize) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for v in variants {
        let mut files: Vec<_> = common::commitment_files(case)
            .into_iter()
            .filter(|p| {
                p.file_stem()
                    .and_then(|s| s.to_str())
                    .is_some_and(|s| s.rsplit_once('_').is_some_and(|(name, _)| name == *v))
            })
            .collect();
        files.truncate(per_variant);
        out.extend(files.iter().map(|p| common::read_commitment(p).2));
    }
    out
}

fn open_streamed(dir: &Path) -> (Model, String) {
    let opts = LoadOptions {
        residency: Residency::Streaming,
        device: common::test_device(),
        ..LoadOptions::default()
    };
    let model = Model::open(dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let root = engy_core::identity::model_root(dir).unwrap();
    (model, root)
}

#[test]
fn a_batched_pass_gives_every_commitment_its_own_report() {
    let oracle = common::vectors_or("ENGY_AUDIT_ORACLE_DIR", "audit-oracle");
    let params = AuditParams::default();
    for case in [
        "qwen3_5_moe",
        "qwen3_5_moe_fp8",
        "qwen3_moe",
        "glm_moe_dsa",
        "glm_moe_dsa_fp8",
    ] {
        let dir = oracle.join(case);
        let ckpt = common::vectors_dir().join(case);
        if !dir.is_dir() || !ckpt.join("config.json").is_file() {
            panic!("{case}: the audit oracle or its checkpoint is missing");
        }
        let (model, root) = open_streamed(&ckpt);
        let mut batch = commitments(&dir, &["honest_bf16", "int4_g32", "fp8_tensor"], 2);
        assert!(batch.len() >= 4, "{case}: too few commitments");
        // Unproven before any recompute: in the middle and at the end of the batch.
        batch.insert(2, serde_json::Value::Null);
        let mut foreign = batch[0].clone();
        if let Some(obj) = foreign.as_object_mut() {
            obj.insert("model_root".into(), serde_json::json!("00".repeat(32)));
        }
        batch.push(foreign);

        let alone: Vec<_> = batch
            .iter()
            .map(|c| audit_with(&model, &root, c, &params, Recompute::Auto).unwrap())
            .collect();
        let together = audit_many(&model, &root, &batch, &params, Recompute::Auto).unwrap();
        assert_eq!(
            together.len(),
            batch.len(),
            "{case}: one report per commitment"
        );
        for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, b, "{case}: commitment {i} differs in a batched pass");
        }
        let verdicts: Vec<&str> = together.iter().map(|r| r.verdict.label()).collect();
        // A commitment that failed every recompute: a cheat, or on a block-FP8 checkpoint
        // W8A8 serving noise (docs/PROTOCOL.md §5.1), which the 4-bit swaps there are.
        let failed_all = |r: &AuditReport| match &r.verdict {
            Verdict::Cheat => true,
            Verdict::Unproven { reason } => reason.starts_with(W8A8_NOISE),
            Verdict::Pass => false,
        };
        assert!(
            together.iter().any(|r| r.verdict == Verdict::Pass)
                && together.iter().any(failed_all)
                && together
                    .iter()
                    .any(|r| matches!(&r.verdict, Verdict::Unproven { reason } if !reason.starts_with(W8A8_NOISE))),
            "{case}: the batch should mix verdicts, got {verdicts:?}"
        );
        eprintln!("{case}: {} commitments, {verdicts:?}", batch.len());
    }
}
