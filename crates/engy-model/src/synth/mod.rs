//! Synthetic checkpoints with the *shapes* of a released model, for measuring the auditor
//! (throughput in `benches/teacher_forced.rs`, peak memory and GPU speed through
//! `examples/synth_checkpoint.rs`). The values are random (no tokenizer, no meaningful text):
//! they exercise the same tensor layout, dtypes and code paths as the release, nothing more.
//!
//! One file per architecture, each with its shapes (`RELEASE` = the public release's, with the
//! source of every number) and a writer:
//!
//! * [`qwen3_5_moe`]: Qwen3.6-35B-A3B ([`Qwen36Shapes`], [`write_qwen3_5_moe`]);
//! * [`glm_moe_dsa`]: GLM-5 / GLM-5.1 ([`GlmShapes`], [`write_glm_moe_dsa`]).
//!
//! This file holds what they share: the BF16 / F32 / block-FP8 tensor makers (every tensor is
//! seeded by its name, so a checkpoint is deterministic in its seed and shards can be made in
//! any order) and the parallel shard writer.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::bf16;
use rayon::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use crate::rng::SplitMix64;
use crate::ModelError;

pub mod glm_moe_dsa;
pub mod qwen3_5_moe;

pub use glm_moe_dsa::{write_glm_moe_dsa, GlmShapes};
pub use qwen3_5_moe::{write_qwen3_5_moe, Qwen36Shapes};

/// What a synthetic-checkpoint writer wrote.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// Parameters written (the shapes' `parameters()`; FP8 tile scales and routing biases are
    /// not parameters).
    pub parameters: usize,
    /// Bytes of tensor data over all shards.
    pub bytes: usize,
    /// Shard files, in order.
    pub files: Vec<PathBuf>,
}

/// One tensor to write: name, dtype, shape, little-endian bytes.
pub(crate) type Raw = (String, Dtype, Vec<usize>, Vec<u8>);

/// `n` uniform values in `centre ± spread`, seeded by the tensor's name.
fn uniform(seed: u64, name: &str, n: usize, centre: f32, spread: f32) -> impl Iterator<Item = f32> {
    let mut s = SplitMix64::for_label(seed, name);
    (0..n).map(move |_| centre + spread * s.signed_unit())
}

/// A BF16 tensor of uniform values in `centre ± spread`.
pub(crate) fn bf16_tensor(
    seed: u64,
    name: &str,
    shape: Vec<usize>,
    centre: f32,
    spread: f32,
) -> Raw {
    let n: usize = shape.iter().product();
    let bytes = uniform(seed, name, n, centre, spread)
        .flat_map(|v| bf16::from_f32(v).to_le_bytes())
        .collect();
    (name.to_string(), Dtype::BF16, shape, bytes)
}

/// An F32 tensor of uniform values in `centre ± spread`.
pub(crate) fn f32_tensor(
    seed: u64,
    name: &str,
    shape: Vec<usize>,
    centre: f32,
    spread: f32,
) -> Raw {
    let n: usize = shape.iter().product();
    let bytes = uniform(seed, name, n, centre, spread)
        .flat_map(f32::to_le_bytes)
        .collect();
    (name.to_string(), Dtype::F32, shape, bytes)
}

/// How a linear weight is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Store {
    /// BF16 `[out, inp]`.
    Bf16,
    /// Block FP8: E4M3 `[out, inp]` plus `weight_scale_inv` per 128×128 tile in this dtype
    /// (BF16 in Qwen's `-FP8` releases, F32 in DeepSeek-V3-style ones).
    Fp8 { scale: Dtype },
}

/// A linear weight `[out, inp]` of std ≈ `1/sqrt(inp)`: block FP8 (E4M3 codes of magnitude
/// 0.25..2, `weight_scale_inv` per 128×128 tile) or BF16, as `store` says.
pub(crate) fn linear(seed: u64, name: &str, out: usize, inp: usize, store: Store) -> Vec<Raw> {
    let std = 1.0 / (inp as f32).sqrt();
    let scale_dtype = match store {
        Store::Bf16 => return vec![bf16_tensor(seed, name, vec![out, inp], 0.0, std * 1.7)],
        Store::Fp8 { scale } => scale,
    };
    let mut s = SplitMix64::for_label(seed, name);
    // sign | exponent 5..=8 (2^-2..2^1) | mantissa: never the NaN code.
    let codes: Vec<u8> = (0..out * inp)
        .map(|_| {
            let r = s.next_u64();
            ((r & 0x80) as u8) | ((5 + (r >> 8) % 4) as u8) << 3 | ((r >> 16) & 7) as u8
        })
        .collect();
    let grid = vec![out.div_ceil(128), inp.div_ceil(128)];
    let scales = (0..grid[0] * grid[1]).map(|_| std * (0.9 + 0.2 * (s.signed_unit() + 1.0) / 2.0));
    let scale: Vec<u8> = if scale_dtype == Dtype::F32 {
        scales.flat_map(f32::to_le_bytes).collect()
    } else {
        scales
            .flat_map(|v| bf16::from_f32(v).to_le_bytes())
            .collect()
    };
    vec![
        (name.to_string(), Dtype::F8_E4M3, vec![out, inp], codes),
        (format!("{name}_scale_inv"), scale_dtype, grid, scale),
    ]
}

/// Writes `config` as `dir/config.json` (creating `dir`).
///
/// # Errors
/// [`ModelError::Io`] when `dir` cannot be written.
pub(crate) fn write_config(dir: &Path, config: &serde_json::Value) -> Result<(), ModelError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let cfg = serde_json::to_vec_pretty(config)
        .map_err(|e| ModelError::Config(format!("config.json: {e}")))?;
    let path = dir.join("config.json");
    std::fs::write(&path, cfg).map_err(io(&path))
}

/// Writes `n_shards` safetensors files `model-{i:05}-of-{n:05}.safetensors` to `dir`, shard
/// `i` holding the tensors `make(i)` returns, each renamed by `rename`. Shards are independent
/// (every tensor is seeded by its name), so they are made and written in parallel; each holds
/// its own bytes in memory while it is written. Returns (bytes of tensor data, files in order).
///
/// # Errors
/// [`ModelError::Safetensors`] if a shard cannot be serialised or written.
pub(crate) fn write_shards(
    dir: &Path,
    n_shards: usize,
    rename: impl Fn(&str) -> String + Sync,
    make: impl Fn(usize) -> Vec<Raw> + Sync,
) -> Result<(usize, Vec<PathBuf>), ModelError> {
    let written = (0..n_shards)
        .into_par_iter()
        .map(|shard| -> Result<(usize, PathBuf), ModelError> {
            let t = make(shard);
            let file = dir.join(format!(
                "model-{:05}-of-{:05}.safetensors",
                shard + 1,
                n_shards
            ));
            let bad = |msg: String| ModelError::Safetensors {
                file: file.clone(),
                msg,
            };
            let mut bytes_total = 0;
            let mut views = Vec::with_capacity(t.len());
            for (name, dtype, shape, bytes) in &t {
                bytes_total += bytes.len();
                let v = TensorView::new(*dtype, shape.clone(), bytes)
                    .map_err(|e| bad(format!("{name}: {e}")))?;
                views.push((rename(name), v));
            }
            let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
            safetensors::tensor::serialize_to_file(views, Some(meta), &file)
                .map_err(|e| bad(e.to_string()))?;
            Ok((bytes_total, file))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bytes = written.iter().map(|(b, _)| b).sum();
    Ok((bytes, written.into_iter().map(|(_, f)| f).collect()))
}

/// What the writers' tests share: a written checkpoint opened as engy-model opens a real one
/// (streaming), run over `ids`: one row of final hidden states per id, all finite.
#[cfg(test)]
pub(crate) fn open_and_run(dir: &Path, ids: &[u32]) -> crate::Model {
    let opts = crate::LoadOptions {
        residency: crate::Residency::Streaming,
        ..crate::LoadOptions::default()
    };
    let m = crate::Model::open(dir, &opts).unwrap();
    let h = m.hidden_states(ids).unwrap();
    assert_eq!(h.len(), ids.len());
    assert!(h.iter().flatten().all(|v| v.is_finite()));
    m
}
