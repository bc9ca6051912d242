//! A synthetic GLM-5.x (`glm_moe_dsa`) checkpoint (see [`super`] for what synthetic checkpoints
//! are for).
//!
//! [`GlmShapes::RELEASE`] are GLM-5's (`zai-org/GLM-5`; GLM-5.1 has the same architecture and
//! shapes, new weights). Sources, each number checked against at least two of them:
//!
//! * transformers 5.24.0 `models/glm_moe_dsa/configuration_glm_moe_dsa.py`, whose defaults are
//!   documented as those of `zai-org/GLM-5` (`@auto_docstring(checkpoint="zai-org/GLM-5")`):
//!   vocabulary 154880, hidden 6144, dense intermediate 12288, MoE intermediate 2048, 78
//!   layers, 64 attention heads = 64 KV heads, 1 shared + 256 routed experts, 8 per token,
//!   `routed_scaling_factor` 2.5, `n_group` = `topk_group` = 1, `norm_topk_prob`, q LoRA rank
//!   2048, KV LoRA rank 512, `qk_nope_head_dim` 192, `qk_rope_head_dim` 64, `v_head_dim` 256,
//!   `first_k_dense_replace` 3, `index_topk` 2048, `index_head_dim` 128, `index_n_heads` 32,
//!   `rms_norm_eps` 1e-5, `max_position_embeddings` 202752; transformers 5.17.0 has the same
//!   defaults;
//! * xLLM's `xllm/models/llm/glm5.h` (jd-opensource/xllm), whose defaults cite
//!   `huggingface.co/zai-org/GLM-5/blob/main/config.json`: the same numbers, plus
//!   `rope_parameters.rope_theta` 1e6 with the default (unscaled) RoPE, sigmoid scoring,
//!   `noaux_tc` routing and one MTP layer (`num_nextn_predict_layers`, not written here: it is
//!   not part of the decoder the auditor recomputes);
//! * the GLM-5 technical report's architecture table (3 dense + 75 MoE layers, hidden 6144,
//!   MoE intermediate 2048, q LoRA 2048, KV LoRA 512, 64 heads, indexer 32 heads of 128,
//!   256 experts, 8 routed + 1 shared, vocabulary 154880) and NVIDIA NeMo's GLM-5 model page
//!   (78 layers, `first_k_dense_replace` 3, `max_position_embeddings` 202752).
//!
//! At its 78 layers the set counts 743.9 G parameters ([`GlmShapes::parameters`]), the
//! report's "744B"; transformers 5.17.0 and 5.24.0 build the written `config.json` (on the meta
//! device) with exactly that many.
//!
//! GLM-5 / GLM-5.1's `config.json` has no `indexer_types` / `index_topk_pattern`, so with
//! transformers' default schedule (`index_topk_freq` 1) every layer runs its own DSA indexer:
//! [`GlmShapes::indexer_pattern`] `"F"`. (GLM-5.2's IndexShare layers, `"S"`, reuse the
//! previous layer's selection; the writer supports the pattern, the release shapes do not use
//! it.) The layers written keep the release's order: the first `first_k_dense_replace` dense,
//! the rest MoE, so a reduced count (say 5) is 3 dense layers and 2 MoE layers.
//!
//! The block-FP8 layout is that of `zai-org/GLM-5-FP8` / `GLM-5.1-FP8` (DeepSeek-V3 style,
//! `quant_method` `fp8`, `e4m3`, dynamic activations, `[128, 128]` tiles), as the repository's
//! FP8 oracle `tests/vectors/arch/glm_moe_dsa_fp8` lays it out: F8_E4M3 weights with an F32
//! `weight_scale_inv` per tile for every MLA projection (`q_a_proj`, `q_b_proj`,
//! `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`), the indexer's `wq_b` and `wk`, the dense MLPs,
//! the shared experts and every routed expert; kept out of FP8 (`modules_to_not_convert`):
//! embeddings and LM head, every norm (the indexer's `k_norm` LayerNorm included), the
//! indexer's `weights_proj` (BF16) and the router `mlp.gate` (F32 weight and F32
//! `e_score_correction_bias`, as transformers keeps them: `_keep_in_fp32_modules_strict`).
//! Tensor names are the release's (`model.layers.{l}.…`, per-expert
//! `mlp.experts.{e}.{gate,up,down}_proj`, `mlp.shared_experts.…`).
use std::path::Path;

use safetensors::Dtype;

use super::{bf16_tensor, f32_tensor, linear, write_config, write_shards, Raw, Store, SynthReport};
use crate::ModelError;

/// The shapes of a `glm_moe_dsa` checkpoint (transformers' config names in each doc).
#[derive(Debug, Clone, PartialEq)]
pub struct GlmShapes {
    /// `hidden_size`.
    pub hidden: usize,
    /// `vocab_size` (embedding and LM head rows).
    pub vocab: usize,
    /// Decoder layers written (`num_hidden_layers`; the release has 78).
    pub layers: usize,
    /// `first_k_dense_replace`: the first layers have a dense SwiGLU MLP, the rest MoE.
    pub first_k_dense: usize,
    /// `intermediate_size` (the dense MLP's width).
    pub intermediate: usize,
    /// `num_attention_heads` = `num_key_value_heads`.
    pub heads: usize,
    /// `q_lora_rank`.
    pub q_lora_rank: usize,
    /// `kv_lora_rank`.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim` (also `head_dim` in the config, as transformers sets it).
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// `index_n_heads` (DSA indexer heads).
    pub index_n_heads: usize,
    /// `index_head_dim`.
    pub index_head_dim: usize,
    /// `index_topk` (keys each query keeps).
    pub index_topk: usize,
    /// `indexer_types` as characters, `F` (the layer runs its own indexer) or `S` (it reuses
    /// the previous layer's selection); layer `i` takes character `i % len`. Must start
    /// with `F`.
    pub indexer_pattern: &'static str,
    /// `n_routed_experts`.
    pub experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `n_shared_experts`.
    pub shared_experts: usize,
    /// `moe_intermediate_size` (one expert's width).
    pub moe_inter: usize,
    /// `rope_parameters.rope_theta`.
    pub rope_theta: f64,
}

/// Routed experts per safetensors shard: 32 real-shape experts are 1.2 GB of FP8, so the
/// writer's memory stays a few GB per thread where a whole 256-expert layer would be 9.7 GB.
const EXPERTS_PER_SHARD: usize = 32;

/// One shard's contents.
#[derive(Debug, Clone, Copy)]
enum Unit {
    Embed,
    /// A layer's norms, attention, indexer and dense MLP or router + shared experts.
    Layer(usize),
    /// Routed experts `[from, to)` of a MoE layer.
    Experts(usize, usize, usize),
    Head,
}

impl GlmShapes {
    /// GLM-5 / GLM-5.1 (sources in the module docs).
    pub const RELEASE: Self = Self {
        hidden: 6144,
        vocab: 154_880,
        layers: 78,
        first_k_dense: 3,
        intermediate: 12_288,
        heads: 64,
        q_lora_rank: 2048,
        kv_lora_rank: 512,
        qk_nope_head_dim: 192,
        qk_rope_head_dim: 64,
        v_head_dim: 256,
        index_n_heads: 32,
        index_head_dim: 128,
        index_topk: 2048,
        indexer_pattern: "F",
        experts: 256,
        top_k: 8,
        shared_experts: 1,
        moe_inter: 2048,
        rope_theta: 1_000_000.0,
    };

    /// Whether layer `i` has the MoE block (else the dense MLP).
    pub fn is_moe(&self, i: usize) -> bool {
        i >= self.first_k_dense
    }

    /// Whether layer `i` runs its own DSA indexer (else it reuses the previous selection).
    pub fn has_indexer(&self, i: usize) -> bool {
        let p = self.indexer_pattern.as_bytes();
        p.is_empty() || p[i % p.len()] != b'S'
    }

    /// `config.json` (`GlmMoeDsaForCausalLM`, explicit `mlp_layer_types` and `indexer_types`
    /// for the layers written; block-FP8 `quantization_config` with `modules_to_not_convert`
    /// when `fp8`). `layer_types` is left to transformers' default: its value for DSA layers
    /// was renamed between 5.17 (`deepseek_sparse_attention`) and 5.24 (`indexed_attention`).
    pub fn config_json(&self, fp8: bool) -> serde_json::Value {
        let l = 0..self.layers;
        let mlp: Vec<&str> = l
            .clone()
            .map(|i| if self.is_moe(i) { "sparse" } else { "dense" })
            .collect();
        let indexer: Vec<&str> = l
            .map(|i| {
                if self.has_indexer(i) {
                    "full"
                } else {
                    "shared"
                }
            })
            .collect();
        let mut cfg = serde_json::json!({
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "moe_intermediate_size": self.moe_inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "num_experts_per_tok": self.top_k,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": true,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": self.first_k_dense,
            "mlp_layer_types": mlp,
            "index_topk": self.index_topk,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "indexer_types": indexer,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "rms_norm_eps": 1e-5,
            "hidden_act": "silu",
            "attention_bias": false,
            "max_position_embeddings": 202_752,
            "tie_word_embeddings": false,
            "dtype": "bfloat16",
        });
        if fp8 {
            let mut keep = vec!["lm_head".to_string(), "model.embed_tokens".to_string()];
            for i in 0..self.layers {
                let p = format!("model.layers.{i}");
                keep.push(format!("{p}.input_layernorm"));
                keep.push(format!("{p}.post_attention_layernorm"));
                keep.push(format!("{p}.self_attn.q_a_layernorm"));
                keep.push(format!("{p}.self_attn.kv_a_layernorm"));
                if self.has_indexer(i) {
                    keep.push(format!("{p}.self_attn.indexer.k_norm"));
                    keep.push(format!("{p}.self_attn.indexer.weights_proj"));
                }
                if self.is_moe(i) {
                    keep.push(format!("{p}.mlp.gate"));
                }
            }
            keep.push("model.norm".to_string());
            cfg["quantization_config"] = serde_json::json!({
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": keep,
            });
        }
        cfg
    }

    /// Parameters of the model as written (embedding and LM head included; FP8 tile scales
    /// and the routers' `e_score_correction_bias`, a buffer in transformers, not counted):
    /// the count transformers' `model.parameters()` gives for the same config.
    pub fn parameters(&self) -> usize {
        let d = self.hidden;
        let (nh, dn, dr, dv) = (
            self.heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        );
        let (qr, kvr, ni, di) = (
            self.q_lora_rank,
            self.kv_lora_rank,
            self.index_n_heads,
            self.index_head_dim,
        );
        let attn = qr * d
            + qr
            + nh * (dn + dr) * qr
            + (kvr + dr) * d
            + kvr
            + nh * (dn + dv) * kvr
            + d * nh * dv;
        let indexer = ni * di * qr + di * d + 2 * di + ni * d;
        let dense = 3 * d * self.intermediate;
        let moe = self.experts * d
            + self.experts * 3 * d * self.moe_inter
            + 3 * d * self.moe_inter * self.shared_experts;
        let layers: usize = (0..self.layers)
            .map(|i| {
                2 * d
                    + attn
                    + if self.has_indexer(i) { indexer } else { 0 }
                    + if self.is_moe(i) { moe } else { dense }
            })
            .sum();
        2 * self.vocab * d + d + layers
    }

    fn units(&self) -> Vec<Unit> {
        let mut u = vec![Unit::Embed];
        for l in 0..self.layers {
            u.push(Unit::Layer(l));
            if self.is_moe(l) {
                let mut e = 0;
                while e < self.experts {
                    let to = (e + EXPERTS_PER_SHARD).min(self.experts);
                    u.push(Unit::Experts(l, e, to));
                    e = to;
                }
            }
        }
        u.push(Unit::Head);
        u
    }
}

/// A projection: block FP8 with F32 tile scales when `fp8`, else BF16.
fn proj(seed: u64, name: &str, out: usize, inp: usize, fp8: bool) -> Vec<Raw> {
    let store = if fp8 {
        Store::Fp8 { scale: Dtype::F32 }
    } else {
        Store::Bf16
    };
    linear(seed, name, out, inp, store)
}

/// An RMSNorm / LayerNorm weight: `1 ± 0.1` (GLM's norms multiply by the weight itself).
fn norm(seed: u64, name: &str, len: usize) -> Raw {
    bf16_tensor(seed, name, vec![len], 1.0, 0.1)
}

/// A SwiGLU MLP `{q}.{gate,up,down}_proj` of width `inter`.
fn mlp(t: &mut Vec<Raw>, seed: u64, q: &str, d: usize, inter: usize, fp8: bool) {
    t.extend(proj(seed, &format!("{q}.gate_proj.weight"), inter, d, fp8));
    t.extend(proj(seed, &format!("{q}.up_proj.weight"), inter, d, fp8));
    t.extend(proj(seed, &format!("{q}.down_proj.weight"), d, inter, fp8));
}

fn layer_tensors(t: &mut Vec<Raw>, s: &GlmShapes, l: usize, fp8: bool, seed: u64) {
    let d = s.hidden;
    let p = format!("model.layers.{l}");
    let a = format!("{p}.self_attn");
    let (nh, dn, dr, dv) = (
        s.heads,
        s.qk_nope_head_dim,
        s.qk_rope_head_dim,
        s.v_head_dim,
    );
    let (qr, kvr) = (s.q_lora_rank, s.kv_lora_rank);
    t.push(norm(seed, &format!("{p}.input_layernorm.weight"), d));
    t.push(norm(
        seed,
        &format!("{p}.post_attention_layernorm.weight"),
        d,
    ));
    t.extend(proj(seed, &format!("{a}.q_a_proj.weight"), qr, d, fp8));
    t.push(norm(seed, &format!("{a}.q_a_layernorm.weight"), qr));
    t.extend(proj(
        seed,
        &format!("{a}.q_b_proj.weight"),
        nh * (dn + dr),
        qr,
        fp8,
    ));
    t.extend(proj(
        seed,
        &format!("{a}.kv_a_proj_with_mqa.weight"),
        kvr + dr,
        d,
        fp8,
    ));
    t.push(norm(seed, &format!("{a}.kv_a_layernorm.weight"), kvr));
    t.extend(proj(
        seed,
        &format!("{a}.kv_b_proj.weight"),
        nh * (dn + dv),
        kvr,
        fp8,
    ));
    t.extend(proj(seed, &format!("{a}.o_proj.weight"), d, nh * dv, fp8));
    if s.has_indexer(l) {
        let ix = format!("{a}.indexer");
        let (ni, di) = (s.index_n_heads, s.index_head_dim);
        t.extend(proj(seed, &format!("{ix}.wq_b.weight"), ni * di, qr, fp8));
        t.extend(proj(seed, &format!("{ix}.wk.weight"), di, d, fp8));
        t.push(norm(seed, &format!("{ix}.k_norm.weight"), di));
        t.push(bf16_tensor(
            seed,
            &format!("{ix}.k_norm.bias"),
            vec![di],
            0.0,
            0.1,
        ));
        t.extend(proj(
            seed,
            &format!("{ix}.weights_proj.weight"),
            ni,
            d,
            false,
        ));
    }
    let m = format!("{p}.mlp");
    if s.is_moe(l) {
        let spread = 1.7 / (d as f32).sqrt();
        t.push(f32_tensor(
            seed,
            &format!("{m}.gate.weight"),
            vec![s.experts, d],
            0.0,
            spread,
        ));
        t.push(f32_tensor(
            seed,
            &format!("{m}.gate.e_score_correction_bias"),
            vec![s.experts],
            0.0,
            0.01,
        ));
        let shared = s.moe_inter * s.shared_experts;
        if shared > 0 {
            mlp(t, seed, &format!("{m}.shared_experts"), d, shared, fp8);
        }
    } else {
        mlp(t, seed, &m, d, s.intermediate, fp8);
    }
}

/// Writes a synthetic `glm_moe_dsa` checkpoint of `shapes` to `dir`: `config.json` and
/// safetensors shards (the embedding; per layer one shard of its attention, indexer and dense
/// MLP or router and shared experts, plus one per 32 routed experts; the final norm and LM
/// head), block FP8 in the release's layout when `fp8` (module docs). Deterministic in
/// `seed`. Memory: one shard's bytes per thread (at most 32 real-shape experts, 1.2 GB, or a
/// 1.9 GB embedding), shards being written in parallel.
///
/// # Errors
/// [`ModelError::Config`] when `shapes.indexer_pattern` does not start with `F` or holds
/// another character than `F`/`S`; [`ModelError::Io`] when `dir` cannot be written;
/// [`ModelError::Safetensors`] if a shard cannot be serialised.
pub fn write_glm_moe_dsa(
    dir: &Path,
    shapes: &GlmShapes,
    fp8: bool,
    seed: u64,
) -> Result<SynthReport, ModelError> {
    let pat = shapes.indexer_pattern;
    if !pat.starts_with('F') || pat.bytes().any(|c| c != b'F' && c != b'S') {
        return Err(ModelError::Config(format!(
            "glm_moe_dsa synth: indexer_pattern `{pat}` must be F/S characters starting with F"
        )));
    }
    write_config(dir, &shapes.config_json(fp8))?;
    let units = shapes.units();
    let d = shapes.hidden;
    let (bytes, files) = write_shards(dir, units.len(), str::to_string, |shard| {
        let mut t: Vec<Raw> = Vec::new();
        match units[shard] {
            Unit::Embed => t.push(bf16_tensor(
                seed,
                "model.embed_tokens.weight",
                vec![shapes.vocab, d],
                0.0,
                0.03,
            )),
            Unit::Layer(l) => layer_tensors(&mut t, shapes, l, fp8, seed),
            Unit::Experts(l, from, to) => {
                for e in from..to {
                    let q = format!("model.layers.{l}.mlp.experts.{e}");
                    mlp(&mut t, seed, &q, d, shapes.moe_inter, fp8);
                }
            }
            Unit::Head => {
                t.push(norm(seed, "model.norm.weight", d));
                t.push(bf16_tensor(
                    seed,
                    "lm_head.weight",
                    vec![shapes.vocab, d],
                    0.0,
                    0.03,
                ));
            }
        }
        t
    })?;
    Ok(SynthReport {
        parameters: shapes.parameters(),
        bytes,
        files,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::glm_moe_dsa::{GlmMoeDsaConfig, IndexerType};

    /// A scaled-down shape set: the release's structure (dense layers first, MLA with both
    /// LoRA latents, the DSA indexer), small numbers; an IndexShare pattern so both indexer
    /// kinds are written, and an index_topk below the token count so the selection bites.
    fn small() -> GlmShapes {
        GlmShapes {
            hidden: 256,
            vocab: 300,
            layers: 4,
            first_k_dense: 2,
            intermediate: 320,
            heads: 4,
            q_lora_rank: 128,
            kv_lora_rank: 64,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 32,
            index_n_heads: 4,
            index_head_dim: 32,
            index_topk: 3,
            indexer_pattern: "FFS",
            experts: 40,
            top_k: 4,
            shared_experts: 1,
            moe_inter: 64,
            ..GlmShapes::RELEASE
        }
    }

    #[test]
    fn the_synthetic_fp8_checkpoint_loads_and_runs_as_glm_moe_dsa() {
        let t = tempfile::tempdir().unwrap();
        let s = small();
        let r = write_glm_moe_dsa(t.path(), &s, true, 7).unwrap();
        let m = crate::synth::open_and_run(t.path(), &[1, 2, 3, 4, 5, 6]);
        assert_eq!(m.config().num_hidden_layers, 4);
        assert_eq!(m.config().hidden_size, 256);
        // embed, 4 layers, 2 MoE layers × 2 expert shards (40 experts, 32 a shard), head.
        assert_eq!(r.files.len(), 1 + 4 + 2 * 2 + 1);
        // FP8 projections (1 byte) beside BF16 embeddings and F32 routers: between 1 and 2
        // bytes a parameter, so the count is not a formula drifting from the writer.
        assert!(r.bytes > r.parameters && r.bytes < 2 * r.parameters);
    }

    #[test]
    fn the_written_config_reads_back_as_the_shapes() {
        let s = small();
        let c = GlmMoeDsaConfig::from_json(&s.config_json(true)).unwrap();
        let got = GlmShapes {
            hidden: c.hidden_size,
            vocab: c.vocab_size,
            layers: c.num_hidden_layers,
            first_k_dense: c.sparse_mlp.iter().take_while(|moe| !**moe).count(),
            intermediate: c.intermediate_size,
            heads: c.num_attention_heads,
            q_lora_rank: c.q_lora_rank,
            kv_lora_rank: c.kv_lora_rank,
            qk_nope_head_dim: c.qk_nope_head_dim,
            qk_rope_head_dim: c.qk_rope_head_dim,
            v_head_dim: c.v_head_dim,
            index_n_heads: c.index_n_heads,
            index_head_dim: c.index_head_dim,
            index_topk: c.index_topk,
            indexer_pattern: s.indexer_pattern,
            experts: c.n_routed_experts,
            top_k: c.num_experts_per_tok,
            shared_experts: c.n_shared_experts,
            moe_inter: c.moe_intermediate_size,
            rope_theta: c.rope_theta,
        };
        assert_eq!(got, s);
        assert_eq!(c.num_key_value_heads, s.heads);
        assert_eq!(c.sparse_mlp, vec![false, false, true, true]);
        use IndexerType::{Full, Shared};
        assert_eq!(c.indexer_types, vec![Full, Full, Shared, Full]);
        // The release's shapes read back too, dense layers first.
        let r = GlmShapes {
            layers: 5,
            ..GlmShapes::RELEASE
        };
        let c = GlmMoeDsaConfig::from_json(&r.config_json(true)).unwrap();
        assert_eq!(c.sparse_mlp, vec![false, false, false, true, true]);
        assert_eq!(c.indexer_types, vec![Full; 5]);
        assert_eq!((c.hidden_size, c.qk_head_dim()), (6144, 256));
    }

    #[test]
    fn the_release_shapes_count_glm5s_744b_parameters() {
        // GLM-5 technical report: 744B total parameters (the MTP layer is not counted here).
        let p = GlmShapes::RELEASE.parameters() as f64;
        assert!((p / 744e9 - 1.0).abs() < 0.001, "{p}");
    }

    #[test]
    fn an_indexer_pattern_that_starts_shared_is_refused() {
        let t = tempfile::tempdir().unwrap();
        let s = GlmShapes {
            indexer_pattern: "SF",
            ..small()
        };
        let e = write_glm_moe_dsa(t.path(), &s, true, 7).unwrap_err();
        assert!(e.to_string().contains("indexer_pattern"), "{e}");
    }
}
