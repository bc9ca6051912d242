//! The cell statistics on a block-FP8 checkpoint (issue 39, item 3): sglang serves it W8A8
//! (every FP8 product's input rows quantised per token and 128-group to e4m3), which moves `y`
//! by a few percent against a W8A16 recompute. The cells are bound to the recompute that
//! explains them (W8A8 under `auto` on a block-FP8 checkpoint) and checked in its numerics, so
//! an honest W8A8 serve's `y` statistics can be judged: honest W8A8 and W8A16 serves must pass,
//! a 1.02-scaled `y` must be caught. The checkpoint is `tests/vectors/audit-oracle-w8a8`'s
//! Qwen3.5-MoE (every projection and expert block FP8). The printed rows are bench/RESULTS.md
//! "Cells: W8A8".
mod common;

use std::path::Path;

use engy_core::cells::Cell;
use engy_core::commit::{self, CommitOptions, Progress, SpecFile};
use engy_model::arch::Fp8Activations;
use engy_model::cells::{serve_cells, BundleVerdict, CellServe, CommittedWeights, Openings};
use engy_model::{Compute, Model, Numerics, Precision};

use common::cells::audit;

const SEEDS: u8 = 3;

fn random_ids(vocab: u64, r: u64, len: usize) -> Vec<u32> {
    let mut state = 0x5851_f42d_4c95_7f2du64 ^ ((r + 1) * 15_485_863);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab) as u32
        })
        .collect()
}

#[test]
fn honest_w8a8_cells_pass_the_y_statistics_and_a_scaled_y_is_caught() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/vectors/audit-oracle-w8a8/qwen3_5_moe_w8a8");
    let verifier = Model::load(&dir, Precision::Bf16).unwrap();
    let c =
        commit::commit_checkpoint(&dir, &CommitOptions::default(), &Progress::default()).unwrap();
    let spec = SpecFile::from_commitment(&c, 0.0);
    let w = CommittedWeights::open(&dir, c.model_root, Openings::Spec(Box::new(spec))).unwrap();
    let w8a16 = verifier.with_compute(Compute::Bf16).unwrap();
    let w8a8 = verifier
        .with_numerics(Numerics {
            compute: Compute::Bf16,
            fp8_activations: Fp8Activations::PerTokenGroup,
            ..verifier.numerics()
        })
        .unwrap();
    // The same quantised products with f32 activations: an honest serve whose rounding is not
    // the recompute's (a GPU's FP8 kernels accumulate in another order).
    let w8a8_f32 = verifier
        .with_numerics(Numerics {
            compute: Compute::F32,
            fp8_activations: Fp8Activations::PerTokenGroup,
            ..verifier.numerics()
        })
        .unwrap();
    let vocab = verifier.config().vocab_size as u64;
    let mut lines = Vec::new();
    let (mut scaled_caught, mut audits, mut honest_flagged) = (0usize, 0usize, 0usize);
    for (label, serve) in [
        ("honest W8A8", &w8a8),
        ("honest W8A8 in f32", &w8a8_f32),
        ("honest W8A16", &w8a16),
    ] {
        let (mut flagged, mut n) = (0usize, 0usize);
        let (mut med_max, mut bias_max, mut part_max, mut judged) = (0f32, 0f32, 0f32, 0usize);
        for r in 0..6u64 {
            let ids = random_ids(vocab, r, 80);
            let cells = serve_cells(serve, &ids, CellServe::Honest).unwrap();
            for s in 0..SEEDS {
                let seed = [(r as u8).wrapping_mul(16).wrapping_add(s + 1); 32];
                let rep = audit(&verifier, &w, serve, &ids, &cells, seed);
                n += 1;
                if r == 0 && s == 0 {
                    println!(
                        "{label}: bound to {:?}",
                        rep.recompute.as_ref().map(|b| b.numerics)
                    );
                }
                flagged += usize::from(rep.verdict == BundleVerdict::Cheat);
                judged += usize::from(rep.stats.y_judged);
                med_max = med_max.max(rep.stats.y_err_median);
                bias_max = bias_max.max(rep.stats.y_bias_mean.abs());
                for p in [rep.stats.y_bias_routed_mean, rep.stats.y_bias_shared_mean]
                    .into_iter()
                    .flatten()
                {
                    part_max = part_max.max(p.abs());
                }
                if rep.verdict == BundleVerdict::Cheat && r == 0 {
                    println!(
                        "{label} flagged: {:?} {:?}",
                        rep.stats.failures,
                        rep.cells
                            .iter()
                            .flat_map(|c| c.failures.clone())
                            .take(2)
                            .collect::<Vec<_>>()
                    );
                }
                if label == "honest W8A8" {
                    let scaled: Vec<Cell> = cells
                        .iter()
                        .map(|c| {
                            Cell::new(
                                c.position(),
                                c.layer(),
                                c.x().to_vec(),
                                c.router_logits().clone(),
                                c.expert_ids().to_vec(),
                                c.y()
                                    .iter()
                                    .map(|v| half::bf16::from_f32(v.to_f32() * 1.02))
                                    .collect(),
                            )
                            .unwrap()
                        })
                        .collect();
                    let rep = audit(&verifier, &w, serve, &ids, &scaled, seed);
                    audits += 1;
                    scaled_caught += usize::from(rep.verdict == BundleVerdict::Cheat);
                }
            }
        }
        lines.push(format!(
            "{label}: flagged {flagged}/{n} audits (y judged in {judged}); largest y median \
             {med_max:.4}, largest |mean y bias| {bias_max:.4}, largest |mean part bias| \
             {part_max:.4}"
        ));
        if label != "honest W8A8 in f32" {
            honest_flagged += flagged;
        }
    }
    lines.push(format!(
        "W8A8 serve, y scaled by 1.02: caught {scaled_caught}/{audits} audits"
    ));
    for l in &lines {
        println!("{l}");
    }
    assert_eq!(honest_flagged, 0, "{lines:?}");
    assert_eq!(scaled_caught, audits, "{lines:?}");
}
