//! A perturbation hidden in one part of the block output (issue 39, item 4): a serve that
//! scales only its shared expert (or only its routed experts) by 1.05 moves `y` by 5% of that
//! part, which is a small share of the whole block output when the other part dominates; the
//! whole-`y` statistics ([`engy_model::cells::stats`]) judge it against the whole output's
//! norm. Judged per part (the error split along the auditor's own routed and shared outputs,
//! each normalised by its own norm) the scaling is the part's 5%.
//!
//! The cheating serve is a checkpoint copy whose shared (or routed) `down_proj` weights are
//! scaled, served honestly otherwise; the auditor holds the committed checkpoint. Honest bf16
//! and f32 serves are audited beside it over the same requests and challenge seeds.
mod common;

use std::path::Path;

use engy_model::cells::{serve_cells, BundleVerdict, CellServe};
use engy_model::{Compute, Model, Precision};
use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use common::cells::{audit, committed};

/// Challenge seeds drawn per request.
const SEEDS: u8 = 3;

/// Copies the checkpoint `src` to `dst` with every bf16 tensor whose name `pick` accepts
/// multiplied by `factor` (rounded back to bf16); returns how many tensors were scaled.
fn scaled_copy(src: &Path, dst: &Path, pick: impl Fn(&str) -> bool, factor: f32) -> usize {
    std::fs::create_dir_all(dst).unwrap();
    let mut scaled = 0;
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let out = dst.join(path.file_name().unwrap());
        if path.extension().is_none_or(|x| x != "safetensors") {
            std::fs::copy(&path, &out).unwrap();
            continue;
        }
        let buf = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&buf).unwrap();
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (name, view) in st.iter() {
            let mut data = view.data().to_vec();
            if view.dtype() == Dtype::BF16 && pick(name) {
                scaled += 1;
                for c in data.chunks_exact_mut(2) {
                    let v = bf16::from_le_bytes([c[0], c[1]]).to_f32() * factor;
                    c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            }
            owned.push((name.to_string(), view.dtype(), view.shape().to_vec(), data));
        }
        let views: Vec<(String, TensorView<'_>)> = owned
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(&out, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    }
    scaled
}

fn random_ids(vocab: u64, r: u64, len: usize) -> Vec<u32> {
    let mut state = 0x2545_f491_4f6c_dd1du64 ^ ((r + 1) * 104_729);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab) as u32
        })
        .collect()
}

fn is_shared_down(name: &str) -> bool {
    name.contains(".mlp.shared_expert") && name.contains("down_proj")
}

fn is_routed_down(name: &str) -> bool {
    name.contains(".mlp.experts.") && name.contains("down_proj")
}

#[test]
fn a_scaled_shared_or_routed_part_is_caught_and_honest_serves_pass() {
    let vectors = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch");
    let mut failures = Vec::new();
    for arch in ["qwen3_5_moe", "glm_moe_dsa"] {
        let dir = vectors.join(arch);
        let verifier = Model::load(&dir, Precision::Bf16).unwrap();
        let bf16_serve = verifier.with_compute(Compute::Bf16).unwrap();
        let w = committed(&dir);
        let vocab = verifier.config().vocab_size as u64;
        let requests: Vec<Vec<u32>> = (0..6).map(|r| random_ids(vocab, r, 80)).collect();
        let t = tempfile::tempdir().unwrap();
        let mut cheats = Vec::new();
        for (label, pick, factor) in [
            ("shared x1.05", is_shared_down as fn(&str) -> bool, 1.05),
            ("shared x1.015", is_shared_down as fn(&str) -> bool, 1.015),
            ("routed x1.015", is_routed_down as fn(&str) -> bool, 1.015),
        ] {
            let d = t.path().join(label.replace([' ', '.'], "_"));
            assert!(scaled_copy(&dir, &d, pick, factor) > 0, "{arch} {label}");
            let m = Model::load_with(&d, Precision::Bf16, Compute::Bf16).unwrap();
            cheats.push((label, m));
        }
        let (mut honest_flagged, mut honest_audits) = (0usize, 0usize);
        let (mut bias_max, mut part_max) = (0f32, 0f32);
        let mut caught = vec![0usize; cheats.len()];
        let mut whole_caught = vec![0usize; cheats.len()];
        let mut audits = 0usize;
        for (r, ids) in requests.iter().enumerate() {
            for s in 0..SEEDS {
                let seed = [(r as u8).wrapping_mul(16).wrapping_add(s + 1); 32];
                for serve in [&bf16_serve, &verifier] {
                    let cells = serve_cells(serve, ids, CellServe::Honest).unwrap();
                    let rep = audit(&verifier, &w, serve, ids, &cells, seed);
                    honest_audits += 1;
                    honest_flagged += usize::from(rep.verdict == BundleVerdict::Cheat);
                    bias_max = bias_max.max(rep.stats.y_bias_mean.abs());
                    for p in [rep.stats.y_bias_routed_mean, rep.stats.y_bias_shared_mean]
                        .into_iter()
                        .flatten()
                    {
                        part_max = part_max.max(p.abs());
                    }
                }
                audits += 1;
                for (i, (label, m)) in cheats.iter().enumerate() {
                    let cells = serve_cells(m, ids, CellServe::Honest).unwrap();
                    let rep = audit(&verifier, &w, m, ids, &cells, seed);
                    caught[i] += usize::from(rep.verdict == BundleVerdict::Cheat);
                    // Judged on the whole output alone (main 847f793): every failure but
                    // the per-part rules.
                    let whole = rep.failed > 0
                        || rep
                            .stats
                            .failures
                            .iter()
                            .any(|f| !f.contains("experts' outputs"));
                    whole_caught[i] += usize::from(whole);
                    if r == 0 && s == 0 {
                        println!(
                            "{arch} {label}: {:?} y median {:.4}, whole-y bias {:+.4}, routed \
                             {:?}, shared {:?}; {:?}",
                            rep.verdict,
                            rep.stats.y_err_median,
                            rep.stats.y_bias_mean,
                            rep.stats.y_bias_routed_mean,
                            rep.stats.y_bias_shared_mean,
                            rep.stats.failures
                        );
                    }
                }
            }
        }
        println!(
            "{arch}: honest bf16 + f32 flagged {honest_flagged}/{honest_audits} (largest \
             |whole-y bias| {bias_max:.4}, largest |part bias| {part_max:.4})"
        );
        for (i, (label, _)) in cheats.iter().enumerate() {
            println!(
                "{arch}: {label} caught {}/{audits} (by the whole-output rules alone: {}/{audits})",
                caught[i], whole_caught[i]
            );
            if caught[i] != audits {
                failures.push(format!("{arch} {label}: caught {}/{audits}", caught[i]));
            }
        }
        if honest_flagged > 0 {
            failures.push(format!("{arch}: honest flagged {honest_flagged}"));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}
