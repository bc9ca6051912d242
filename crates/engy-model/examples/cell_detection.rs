//! The sampled cell audit's detection table (docs/AUDITOR.md "Cells"): for each serve cheat,
//! the fraction of its cells the f32 verifier fails (`p`), and the cells per request a
//! challenge needs for ≥ 99 % detection of a cheating request, `n = ceil(ln 0.01 / ln(1 − p))`;
//! and the honest bf16 serve's cells wrongly failed.
//!
//! Checkpoints: the generated devnet model (`gen_model` seed 5) and the `tests/vectors/arch`
//! tiny qwen3_moe and qwen3_5_moe. Each serve computes in bf16 as a GPU serve does; the int4- and
//! fp8-experts serves run a copy of the checkpoint whose routed experts are rounded
//! ([`write_expert_cheat`]), everything else exact.
//!
//! The last column is what TOPLOC says of the same serve (4 greedy commitments of 48 tokens,
//! audited by `audit_with` with `Recompute::Auto`): the cells-only cheats (top-k reduced,
//! expert swap, fabricated `y`) serve honest hidden states, so TOPLOC cannot see them.
//!
//! `cargo run --release -p engy-model --example cell_detection [HONEST_SEQS CHEAT_SEQS LEN]`
//! (defaults 36 8 96).
use std::path::{Path, PathBuf};

use engy_core::toploc::Params;
use engy_model::audit::{audit_with, commit_greedy, AuditParams, Recompute};
use engy_model::cells::{serve_cells, verify_cell, write_expert_cheat, CellPolicy, CellServe};
use engy_model::{gen_model, Compute, GenConfig, Model, Precision};

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (honest_seqs, cheat_seqs, len) = (arg(1, 36), arg(2, 8), arg(3, 96));
    let tmp = tempfile::tempdir()?;
    let devnet = tmp.path().join("devnet");
    gen_model(&devnet, 5, &GenConfig::default())?;
    let vectors = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch");
    let cases: [(&str, PathBuf); 3] = [
        ("devnet qwen3_moe", devnet),
        ("arch qwen3_moe", vectors.join("qwen3_moe")),
        ("arch qwen3_5_moe", vectors.join("qwen3_5_moe")),
    ];
    let policy = CellPolicy::default();
    println!(
        "| checkpoint | serve | cells failed | per-cell p | cells per request for ≥ 99 % | TOPLOC |"
    );
    println!("|---|---|---|---|---|---|");
    let mut honest_total = (0usize, 0usize);
    for (label, dir) in &cases {
        let verifier = Model::load(dir, Precision::Bf16)?;
        let vocab = verifier.config().vocab_size as u32;
        for serve in CellServe::ALL {
            let model = match serve.expert_quant() {
                Some(q) => {
                    let cheat = tmp.path().join(format!("{label}-{}", serve.label()));
                    write_expert_cheat(dir, &cheat, q)?;
                    Model::load_with(&cheat, Precision::Bf16, Compute::Bf16)?
                }
                None => verifier.with_compute(Compute::Bf16)?,
            };
            let count = if serve == CellServe::Honest {
                honest_seqs
            } else {
                cheat_seqs
            };
            let (mut n, mut failed) = (0usize, 0usize);
            let mut y_errs = Vec::new();
            for ids in sequences(vocab, count, len, 17) {
                for cell in serve_cells(&model, &ids, serve)? {
                    n += 1;
                    let check = verify_cell(&verifier, &cell, &policy)?;
                    if serve == CellServe::Honest && !check.pass() {
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
            eprintln!(
                "{label} {}: y error min {:.4} p1 {:.4} p10 {:.4} median {:.4} p99.9 {:.4} max {:.4}",
                serve.label(),
                q(0.0),
                q(0.01),
                q(0.1),
                q(0.5),
                q(0.999),
                q(1.0)
            );
            let need = if serve == CellServe::Honest {
                honest_total = (honest_total.0 + failed, honest_total.1 + n);
                "—".to_string()
            } else if p >= 1.0 {
                "1".to_string()
            } else if p <= 0.0 {
                "∞ (never caught)".to_string()
            } else {
                format!("{}", (0.01f64.ln() / (1.0 - p).ln()).ceil())
            };
            let toploc = match serve {
                CellServe::Honest | CellServe::Int4Experts | CellServe::Fp8Experts => {
                    let mut verdicts = std::collections::BTreeMap::<String, usize>::new();
                    for prompt in sequences(vocab, 4, 16, 99) {
                        let c = commit_greedy(&model, "root", &prompt, 48, &[], &Params::ENGY)?;
                        let r = audit_with(
                            &verifier,
                            "root",
                            &c,
                            &AuditParams::default(),
                            Recompute::Auto,
                        )?;
                        *verdicts.entry(r.verdict.label().to_string()).or_default() += 1;
                    }
                    verdicts
                        .iter()
                        .map(|(v, k)| format!("{k}/4 {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
                _ => "— (honest hidden states)".to_string(),
            };
            println!(
                "| {label} | {} | {failed}/{n} | {p:.3} | {need} | {toploc} |",
                serve.label()
            );
        }
    }
    println!(
        "\nhonest cells wrongly failed: {}/{} (bf16 serve, f32 verifier)",
        honest_total.0, honest_total.1
    );
    Ok(())
}
