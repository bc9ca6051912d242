//! The expert-only cheats of the sampled cell audit (docs/AUDITOR.md "Cells"): a copy of a
//! checkpoint whose routed experts are rounded to int4 or to block FP8 while the router, the
//! attention, the shared expert and everything else stay exact. A serve that runs it claims
//! the honest checkpoint; TOPLOC sees only the final hidden state, where a few experts'
//! rounding is weakest, while an opened cell's `y` is recomputed from the committed experts.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::{quantize_int4, ModelError};

/// The Block FP8 tile of [`ExpertQuant::Fp8`] (rows × columns), as DeepSeek-V3 / Qwen3 FP8
/// exports use.
pub const FP8_TILE: usize = 128;

/// How the routed experts are rounded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExpertQuant {
    /// Symmetric int4 per group of `group_size` input columns ([`quantize_int4`]).
    Int4 {
        /// Columns per group.
        group_size: usize,
    },
    /// Block FP8 E4M3: per [`FP8_TILE`]² tile, `scale = max |w| / 448`, each value rounded to
    /// the nearest E4M3 of `w / scale`, times `scale`.
    Fp8,
}

/// What [`write_expert_cheat`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CheatReport {
    /// Expert weight tensors rounded (a fused tensor counts once).
    pub tensors: usize,
    /// Values whose stored value changed.
    pub values_changed: usize,
}

/// Whether `name` is a routed expert's projection weight (`….mlp.experts.{e}.*_proj.weight`,
/// or a fused `….mlp.experts.{gate_up,down}_proj`); never the router or the shared expert.
fn is_expert_weight(name: &str) -> bool {
    let Some((_, rest)) = name.split_once(".mlp.experts.") else {
        return false;
    };
    let fused = rest.ends_with("_proj");
    let per_expert = rest.ends_with("_proj.weight");
    fused || per_expert
}

/// Rounds `w` (`[.., rows, cols]` row-major) to block FP8 in place (see [`ExpertQuant::Fp8`]),
/// then to bf16 as the checkpoint stores it.
fn quantize_fp8_blocks(w: &mut [f32], rows: usize, cols: usize) {
    let (rows, cols) = (rows.max(1), cols.max(1));
    for m in w.chunks_mut(rows * cols) {
        for r0 in (0..rows).step_by(FP8_TILE) {
            for c0 in (0..cols).step_by(FP8_TILE) {
                let (r1, c1) = ((r0 + FP8_TILE).min(rows), (c0 + FP8_TILE).min(cols));
                let tile = |m: &[f32]| {
                    (r0..r1)
                        .flat_map(|r| (c0..c1).map(move |c| r * cols + c))
                        .filter_map(|i| m.get(i).copied())
                        .fold(0f32, |a, x| a.max(x.abs()))
                };
                let max = tile(m);
                if max == 0.0 || !max.is_finite() {
                    continue;
                }
                let scale = max / 448.0;
                for r in r0..r1 {
                    for c in c0..c1 {
                        if let Some(x) = m.get_mut(r * cols + c) {
                            let q = float8::F8E4M3::from_f32(*x / scale).to_f32();
                            *x = bf16::from_f32(q * scale).to_f32();
                        }
                    }
                }
            }
        }
    }
}

fn floats(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        Dtype::BF16 => Some(
            data.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        Dtype::F16 => Some(
            data.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        Dtype::F32 => Some(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        _ => None,
    }
}

fn bytes_of(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F16 => v
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        _ => v
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// Writes to `dst` a copy of the checkpoint `src` (every file directly in it) whose routed
/// expert weights (BF16, F16 or F32; quantised storage is copied as is) are rounded by
/// `quant` and stored back in their dtype. The config, tokenizer and every other tensor are
/// copied unchanged, so the copy loads as the same model and claims the same identity.
///
/// # Errors
/// [`ModelError::Io`] for unreadable or unwritable files, [`ModelError::Safetensors`] for a
/// malformed shard.
pub fn write_expert_cheat(
    src: &Path,
    dst: &Path,
    quant: ExpertQuant,
) -> Result<CheatReport, ModelError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(src)
        .map_err(io(src))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut report = CheatReport::default();
    for path in files {
        let Some(name) = path.file_name() else {
            continue;
        };
        let out = dst.join(name);
        if path.extension().is_none_or(|x| x != "safetensors") {
            std::fs::copy(&path, &out).map_err(io(&path))?;
            continue;
        }
        let buf = std::fs::read(&path).map_err(io(&path))?;
        let bad = |msg: String| ModelError::Safetensors {
            file: path.clone(),
            msg,
        };
        let st = SafeTensors::deserialize(&buf).map_err(|e| bad(e.to_string()))?;
        let (_, meta) = SafeTensors::read_metadata(&buf).map_err(|e| bad(e.to_string()))?;
        let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
        for (tname, view) in st.iter() {
            let (dtype, shape) = (view.dtype(), view.shape().to_vec());
            let rounded = if is_expert_weight(tname) && shape.len() >= 2 {
                floats(dtype, view.data()).map(|mut v| {
                    let (rows, cols) = (shape[shape.len() - 2], shape[shape.len() - 1]);
                    let before = v.clone();
                    match quant {
                        ExpertQuant::Int4 { group_size } => quantize_int4(&mut v, cols, group_size),
                        ExpertQuant::Fp8 => quantize_fp8_blocks(&mut v, rows, cols),
                    }
                    let data = bytes_of(dtype, &v);
                    let old = bytes_of(dtype, &before);
                    let width = if dtype == Dtype::F32 { 4 } else { 2 };
                    let changed = data
                        .chunks(width)
                        .zip(old.chunks(width))
                        .filter(|(a, b)| a != b)
                        .count();
                    (data, changed)
                })
            } else {
                None
            };
            let data = match rounded {
                Some((data, changed)) => {
                    report.tensors += 1;
                    report.values_changed += changed;
                    data
                }
                None => view.data().to_vec(),
            };
            owned.push((tname.to_string(), dtype, shape, data));
        }
        let views = owned
            .iter()
            .map(|(n, d, s, b)| {
                TensorView::new(*d, s.clone(), b)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| bad(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let metadata: Option<HashMap<String, String>> = meta.metadata().clone();
        let bytes =
            safetensors::tensor::serialize(views, metadata).map_err(|e| bad(e.to_string()))?;
        std::fs::write(&out, bytes).map_err(io(&out))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::is_expert_weight;

    #[test]
    fn only_routed_expert_projections_are_cheated() {
        assert!(is_expert_weight(
            "model.layers.1.mlp.experts.3.up_proj.weight"
        ));
        assert!(is_expert_weight(
            "model.language_model.layers.0.mlp.experts.gate_up_proj"
        ));
        assert!(!is_expert_weight("model.layers.1.mlp.gate.weight"));
        assert!(!is_expert_weight(
            "model.layers.1.mlp.shared_expert.up_proj.weight"
        ));
        assert!(!is_expert_weight("model.layers.1.self_attn.q_proj.weight"));
    }
}
