//! A synthetic Qwen3.5/3.6-MoE checkpoint (see [`super`] for what synthetic checkpoints are for).
//!
//! [`Qwen36Shapes::RELEASE`] are Qwen3.6-35B-A3B's text-model shapes as its model card states
//! them (hidden 2048, vocabulary 248320, 40 layers laid out `10 × (3 × Gated DeltaNet → MoE,
//! 1 × Gated Attention → MoE)`; DeltaNet 32 value heads and 16 query/key heads of dimension
//! 128; attention 16 query heads and 2 KV heads of dimension 256 with a 64-dimensional rotary
//! part; 256 experts, 8 routed plus 1 shared, intermediate 512), with transformers'
//! `Qwen3_5MoeTextConfig` defaults for what the card does not list (conv kernel 4,
//! rms_norm_eps 1e-6, rope_theta 1e7). The block-FP8 layout follows the public
//! `Qwen/Qwen3.6-35B-A3B-FP8` format: `[128, 128]` tiles, BF16 `weight_scale_inv`, FP8 for the
//! attention / DeltaNet projections (`in_proj_qkv`, `in_proj_z`, `out_proj`), the shared
//! expert and every routed expert; BF16 for embeddings, LM head, norms, router, shared-expert
//! gate and the DeltaNet's small tensors (`A_log`, `conv1d`, `dt_bias`, `in_proj_a`,
//! `in_proj_b`). Tensors use the conditional-generation layout (`model.language_model.…`).
use std::path::Path;

use safetensors::Dtype;

use super::{bf16_tensor, write_config, write_shards, Raw, Store, SynthReport};
use crate::ModelError;

/// The text-model shapes of a Qwen3.5/3.6-MoE checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen36Shapes {
    /// `hidden_size`.
    pub hidden: usize,
    /// `vocab_size` (embedding and LM head rows).
    pub vocab: usize,
    /// Decoder layers written (the release has 40).
    pub layers: usize,
    /// Every `full_attention_interval`-th layer is gated attention, the rest Gated DeltaNet.
    pub full_attention_interval: usize,
    /// `linear_num_key_heads`.
    pub lin_k_heads: usize,
    /// `linear_num_value_heads`.
    pub lin_v_heads: usize,
    /// `linear_key_head_dim` = `linear_value_head_dim`.
    pub lin_head_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim`.
    pub head_dim: usize,
    /// `partial_rotary_factor`.
    pub partial_rotary_factor: f64,
    /// `num_experts`.
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `moe_intermediate_size`.
    pub moe_inter: usize,
    /// `shared_expert_intermediate_size`.
    pub shared_inter: usize,
}

impl Qwen36Shapes {
    /// Qwen3.6-35B-A3B (sources in the module docs).
    pub const RELEASE: Self = Self {
        hidden: 2048,
        vocab: 248_320,
        layers: 40,
        full_attention_interval: 4,
        lin_k_heads: 16,
        lin_v_heads: 32,
        lin_head_dim: 128,
        conv_kernel: 4,
        heads: 16,
        kv_heads: 2,
        head_dim: 256,
        partial_rotary_factor: 0.25,
        experts: 256,
        top_k: 8,
        moe_inter: 512,
        shared_inter: 512,
    };

    /// Whether layer `i` is gated full attention (else Gated DeltaNet).
    pub fn is_attention(&self, i: usize) -> bool {
        (i + 1).is_multiple_of(self.full_attention_interval.max(1))
    }

    /// `config.json` (conditional-generation form: text settings under `text_config`, block
    /// FP8 `quantization_config` when `fp8`).
    pub fn config_json(&self, fp8: bool) -> serde_json::Value {
        let types: Vec<&str> = (0..self.layers)
            .map(|i| {
                if self.is_attention(i) {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        let mut text = serde_json::json!({
            "model_type": "qwen3_5_moe_text",
            "hidden_size": self.hidden,
            "vocab_size": self.vocab,
            "num_hidden_layers": self.layers,
            "layer_types": types,
            "full_attention_interval": self.full_attention_interval,
            "linear_num_key_heads": self.lin_k_heads,
            "linear_num_value_heads": self.lin_v_heads,
            "linear_key_head_dim": self.lin_head_dim,
            "linear_value_head_dim": self.lin_head_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rope_theta": 10_000_000.0,
            "rms_norm_eps": 1e-6,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.moe_inter,
            "shared_expert_intermediate_size": self.shared_inter,
            "hidden_act": "silu",
            "tie_word_embeddings": false,
            "max_position_embeddings": 262_144,
            "dtype": "bfloat16",
        });
        let mut cfg = serde_json::json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
        });
        if fp8 {
            let q = serde_json::json!({
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            });
            cfg["quantization_config"] = q.clone();
            text["quantization_config"] = q;
        }
        cfg["text_config"] = text;
        cfg
    }

    /// Parameters of the text model as written (embedding and LM head included).
    pub fn parameters(&self) -> usize {
        let d = self.hidden;
        let per_expert = 3 * d * self.moe_inter;
        let moe = self.experts * d + self.experts * per_expert + 3 * d * self.shared_inter + d;
        let cd = self.conv_dim();
        let delta = cd * d
            + 2 * self.lin_v_heads * self.lin_head_dim * d
            + 2 * self.lin_v_heads * d
            + cd * self.conv_kernel
            + 2 * self.lin_v_heads
            + self.lin_head_dim;
        let attn = 2 * self.heads * self.head_dim * d
            + 2 * self.kv_heads * self.head_dim * d
            + self.heads * self.head_dim * d
            + 2 * self.head_dim;
        let layers: usize = (0..self.layers)
            .map(|i| 2 * d + moe + if self.is_attention(i) { attn } else { delta })
            .sum();
        2 * self.vocab * d + d + layers
    }

    fn conv_dim(&self) -> usize {
        (2 * self.lin_k_heads + self.lin_v_heads) * self.lin_head_dim
    }
}

/// A linear weight `[out, inp]`: block FP8 with BF16 tile scales (the Qwen `-FP8` format)
/// when `fp8`, else BF16 (see [`super::linear`]).
fn linear(seed: u64, name: &str, out: usize, inp: usize, fp8: bool) -> Vec<Raw> {
    let store = if fp8 {
        Store::Fp8 { scale: Dtype::BF16 }
    } else {
        Store::Bf16
    };
    super::linear(seed, name, out, inp, store)
}

/// Writes a synthetic Qwen3.5/3.6-MoE checkpoint of `shapes` to `dir`: `config.json` and one
/// safetensors shard per layer (plus one for the embedding, one for the final norm and LM
/// head), block FP8 when `fp8`. Deterministic in `seed`. Memory: one layer's bytes per
/// thread (shards are written in parallel).
///
/// # Errors
/// [`ModelError::Io`] when `dir` cannot be written, [`ModelError::Safetensors`] if a shard
/// cannot be serialised.
pub fn write_qwen3_5_moe(
    dir: &Path,
    shapes: &Qwen36Shapes,
    fp8: bool,
    seed: u64,
) -> Result<SynthReport, ModelError> {
    write_config(dir, &shapes.config_json(fp8))?;
    let (d, n_shards) = (shapes.hidden, shapes.layers + 2);
    // Text-only names, `model.` → `model.language_model.` (the conditional-generation layout).
    let rename = |name: &str| match name.strip_prefix("model.") {
        Some(rest) => format!("model.language_model.{rest}"),
        None => name.to_string(),
    };
    let (bytes, files) = write_shards(dir, n_shards, rename, |shard| {
        let mut t: Vec<Raw> = Vec::new();
        if shard == 0 {
            t.push(bf16_tensor(
                seed,
                "model.embed_tokens.weight",
                vec![shapes.vocab, d],
                0.0,
                0.03,
            ));
        } else if shard == n_shards - 1 {
            t.push(bf16_tensor(seed, "model.norm.weight", vec![d], 0.0, 0.1));
            t.push(bf16_tensor(
                seed,
                "lm_head.weight",
                vec![shapes.vocab, d],
                0.0,
                0.03,
            ));
        } else {
            layer_tensors(&mut t, shapes, shard - 1, fp8, seed);
        }
        t
    })?;
    Ok(SynthReport {
        parameters: shapes.parameters(),
        bytes,
        files,
    })
}

fn layer_tensors(t: &mut Vec<Raw>, s: &Qwen36Shapes, i: usize, fp8: bool, seed: u64) {
    let d = s.hidden;
    let p = format!("model.layers.{i}");
    t.push(bf16_tensor(
        seed,
        &format!("{p}.input_layernorm.weight"),
        vec![d],
        0.0,
        0.1,
    ));
    t.push(bf16_tensor(
        seed,
        &format!("{p}.post_attention_layernorm.weight"),
        vec![d],
        0.0,
        0.1,
    ));
    if s.is_attention(i) {
        let a = format!("{p}.self_attn");
        let (h, kv, hd) = (s.heads, s.kv_heads, s.head_dim);
        t.extend(linear(
            seed,
            &format!("{a}.q_proj.weight"),
            2 * h * hd,
            d,
            fp8,
        ));
        t.extend(linear(seed, &format!("{a}.k_proj.weight"), kv * hd, d, fp8));
        t.extend(linear(seed, &format!("{a}.v_proj.weight"), kv * hd, d, fp8));
        t.extend(linear(seed, &format!("{a}.o_proj.weight"), d, h * hd, fp8));
        for n in ["q_norm", "k_norm"] {
            t.push(bf16_tensor(
                seed,
                &format!("{a}.{n}.weight"),
                vec![hd],
                0.0,
                0.1,
            ));
        }
    } else {
        let a = format!("{p}.linear_attn");
        let (nv, dh) = (s.lin_v_heads, s.lin_head_dim);
        let cd = s.conv_dim();
        t.extend(linear(seed, &format!("{a}.in_proj_qkv.weight"), cd, d, fp8));
        t.extend(linear(
            seed,
            &format!("{a}.in_proj_z.weight"),
            nv * dh,
            d,
            fp8,
        ));
        t.extend(linear(seed, &format!("{a}.in_proj_a.weight"), nv, d, false));
        t.extend(linear(seed, &format!("{a}.in_proj_b.weight"), nv, d, false));
        t.push(bf16_tensor(
            seed,
            &format!("{a}.conv1d.weight"),
            vec![cd, 1, s.conv_kernel],
            0.0,
            0.5,
        ));
        t.push(bf16_tensor(seed, &format!("{a}.A_log"), vec![nv], 0.0, 1.0));
        t.push(bf16_tensor(
            seed,
            &format!("{a}.dt_bias"),
            vec![nv],
            0.0,
            1.0,
        ));
        t.push(bf16_tensor(
            seed,
            &format!("{a}.norm.weight"),
            vec![dh],
            1.0,
            0.1,
        ));
        t.extend(linear(
            seed,
            &format!("{a}.out_proj.weight"),
            d,
            nv * dh,
            fp8,
        ));
    }
    let m = format!("{p}.mlp");
    t.extend(linear(
        seed,
        &format!("{m}.gate.weight"),
        s.experts,
        d,
        false,
    ));
    for e in 0..s.experts {
        let x = format!("{m}.experts.{e}");
        t.extend(linear(
            seed,
            &format!("{x}.gate_proj.weight"),
            s.moe_inter,
            d,
            fp8,
        ));
        t.extend(linear(
            seed,
            &format!("{x}.up_proj.weight"),
            s.moe_inter,
            d,
            fp8,
        ));
        t.extend(linear(
            seed,
            &format!("{x}.down_proj.weight"),
            d,
            s.moe_inter,
            fp8,
        ));
    }
    if s.shared_inter > 0 {
        let x = format!("{m}.shared_expert");
        t.extend(linear(
            seed,
            &format!("{x}.gate_proj.weight"),
            s.shared_inter,
            d,
            fp8,
        ));
        t.extend(linear(
            seed,
            &format!("{x}.up_proj.weight"),
            s.shared_inter,
            d,
            fp8,
        ));
        t.extend(linear(
            seed,
            &format!("{x}.down_proj.weight"),
            d,
            s.shared_inter,
            fp8,
        ));
        t.extend(linear(
            seed,
            &format!("{m}.shared_expert_gate.weight"),
            1,
            d,
            false,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scaled-down shape set: same structure, small numbers.
    fn small() -> Qwen36Shapes {
        Qwen36Shapes {
            hidden: 256,
            vocab: 300,
            layers: 4,
            lin_k_heads: 2,
            lin_v_heads: 4,
            lin_head_dim: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            experts: 8,
            top_k: 2,
            moe_inter: 64,
            shared_inter: 64,
            ..Qwen36Shapes::RELEASE
        }
    }

    #[test]
    fn the_synthetic_fp8_checkpoint_loads_and_runs_as_qwen3_5_moe() {
        let t = tempfile::tempdir().unwrap();
        let s = small();
        let r = write_qwen3_5_moe(t.path(), &s, true, 7).unwrap();
        let m = crate::synth::open_and_run(t.path(), &[1, 2, 3, 4, 5]);
        assert_eq!(m.config().num_hidden_layers, 4);
        // Every parameter the shapes count is in the files (FP8: 1 byte, BF16: 2 bytes, plus
        // the tile scales), so the count is not a formula drifting from the writer.
        let names: usize = r.files.len();
        assert_eq!(names, s.layers + 2);
        assert!(r.bytes > r.parameters && r.bytes < 2 * r.parameters);
    }
}
