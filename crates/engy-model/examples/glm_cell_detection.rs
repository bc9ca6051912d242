//! The sampled cell audit's detection rows for GLM-5 (`glm_moe_dsa`; issue 41 item 2), on the
//! arch oracle's tiny checkpoints (`tests/vectors/arch/glm_moe_dsa{,_fp8,_nvfp4}`: the same
//! weights, the `_fp8` case block-FP8 everywhere, the `_nvfp4` case NVFP4 routed experts only).
//!
//! Each serve computes in bf16 as a GPU serve does and builds its cells as an honest serve
//! does ([`CellServe::Honest`]) over its own weights; each cell is checked alone by
//! [`verify_cell`] against the checkpoint the serve claims, with the default [`CellPolicy`]
//! (its `y_rel_w8a8`, 0.08, for a W8A8 verifier, as `audit_bundle_with_recompute` judges cells
//! bound to the W8A8 recompute):
//!
//! | serve | weights served | claims | verifier |
//! |---|---|---|---|
//! | honest bf16 | `glm_moe_dsa` | `glm_moe_dsa` | f32 |
//! | honest FP8 (W8A8) | `glm_moe_dsa_fp8`, activations per-token-group FP8 as sglang's W8A8 | `glm_moe_dsa_fp8` | f32, W8A8 |
//! | honest FP8 (W8A8), W8A16 verifier | as above | `glm_moe_dsa_fp8` | f32, activations unquantised |
//! | int4 experts | routed experts rounded to int4 (group 32) | `glm_moe_dsa` | f32 |
//! | FP8 experts | routed experts rounded to block FP8 | `glm_moe_dsa` | f32 |
//! | NVFP4 experts | `glm_moe_dsa_nvfp4` (routed experts NVFP4) | `glm_moe_dsa` | f32 |
//!
//! Prints, per serve, the cells failed, the per-cell catch rate `p`, the cells a request needs
//! for ≥ 99 % detection `n = ceil(ln 0.01 / ln(1 − p))`, and the `y` error quantiles; the
//! honest rows are the false-flag rate.
//!
//! `cargo run --release -p engy-model --example glm_cell_detection [HONEST_SEQS CHEAT_SEQS LEN]`
//! (defaults 24 8 48).
use std::path::Path;

use engy_model::arch::{Fp8Activations, LoadOptions};
use engy_model::cells::ExpertQuant;
use engy_model::cells::{serve_cells, verify_cell, write_expert_cheat, CellPolicy, CellServe};
use engy_model::{Compute, Model};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

/// `count` sequences of `len` token ids below `vocab`, from a fixed LCG.
fn sequences(vocab: u32, count: usize, len: usize, salt: u64) -> Vec<Vec<u32>> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    (0..count)
        .map(|_| {
            (0..len)
                .map(|_| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((s >> 33) % u64::from(vocab)) as u32
                })
                .collect()
        })
        .collect()
}

fn open(dir: &Path, compute: Compute, w8a8: bool) -> Result<Model, Box<dyn std::error::Error>> {
    let opts = LoadOptions {
        compute,
        fp8_activations: if w8a8 {
            Fp8Activations::PerTokenGroup
        } else {
            Fp8Activations::Unquantised
        },
        ..LoadOptions::default()
    };
    Ok(Model::open(dir, &opts)?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (honest_seqs, cheat_seqs, len) = (arg(1, 24), arg(2, 8), arg(3, 48));
    let tmp = tempfile::tempdir()?;
    let arch = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch");
    let bf16 = arch.join("glm_moe_dsa");
    let fp8 = arch.join("glm_moe_dsa_fp8");
    let nvfp4 = arch.join("glm_moe_dsa_nvfp4");
    let int4_dir = tmp.path().join("int4-experts");
    write_expert_cheat(&bf16, &int4_dir, ExpertQuant::Int4 { group_size: 32 })?;
    let fp8_experts_dir = tmp.path().join("fp8-experts");
    write_expert_cheat(&bf16, &fp8_experts_dir, ExpertQuant::Fp8)?;

    // (label, honest, served, serve W8A8, claimed, verifier W8A8)
    let cases: [(&str, bool, &Path, bool, &Path, bool); 6] = [
        ("honest bf16", true, &bf16, false, &bf16, false),
        ("honest FP8 (W8A8)", true, &fp8, true, &fp8, true),
        (
            "honest FP8 (W8A8), W8A16 verifier",
            true,
            &fp8,
            true,
            &fp8,
            false,
        ),
        ("int4 experts", false, &int4_dir, false, &bf16, false),
        ("FP8 experts", false, &fp8_experts_dir, false, &bf16, false),
        ("NVFP4 experts", false, &nvfp4, false, &bf16, false),
    ];
    let policy = CellPolicy::default();
    println!("| checkpoint | serve | cells failed | per-cell p | cells per request for ≥ 99 % | `y` error median / p99.9 / max |");
    println!("|---|---|---|---|---|---|");
    let mut honest_total = (0usize, 0usize);
    for (label, honest, served, serve_w8a8, claimed, verify_w8a8) in cases {
        let serve = open(served, Compute::Bf16, serve_w8a8)?;
        let verifier = open(claimed, Compute::F32, verify_w8a8)?;
        let vocab = verifier.config().vocab_size as u32;
        // As audit_bundle_with_recompute judges cells bound to the W8A8 recompute.
        let cell_policy = if verify_w8a8 {
            CellPolicy {
                y_rel: policy.y_rel_w8a8,
                ..policy
            }
        } else {
            policy
        };
        let count = if honest { honest_seqs } else { cheat_seqs };
        let (mut n, mut failed) = (0usize, 0usize);
        let mut y_errs = Vec::new();
        for ids in sequences(vocab, count, len, 17) {
            for cell in serve_cells(&serve, &ids, CellServe::Honest)? {
                n += 1;
                let check = verify_cell(&verifier, &cell, &cell_policy)?;
                if honest && !check.pass() {
                    eprintln!("{label}: honest cell failed: {check:?}");
                }
                y_errs.push(check.y_err);
                failed += usize::from(!check.pass());
            }
        }
        let p = failed as f64 / n.max(1) as f64;
        y_errs.sort_by(f32::total_cmp);
        let q = |f: f64| {
            y_errs
                .get(((y_errs.len() as f64 - 1.0) * f) as usize)
                .copied()
                .unwrap_or(f32::NAN)
        };
        let need = if honest {
            if serve_w8a8 == verify_w8a8 {
                // The matched verifiers only: the W8A16 row shows what an unmatched one does.
                honest_total = (honest_total.0 + failed, honest_total.1 + n);
            }
            "—".to_string()
        } else if p >= 1.0 {
            "1".to_string()
        } else if p <= 0.0 {
            "∞ (never caught)".to_string()
        } else {
            format!("{}", (0.01f64.ln() / (1.0 - p).ln()).ceil())
        };
        println!(
            "| arch glm_moe_dsa | {label} | {failed}/{n} | {p:.3} | {need} | {:.4} / {:.4} / {:.4} |",
            q(0.5),
            q(0.999),
            q(1.0)
        );
    }
    println!(
        "\nhonest cells wrongly failed: {}/{} (bf16 and W8A8 serves, f32 verifiers of their numerics)",
        honest_total.0, honest_total.1
    );
    Ok(())
}
