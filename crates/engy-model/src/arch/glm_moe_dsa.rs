//! `glm_moe_dsa` (GLM-5.x, `GlmMoeDsaForCausalLM`): MLA attention with low-rank q/kv
//! projections, the DSA ("DeepSeek sparse attention") indexer that keeps `index_topk` keys per
//! query, dense first layers, and sigmoid-routed MoE layers with `e_score_correction_bias` and
//! shared experts.
//!
//! The numerics follow transformers' `models/glm_moe_dsa` (5.x, which builds on `deepseek_v3`
//! and `deepseek_v32`), computed in f32 from f32 (dequantised) weights:
//!
//! * every norm is an RMSNorm `w * x * rsqrt(mean(x²) + eps)`; `input_layernorm`,
//!   `post_attention_layernorm` and `model.norm` use `rms_norm_eps`, the MLA latent norms
//!   `q_a_layernorm` / `kv_a_layernorm` use 1e-6 (`DeepseekV3RMSNorm`'s default);
//! * MLA: `q_resid = q_a_layernorm(q_a_proj x)`, `q = q_b_proj q_resid` per head
//!   `[q_nope | q_rot]`; `kv_a_proj_with_mqa x = [c | k_rot]` (one rope head shared by all heads),
//!   `kv_b_proj kv_a_layernorm(c)` per head `[k_nope | v]`; softmax scale
//!   `(qk_nope_head_dim + qk_rope_head_dim)^-0.5`;
//! * RoPE is transformers' `apply_rotary_pos_emb_interleave`: the rope slice is de-interleaved
//!   (`[x0, x2, …, x1, x3, …]`) and rotated split-half with `inv_freq[i] = θ^(-2i/d)`,
//!   `d = qk_rope_head_dim`;
//! * the DSA indexer (layers whose `indexer_types` entry is `"full"`):
//!   `q_i = indexer.wq_b(q_resid)` per head `[rot | pass]`, `k_i = LayerNorm(indexer.wk x)`
//!   (eps 1e-6, one head), interleaved RoPE on both rot slices;
//!   `I(t, s) = Σ_h w_h(t) · relu(q_i,h(t)·k_i(s) · index_head_dim^-0.5)` with
//!   `w(t) = indexer.weights_proj(x) · index_n_heads^-0.5`; query `t` attends only its
//!   `index_topk` highest-scoring causal keys (all of them when it has no more). A `"shared"`
//!   layer (GLM-5.2 IndexShare) has no indexer and reuses the previous layer's selection;
//! * MLP: `mlp_layer_types` (default: the first `first_k_dense_replace` layers dense SwiGLU);
//!   MoE: `s = sigmoid(x Wᵀ)` in f32, choice `s + e_score_correction_bias`, group-limited
//!   (`n_group` / `topk_group`, group score = sum of its top-2 choices), top
//!   `num_experts_per_tok` by choice, weights `s` of the chosen experts divided by their sum
//!   (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`; plus the shared experts
//!   (width `moe_intermediate_size · n_shared_experts`) unscaled;
//! * the final hidden state is `model.norm`'s output (the LM head's input).
//!
//! With [`Compute::Bf16`] every module's output is rounded to bf16 where transformers' bf16
//! model rounds it (`GlmMoeDsaRMSNorm` rounds the normalised row, then the product with its
//! weight; RoPE multiplies by bf16 `cos`/`sin`; the router and the indexer scores stay f32 as
//! transformers keeps them; the routed experts' weighted sum is f32, rounded once, as
//! transformers' `grouped_mm` experts compute it; attention accumulates in f32 and rounds its
//! output, as SDPA does): an honest bf16 serve's rows, recomputed.
//!
//! Keys with exactly equal index scores at the `index_topk` boundary are taken in
//! `LoadOptions::dsa_ties` order (lower index first by default; see [`super::TieOrder`]).
//!
//! Decoding with a [`Cache`] keeps each layer's expanded keys and values and each full layer's
//! indexer keys; a new query's DSA selection is the top-k over the same causal keys as in the
//! teacher-forced pass, so both paths select the same keys.
use std::sync::Arc;

use candle_core::{DType, Tensor};
use serde_json::Value;

use super::dsa_kernels;
use super::experts;
use super::fused_attention;
use super::ops::{self, linear_t};
use super::{
    Architecture, Cache, LayerCache, LoadOptions, Probe, RouteScores, RoutingShape, SeqPass,
    TextConfig, Weights,
};
use crate::device::{count_host_step, phase, HostStep};
use crate::{Compute, ModelError};

/// Epsilon of the MLA latent RMSNorms (`DeepseekV3RMSNorm(q_lora_rank)` and
/// `DeepseekV3RMSNorm(kv_lora_rank)` are built without `eps`, so they use its default).
const LATENT_NORM_EPS: f64 = 1e-6;
/// Epsilon of the indexer's key LayerNorm (`nn.LayerNorm(index_head_dim, eps=1e-6)`).
const INDEXER_NORM_EPS: f64 = 1e-6;

/// Per-layer DSA indexer mode (`indexer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexerType {
    /// The layer runs its own indexer.
    Full,
    /// The layer reuses the previous layer's top-k selection (GLM-5.2 IndexShare).
    Shared,
}

/// The `config.json` fields of a `glm_moe_dsa` checkpoint the forward pass uses, with
/// transformers' names. Parsed by [`GlmMoeDsaConfig::from_json`], which accepts transformers 4
/// (`rope_theta`, `torch_dtype`) and 5 (`rope_parameters`, `dtype`) spellings and a config
/// nested under `text_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct GlmMoeDsaConfig {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Width of the dense layers' SwiGLU MLP.
    pub intermediate_size: usize,
    /// Width of one routed expert (and, times `n_shared_experts`, of the shared experts).
    pub moe_intermediate_size: usize,
    /// Decoder layers (an MTP layer stored after them is not part of the model).
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Key/value heads (equal to `num_attention_heads` in released GLM-5.x checkpoints).
    pub num_key_value_heads: usize,
    /// Shared experts per MoE layer.
    pub n_shared_experts: usize,
    /// Routed experts per MoE layer.
    pub n_routed_experts: usize,
    /// Factor on the routing weights.
    pub routed_scaling_factor: f32,
    /// Rank of the compressed KV latent.
    pub kv_lora_rank: usize,
    /// Rank of the compressed query latent (the indexer reads it).
    pub q_lora_rank: usize,
    /// Rotary part of a query/key head.
    pub qk_rope_head_dim: usize,
    /// Non-rotary part of a query/key head.
    pub qk_nope_head_dim: usize,
    /// Value head width.
    pub v_head_dim: usize,
    /// Expert groups for group-limited routing.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Experts per token.
    pub num_experts_per_tok: usize,
    /// Renormalise the chosen experts' scores.
    pub norm_topk_prob: bool,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// Epsilon of the residual-stream RMSNorms.
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Keys each query keeps after the DSA selection.
    pub index_topk: usize,
    /// Indexer head width.
    pub index_head_dim: usize,
    /// Indexer heads.
    pub index_n_heads: usize,
    /// Per-layer indexer mode.
    pub indexer_types: Vec<IndexerType>,
    /// Per-layer MLP: `true` = MoE ("sparse"), `false` = dense.
    pub sparse_mlp: Vec<bool>,
    /// Biases on `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub attention_bias: bool,
    /// `lm_head` shares `embed_tokens`.
    pub tie_word_embeddings: bool,
}

fn cfg_err(msg: impl Into<String>) -> ModelError {
    ModelError::Config(msg.into())
}

fn req_usize(v: &Value, key: &str) -> Result<usize, ModelError> {
    v.get(key)
        .and_then(Value::as_u64)
        .and_then(|x| usize::try_from(x).ok())
        .ok_or_else(|| cfg_err(format!("glm_moe_dsa: `{key}` is missing or not an integer")))
}

fn opt_usize(v: &Value, key: &str, default: usize) -> Result<usize, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(_) => req_usize(v, key),
    }
}

fn opt_f64(v: &Value, key: &str, default: f64) -> Result<f64, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_f64()
            .ok_or_else(|| cfg_err(format!("glm_moe_dsa: `{key}` is not a number"))),
    }
}

fn opt_bool(v: &Value, key: &str, default: bool) -> Result<bool, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| cfg_err(format!("glm_moe_dsa: `{key}` is not a boolean"))),
    }
}

fn str_list(v: &Value, key: &str) -> Result<Option<Vec<String>>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| cfg_err(format!("glm_moe_dsa: `{key}` holds a non-string")))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(cfg_err(format!("glm_moe_dsa: `{key}` is not a list"))),
    }
}

impl GlmMoeDsaConfig {
    /// Parses a `glm_moe_dsa` `config.json` (or its `text_config`).
    ///
    /// Defaults for absent fields are those of transformers' `GlmMoeDsaConfig`; shapes
    /// (`hidden_size`, head and latent widths, expert counts, …) are required. `indexer_types`
    /// falls back to `index_topk_pattern` (`"FSS…"` or a list), then to the
    /// `index_topk_freq` / `index_skip_topk_offset` schedule (default: every layer full), as in
    /// `GlmMoeDsaConfig.__post_init__`. `mlp_layer_types` falls back to
    /// `first_k_dense_replace` dense layers then MoE.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the field that is missing, malformed or inconsistent,
    /// including a RoPE type other than `default` (YaRN scaling is not implemented).
    pub fn from_json(root: &Value) -> Result<Self, ModelError> {
        let v = match root.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => root,
        };
        let num_hidden_layers = req_usize(v, "num_hidden_layers")?;
        let num_attention_heads = req_usize(v, "num_attention_heads")?;
        let q_lora_rank = match v.get("q_lora_rank") {
            Some(Value::Null) | None => return Err(cfg_err(
                "glm_moe_dsa: `q_lora_rank` is required (the DSA indexer reads the query latent)",
            )),
            Some(_) => req_usize(v, "q_lora_rank")?,
        };
        // RoPE: transformers 5 `rope_parameters`, transformers 4 `rope_theta` + `rope_scaling`.
        let rope_params = v.get("rope_parameters").filter(|p| p.is_object());
        let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
            Some(t) => t.as_f64().ok_or_else(|| {
                cfg_err("glm_moe_dsa: `rope_parameters.rope_theta` is not a number")
            })?,
            None => opt_f64(v, "rope_theta", 10000.0)?,
        };
        let scaling = rope_params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
        let rope_type = scaling
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(cfg_err(format!(
                "glm_moe_dsa: rope type `{rope_type}` is not supported (only `default`)"
            )));
        }
        if let Some(f) = scaling.and_then(|p| p.get("partial_rotary_factor")) {
            if f.as_f64() != Some(1.0) {
                return Err(cfg_err(
                    "glm_moe_dsa: `partial_rotary_factor` other than 1 is not supported",
                ));
            }
        }
        let first_k_dense_replace = opt_usize(v, "first_k_dense_replace", 3)?;
        let sparse_mlp = match str_list(v, "mlp_layer_types")? {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    "sparse" => Ok(true),
                    "dense" => Ok(false),
                    other => Err(cfg_err(format!(
                        "glm_moe_dsa: `mlp_layer_types` entry `{other}` is neither dense nor sparse"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => (0..num_hidden_layers)
                .map(|i| i >= first_k_dense_replace)
                .collect(),
        };
        let indexer_types = match str_list(v, "indexer_types")? {
            Some(types) => types
                .iter()
                .map(|t| parse_indexer_type(t))
                .collect::<Result<Vec<_>, _>>()?,
            None => match v.get("index_topk_pattern") {
                Some(Value::String(p)) => p
                    .chars()
                    .map(|c| match c {
                        'F' => Ok(IndexerType::Full),
                        'S' => Ok(IndexerType::Shared),
                        other => Err(cfg_err(format!(
                            "glm_moe_dsa: `index_topk_pattern` character `{other}` is neither F nor S"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
                Some(Value::Array(_)) => str_list(v, "index_topk_pattern")?
                    .unwrap_or_default()
                    .iter()
                    .map(|t| parse_indexer_type(t))
                    .collect::<Result<Vec<_>, _>>()?,
                _ => {
                    let freq = opt_usize(v, "index_topk_freq", 1)?.max(1);
                    let offset = opt_usize(v, "index_skip_topk_offset", 2)?;
                    (0..num_hidden_layers)
                        .map(|i| {
                            if (i + 1).saturating_sub(offset) % freq == 0 {
                                IndexerType::Full
                            } else {
                                IndexerType::Shared
                            }
                        })
                        .collect()
                }
            },
        };
        let cfg = Self {
            vocab_size: req_usize(v, "vocab_size")?,
            hidden_size: req_usize(v, "hidden_size")?,
            intermediate_size: req_usize(v, "intermediate_size")?,
            moe_intermediate_size: req_usize(v, "moe_intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: opt_usize(v, "num_key_value_heads", num_attention_heads)?,
            n_shared_experts: opt_usize(v, "n_shared_experts", 1)?,
            n_routed_experts: req_usize(v, "n_routed_experts")?,
            routed_scaling_factor: opt_f64(v, "routed_scaling_factor", 2.5)? as f32,
            kv_lora_rank: req_usize(v, "kv_lora_rank")?,
            q_lora_rank,
            qk_rope_head_dim: req_usize(v, "qk_rope_head_dim")?,
            qk_nope_head_dim: req_usize(v, "qk_nope_head_dim")?,
            v_head_dim: req_usize(v, "v_head_dim")?,
            n_group: opt_usize(v, "n_group", 1)?,
            topk_group: opt_usize(v, "topk_group", 1)?,
            num_experts_per_tok: req_usize(v, "num_experts_per_tok")?,
            norm_topk_prob: opt_bool(v, "norm_topk_prob", true)?,
            max_position_embeddings: opt_usize(v, "max_position_embeddings", 202_752)?,
            rms_norm_eps: opt_f64(v, "rms_norm_eps", 1e-5)?,
            rope_theta,
            index_topk: opt_usize(v, "index_topk", 2048)?,
            index_head_dim: opt_usize(v, "index_head_dim", 128)?,
            index_n_heads: opt_usize(v, "index_n_heads", 32)?,
            indexer_types,
            sparse_mlp,
            attention_bias: opt_bool(v, "attention_bias", false)?,
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings", false)?,
        };
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(cfg_err(format!(
                    "glm_moe_dsa: hidden_act `{act}` is not supported (only silu)"
                )));
            }
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the invariants the forward pass relies on.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the first violated invariant.
    pub fn validate(&self) -> Result<(), ModelError> {
        let l = self.num_hidden_layers;
        let checks: [(bool, &str); 13] = [
            (self.hidden_size > 0 && self.vocab_size > 0, "hidden_size and vocab_size must be > 0"),
            (l > 0, "num_hidden_layers must be > 0"),
            (
                self.num_attention_heads > 0
                    && self.num_key_value_heads > 0
                    && self.num_attention_heads.is_multiple_of(self.num_key_value_heads),
                "num_attention_heads must be a positive multiple of num_key_value_heads",
            ),
            (
                self.qk_rope_head_dim > 0 && self.qk_rope_head_dim.is_multiple_of(2),
                "qk_rope_head_dim must be even and > 0",
            ),
            (
                self.v_head_dim > 0 && self.kv_lora_rank > 0 && self.q_lora_rank > 0,
                "v_head_dim, kv_lora_rank and q_lora_rank must be > 0",
            ),
            (
                self.index_head_dim >= self.qk_rope_head_dim && self.index_n_heads > 0,
                "index_head_dim must be >= qk_rope_head_dim and index_n_heads > 0",
            ),
            (self.index_topk > 0, "index_topk must be > 0"),
            (
                self.indexer_types.len() >= l,
                "indexer_types must have an entry per layer",
            ),
            (
                self.indexer_types.first() != Some(&IndexerType::Shared),
                "indexer_types[0] must be full (a shared layer reuses a previous selection)",
            ),
            (
                self.sparse_mlp.len() >= l,
                "mlp_layer_types must have an entry per layer",
            ),
            (
                self.n_routed_experts > 0
                    && self.num_experts_per_tok > 0
                    && self.num_experts_per_tok <= self.n_routed_experts
                    && self.moe_intermediate_size > 0,
                "MoE needs 0 < num_experts_per_tok <= n_routed_experts and moe_intermediate_size > 0",
            ),
            (
                self.n_group > 0
                    && self.n_routed_experts.is_multiple_of(self.n_group)
                    && self.topk_group > 0
                    && self.topk_group <= self.n_group,
                "n_group must divide n_routed_experts and 0 < topk_group <= n_group",
            ),
            (
                self.n_group == 1 || self.n_routed_experts / self.n_group >= 2,
                "group-limited routing needs at least 2 experts per group",
            ),
        ];
        for (ok, msg) in checks {
            if !ok {
                return Err(cfg_err(format!("glm_moe_dsa: {msg}")));
            }
        }
        let chosen = self.topk_group * (self.n_routed_experts / self.n_group);
        if chosen < self.num_experts_per_tok {
            return Err(cfg_err(
                "glm_moe_dsa: topk_group groups hold fewer experts than num_experts_per_tok",
            ));
        }
        Ok(())
    }

    /// Width of one query/key head.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

fn parse_indexer_type(t: &str) -> Result<IndexerType, ModelError> {
    match t {
        "full" => Ok(IndexerType::Full),
        "shared" => Ok(IndexerType::Shared),
        other => Err(cfg_err(format!(
            "glm_moe_dsa: indexer type `{other}` is neither full nor shared"
        ))),
    }
}

/// What one forward pass decided and produced per layer (for debugging against the
/// reference's `layer_<l>_<k>`, `experts_<l>_<k>` and `dsa_mask_<l>_<k>` tensors).
#[derive(Debug, Clone, Default)]
pub struct GlmTrace {
    /// Residual stream after each layer, `[rows, hidden]` per layer.
    pub residuals: Vec<Tensor>,
    /// Routed experts per row (sorted ascending), `None` for dense layers.
    pub experts: Vec<Option<Vec<Vec<usize>>>>,
    /// Keys each query row attends after the DSA selection and the causal mask (absolute
    /// positions, sorted ascending).
    pub attended: Vec<Vec<Vec<usize>>>,
}

/// The loaded `glm_moe_dsa` model. Weights are read from [`Weights`] as each layer runs (with
/// [`Residency::Streaming`](crate::Residency::Streaming) nothing stays decoded between layers).
///
/// Cache per layer ([`LayerCache`]): `[k, v]` or, on full-indexer layers, `[k, v, index_k]`
/// with `k` `[heads, positions, qk_head_dim]`, `v` `[heads, positions, v_head_dim]` and
/// `index_k` `[positions, index_head_dim]`.
pub struct GlmMoeDsa {
    text: TextConfig,
    cfg: GlmMoeDsaConfig,
    w: Arc<Weights>,
    inv_freq: Vec<f32>,
    score_budget: usize,
    compute: Compute,
    /// How products with block-FP8 weights treat their input rows (W8A16 or W8A8).
    acts: super::Fp8Activations,
    attention: super::AttentionKernel,
    dsa_ties: super::TieOrder,
}

/// A DSA layer's kept key positions per query row: on the host, or still on the GPU where
/// its top-k ran there (`[T, index_topk]` u32, [`dsa_kernels::topk_mask`]), copied back only
/// when a record asks for it ([`Selection::host`]), so a plain audit pass copies nothing.
enum Selection {
    Host(Vec<Vec<usize>>),
    Device(Tensor),
}

impl Selection {
    /// Query rows.
    fn rows(&self) -> Result<usize, ModelError> {
        Ok(match self {
            Selection::Host(v) => v.len(),
            Selection::Device(t) => t.dim(0)?,
        })
    }

    /// Per row its kept positions in the selection's order (a copy from the device for a
    /// device selection).
    fn host(&self) -> Result<std::borrow::Cow<'_, [Vec<usize>]>, ModelError> {
        Ok(match self {
            Selection::Host(v) => std::borrow::Cow::Borrowed(v.as_slice()),
            Selection::Device(t) => std::borrow::Cow::Owned(dsa_kernels::selection_rows(t)?),
        })
    }
}

/// Default [`GlmMoeDsa::with_score_budget`] on the CPU: 2^24 f32 (64 MiB) per score block.
pub const DEFAULT_SCORE_BUDGET: usize = 1 << 24;

/// Default [`GlmMoeDsa::with_score_budget`] on a GPU: 2^26 f32 (256 MiB) per score block
/// (256 query rows of MLA's 64 heads at 4,096 keys), so that each block's GEMMs and kernels
/// are big enough to fill the device (MLA's attention holds about 2.5 times the block at
/// once: its f32 scores and the exponentials as three bf16 planes). Measured on an H200
/// (GLM-5, 5 layers, 4,096 tokens, resident): 1.29 to 1.30 s an audit against 1.73 to
/// 1.75 s at 2^24 and 1.42 to 1.50 s at 2^28, the reports byte-identical at all three
/// (docs/AUDITOR.md "On a GPU").
pub const DEFAULT_SCORE_BUDGET_GPU: usize = 1 << 26;

impl std::fmt::Debug for GlmMoeDsa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlmMoeDsa").field("cfg", &self.cfg).finish()
    }
}

/// Loads a `glm_moe_dsa` checkpoint (see [`GlmMoeDsa::load`]).
///
/// # Errors
/// As [`GlmMoeDsa::load`].
pub fn load(
    cfg: TextConfig,
    weights: Arc<Weights>,
    opts: &LoadOptions,
) -> Result<Box<dyn Architecture>, ModelError> {
    Ok(Box::new(GlmMoeDsa::load(cfg, weights, opts)?))
}

/// Top-`k` indices of `scores` (descending; ties: lower index first).
fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    ops::topk_indices(scores, k)
}

/// `inv_freq[i] = 1 / theta^(2i / d)` for `i < d / 2`, in f32 as transformers computes it
/// (`1.0 / base ** (arange(0, d, 2).float() / d)`).
fn inv_freq(theta: f64, d: usize) -> Vec<f32> {
    let base = theta as f32;
    (0..d / 2)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
        .collect()
}

/// transformers' `apply_rotary_pos_emb_interleave`, in place: `x` holds rows of `heads`
/// vectors of `stride` values whose rope slice (`2 * inv_freq.len()` values) starts at `start`;
/// row `r` is at position `pos0 + r`. The slice is de-interleaved (`[x0, x2, …, x1, x3, …]`)
/// and rotated split-half, so pair `(x[2i], x[2i+1])` turns by `pos · inv_freq[i]` and is
/// written to `(out[i], out[i + d/2])`.
/// With [`Compute::Bf16`], `cos`/`sin` are bf16 and each product and sum is rounded to bf16
/// (`q1 * cos - q2 * sin` on bf16 tensors).
fn rope_inplace(
    inv_freq: &[f32],
    x: &mut [f32],
    heads: usize,
    stride: usize,
    start: usize,
    pos0: usize,
    c: Compute,
) {
    let rb = |v: f32| c.round_f32(v);
    let half = inv_freq.len();
    let mut y = vec![0f32; 2 * half];
    for (r, row) in x.chunks_mut(heads * stride).enumerate() {
        let p = (pos0 + r) as f32;
        for head in row.chunks_mut(stride) {
            let s = &mut head[start..start + 2 * half];
            for i in 0..half {
                y[i] = s[2 * i];
                y[half + i] = s[2 * i + 1];
            }
            for (i, f) in inv_freq.iter().enumerate() {
                let (sin, cos) = (p * f).sin_cos();
                let (sin, cos) = (rb(sin), rb(cos));
                s[i] = rb(rb(y[i] * cos) - rb(y[half + i] * sin));
                s[half + i] = rb(rb(y[half + i] * cos) + rb(y[i] * sin));
            }
        }
    }
}

/// [`rope_inplace`] as tensor operations on `x` `[t, heads, stride]` (row `r` at position
/// `pos0 + r`), for a tensor on a GPU: the same angles, taken on the host in f32 as
/// [`rope_inplace`] takes them (`[t, d/2]` cos and sin, copied up), and the same products and
/// roundings, so the values are the host's exactly.
///
/// # Errors
/// Candle errors when the rope slice does not fit in `stride`.
fn rope_tensor(
    inv_freq: &[f32],
    x: &Tensor,
    start: usize,
    pos0: usize,
    c: Compute,
) -> Result<Tensor, ModelError> {
    let (t, heads, stride) = x.dims3()?;
    let half = inv_freq.len();
    let dev = x.device();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for r in 0..t {
        let p = (pos0 + r) as f32;
        for f in inv_freq {
            let (s, co) = (p * f).sin_cos();
            sin.push(c.round_f32(s));
            cos.push(c.round_f32(co));
        }
    }
    let cos = Tensor::from_vec(cos, (t, 1, half), dev)?;
    let sin = Tensor::from_vec(sin, (t, 1, half), dev)?;
    // De-interleave: pair i is (x[start + 2i], x[start + 2i + 1]).
    let pairs = x
        .narrow(2, start, 2 * half)?
        .contiguous()?
        .reshape((t, heads, half, 2))?;
    let even = pairs.narrow(3, 0, 1)?.squeeze(3)?;
    let odd = pairs.narrow(3, 1, 1)?.squeeze(3)?;
    let turn = |a: &Tensor, b: &Tensor| c.round(a.broadcast_mul(b)?);
    let first = c.round((turn(&even, &cos)? - turn(&odd, &sin)?)?)?;
    let second = c.round((turn(&odd, &cos)? + turn(&even, &sin)?)?)?;
    let mut parts = Vec::with_capacity(4);
    if start > 0 {
        parts.push(x.narrow(2, 0, start)?);
    }
    parts.push(first);
    parts.push(second);
    let end = start + 2 * half;
    if end < stride {
        parts.push(x.narrow(2, end, stride - end)?);
    }
    // candle concatenates along a later dimension through a transposed view: made
    // contiguous, as the products that read it on a GPU require.
    Ok(Tensor::cat(&parts, 2)?.contiguous()?)
}

/// The routing rule of one token (transformers' `route_tokens_to_experts`), scoring half:
/// `s = sigmoid(logits)` and the choice scores `s + bias`; with `n_group > 1` only the
/// `topk_group` groups with the largest sum of their top-2 choices compete (the others' choice
/// scores are set to −inf). Returns `(s, choice)`; the own top `num_experts_per_tok` by choice
/// is `top_k(&choice, ..)`, and [`route_weights`] weights whichever experts are dispatched.
fn route_scores(c: &GlmMoeDsaConfig, logits: &[f32], bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let per_group = c.n_routed_experts / c.n_group;
    let s: Vec<f32> = logits.iter().map(|&z| 1.0 / (1.0 + (-z).exp())).collect();
    let mut choice: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    if c.n_group > 1 {
        let group_scores: Vec<f32> = choice
            .chunks(per_group)
            .map(|g| top_k(g, 2).iter().map(|&i| g[i]).sum())
            .collect();
        let keep = top_k(&group_scores, c.topk_group);
        for (gi, g) in choice.chunks_mut(per_group).enumerate() {
            if !keep.contains(&gi) {
                g.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            }
        }
    }
    (s, choice)
}

/// The weighting half of the routing rule: the `chosen` experts (choice order) get weight `s`
/// (not the choice score), divided by the sum of the chosen `s` (+1e-20) when
/// `norm_topk_prob`, times `routed_scaling_factor`.
fn route_weights(c: &GlmMoeDsaConfig, s: &[f32], chosen: &[usize]) -> Vec<(usize, f32)> {
    let mut w: Vec<f32> = chosen
        .iter()
        .map(|&e| s.get(e).copied().unwrap_or(0.0))
        .collect();
    if c.norm_topk_prob {
        let denom = w.iter().sum::<f32>() + 1e-20;
        w.iter_mut().for_each(|x| *x /= denom);
    }
    w.iter_mut().for_each(|x| *x *= c.routed_scaling_factor);
    chosen.iter().copied().zip(w).collect()
}

/// Both halves of the routing rule: the own top `num_experts_per_tok` and their weights.
#[cfg(test)]
fn route(c: &GlmMoeDsaConfig, logits: &[f32], bias: &[f32]) -> Vec<(usize, f32)> {
    let (s, choice) = route_scores(c, logits, bias);
    route_weights(c, &s, &top_k(&choice, c.num_experts_per_tok))
}

impl GlmMoeDsa {
    /// Reads the `glm_moe_dsa` fields of `text` ([`GlmMoeDsaConfig::from_json`] on its raw
    /// text config) and checks every tensor the forward pass uses (decoding them now when
    /// [`Weights::preloads`](super::Weights::preloads), else checking only their presence).
    /// The activations are computed in `opts.compute` (see the module documentation).
    ///
    /// # Errors
    /// [`ModelError::Config`] for missing or inconsistent settings, [`ModelError::MissingTensor`]
    /// / [`ModelError::Shape`] when the checkpoint does not match them.
    pub fn load(text: TextConfig, w: Arc<Weights>, opts: &LoadOptions) -> Result<Self, ModelError> {
        let cfg = GlmMoeDsaConfig::from_json(&text.raw)?;
        let inv_freq = inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim);
        let w_on_cpu = w.device().is_cpu();
        let m = Self {
            text,
            cfg,
            w,
            inv_freq,
            score_budget: if w_on_cpu {
                DEFAULT_SCORE_BUDGET
            } else {
                DEFAULT_SCORE_BUDGET_GPU
            },
            compute: opts.compute,
            acts: opts.fp8_activations,
            attention: opts.attention,
            dsa_ties: opts.dsa_ties,
        };
        m.check_tensors()?;
        Ok(m)
    }

    /// Caps the attention and indexer score blocks at about `floats` f32 values (`[heads, rows,
    /// keys]`) by processing the query rows in blocks: at GLM-5's 64 heads and 8k keys a
    /// whole-sequence score tensor would be 16 GiB. Blocking does not change any value (each
    /// row is computed alone); 0 is treated as 1 row per block.
    pub fn with_score_budget(mut self, floats: usize) -> Self {
        self.score_budget = floats;
        self
    }

    /// Query rows per score block of `heads × keys` values each (at least 1).
    fn row_block(&self, heads: usize, keys: usize) -> usize {
        (self.score_budget / (heads * keys).max(1)).max(1)
    }

    /// The `glm_moe_dsa` settings.
    pub fn glm_config(&self) -> &GlmMoeDsaConfig {
        &self.cfg
    }

    /// Fetches (or, streaming, looks up) every weight once so that errors surface at load.
    fn check_tensors(&self) -> Result<(), ModelError> {
        let c = &self.cfg;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let w = &*self.w;
        let streaming = !w.preloads();
        // What each tensor is fetched as in the forward pass (so that, resident, the decoded
        // form the forward pass asks for is the one cached).
        #[derive(Clone, Copy)]
        enum As {
            Plain,
            Projection,
            Matrix,
        }
        let need = |name: String, shape: Vec<usize>, how: As| -> Result<(), ModelError> {
            if streaming {
                // Plain tensors from the header now; matrices (maybe quantised) on use.
                return match (how, w.has(&name)) {
                    (As::Plain, _) => w.check_stored(&name, &shape),
                    (_, true) => Ok(()),
                    (_, false) => Err(ModelError::MissingTensor(w.resolve(&name))),
                };
            }
            let module = name.trim_end_matches(".weight");
            match (how, shape.as_slice()) {
                (As::Projection, &[o, i]) => w.projection_t(module, o, i).map(drop),
                (As::Matrix, &[o, i]) => w.matrix_t(module, o, i).map(drop),
                _ => w.tensor_shaped(&name, &shape).map(drop),
            }
        };
        need("model.embed_tokens.weight".into(), vec![v, d], As::Plain)?;
        need("model.norm.weight".into(), vec![d], As::Plain)?;
        if !c.tie_word_embeddings {
            need("lm_head.weight".into(), vec![v, d], As::Matrix)?;
        }
        let (nh, nkv, dn, dr, dv, qr, kvr) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.q_lora_rank,
            c.kv_lora_rank,
        );
        let (ni, di) = (c.index_n_heads, c.index_head_dim);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            need(format!("{p}.input_layernorm.weight"), vec![d], As::Plain)?;
            need(
                format!("{p}.post_attention_layernorm.weight"),
                vec![d],
                As::Plain,
            )?;
            need(format!("{a}.q_a_proj.weight"), vec![qr, d], As::Projection)?;
            need(format!("{a}.q_a_layernorm.weight"), vec![qr], As::Plain)?;
            need(
                format!("{a}.q_b_proj.weight"),
                vec![nh * (dn + dr), qr],
                As::Projection,
            )?;
            need(
                format!("{a}.kv_a_proj_with_mqa.weight"),
                vec![kvr + dr, d],
                As::Projection,
            )?;
            need(format!("{a}.kv_a_layernorm.weight"), vec![kvr], As::Plain)?;
            need(
                format!("{a}.kv_b_proj.weight"),
                vec![nkv * (dn + dv), kvr],
                As::Projection,
            )?;
            need(
                format!("{a}.o_proj.weight"),
                vec![d, nh * dv],
                As::Projection,
            )?;
            if c.attention_bias {
                need(format!("{a}.q_a_proj.bias"), vec![qr], As::Plain)?;
                need(
                    format!("{a}.kv_a_proj_with_mqa.bias"),
                    vec![kvr + dr],
                    As::Plain,
                )?;
                need(format!("{a}.o_proj.bias"), vec![d], As::Plain)?;
            }
            if c.indexer_types[l] == IndexerType::Full {
                let ix = format!("{a}.indexer");
                need(
                    format!("{ix}.wq_b.weight"),
                    vec![ni * di, qr],
                    As::Projection,
                )?;
                need(format!("{ix}.wk.weight"), vec![di, d], As::Projection)?;
                need(format!("{ix}.k_norm.weight"), vec![di], As::Plain)?;
                need(format!("{ix}.k_norm.bias"), vec![di], As::Plain)?;
                need(format!("{ix}.weights_proj.weight"), vec![ni, d], As::Matrix)?;
            }
            let mlp = |q: String, inter: usize| -> Result<(), ModelError> {
                need(
                    format!("{q}.gate_proj.weight"),
                    vec![inter, d],
                    As::Projection,
                )?;
                need(
                    format!("{q}.up_proj.weight"),
                    vec![inter, d],
                    As::Projection,
                )?;
                need(
                    format!("{q}.down_proj.weight"),
                    vec![d, inter],
                    As::Projection,
                )
            };
            if c.sparse_mlp[l] {
                let ne = c.n_routed_experts;
                need(format!("{p}.mlp.gate.weight"), vec![ne, d], As::Matrix)?;
                need(
                    format!("{p}.mlp.gate.e_score_correction_bias"),
                    vec![ne],
                    As::Plain,
                )?;
                for e in 0..ne {
                    mlp(format!("{p}.mlp.experts.{e}"), c.moe_intermediate_size)?;
                }
                mlp(
                    format!("{p}.mlp.shared_experts"),
                    c.moe_intermediate_size * c.n_shared_experts,
                )?;
            } else {
                mlp(format!("{p}.mlp"), c.intermediate_size)?;
            }
        }
        Ok(())
    }

    fn norm(&self, name: &str, len: usize) -> Result<Tensor, ModelError> {
        self.w.tensor_shaped(name, &[len])
    }

    fn bias(&self, name: &str, len: usize) -> Result<Option<Tensor>, ModelError> {
        if self.cfg.attention_bias {
            Ok(Some(self.norm(name, len)?))
        } else {
            Ok(None)
        }
    }

    /// [`rope_inplace`] on the rows of `x` (`[t, heads · stride]`, position `pos0 + r` for row
    /// `r`), returned as `[t, heads, stride]`: on the host for a CPU tensor ([`HostStep::Rope`]
    /// counts it), else by [`rope_tensor`] on the device, with the same values.
    fn rope(
        &self,
        x: &Tensor,
        heads: usize,
        stride: usize,
        start: usize,
        pos0: usize,
    ) -> Result<Tensor, ModelError> {
        let t = x.dim(0)?;
        let dev = x.device();
        if !dev.is_cpu() {
            let x = x.reshape((t, heads, stride))?;
            return rope_tensor(&self.inv_freq, &x, start, pos0, self.compute);
        }
        count_host_step(dev, HostStep::Rope);
        let mut v = x.flatten_all()?.to_vec1::<f32>()?;
        rope_inplace(
            &self.inv_freq,
            &mut v,
            heads,
            stride,
            start,
            pos0,
            self.compute,
        );
        Ok(Tensor::from_vec(v, (t, heads, stride), dev)?)
    }

    /// `x · Wᵀ` (+ the bias `<module>.bias` when the config has attention biases) for the
    /// projection `module` `[out, inp]`: the f32 product of the weight as the recompute holds
    /// it, unrounded, on every device. (bf16 products on a GPU, as Qwen's projections run,
    /// moved one honest bf16 serve of the audit oracle's GLM FP8 checkpoint past the
    /// threshold, 41 > 40 mismatches: docs/AUDITOR.md "On a GPU".)
    fn proj(
        &self,
        module: &str,
        x: &Tensor,
        out: usize,
        inp: usize,
        biased: bool,
    ) -> Result<Tensor, ModelError> {
        let cm = self.compute;
        let b = if biased {
            self.bias(&format!("{module}.bias"), out)?
        } else {
            None
        };
        let y = if self.acts == super::Fp8Activations::PerTokenGroup && self.w.is_block_fp8(module)
        {
            self.w.linear_as(module, x, out, inp, cm, self.acts)?
        } else {
            linear_t(x, &self.w.projection_t_in(module, out, inp, cm)?)?
        };
        Ok(match b {
            Some(b) => y.broadcast_add(&b)?,
            None => y,
        })
    }

    /// [`Architecture::forward`] that also records each layer's expert choices and attended
    /// keys into `trace` (and its residual output, as `layers` does).
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`],
    /// weight errors; `cache` is left unchanged on error.
    pub fn forward_traced(
        &self,
        ids: &[u32],
        cache: &mut Cache,
        trace: Option<&mut GlmTrace>,
    ) -> Result<Tensor, ModelError> {
        self.forward_probed(ids, cache, trace, &mut Probe::default())
    }

    /// [`GlmMoeDsa::forward_traced`] with a [`Probe`] as well.
    fn forward_probed(
        &self,
        ids: &[u32],
        cache: &mut Cache,
        mut trace: Option<&mut GlmTrace>,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        let mut st = self.begin(ids, cache)?;
        for l in 0..self.cfg.num_hidden_layers {
            self.layer(l, &mut st, cache, trace.as_deref_mut(), probe)?;
        }
        self.finish(st, ids.len(), cache)
    }

    /// Checks `ids` and `cache`, and embeds `ids`: a pass's state before layer 0.
    fn begin(&self, ids: &[u32], cache: &Cache) -> Result<GlmPass, ModelError> {
        let c = &self.cfg;
        let off = cache.len;
        self.check_ids(ids, off)?;
        cache.check_continuable()?;
        if cache.keeps_layers() && cache.layers.len() != c.num_hidden_layers {
            return Err(cfg_err(format!(
                "glm_moe_dsa: the cache has {} layers, the model {}",
                cache.layers.len(),
                c.num_hidden_layers
            )));
        }
        let cm = self.compute;
        let dev = self.w.device().clone();
        let x = phase(&dev, "embedding", || {
            Ok(cm.round(self.w.rows("model.embed_tokens.weight", ids)?)?)
        })?;
        Ok(GlmPass {
            x,
            off,
            selection: None,
            new_layers: Vec::with_capacity(c.num_hidden_layers),
        })
    }

    /// Decoder layer `l` on `st`: the input norm, MLA attention with the DSA selection (the
    /// previous layer's selection handed on for a shared indexer), the residual add, the
    /// post-attention norm, the MoE block or dense MLP, the residual add.
    fn layer(
        &self,
        l: usize,
        st: &mut GlmPass,
        cache: &Cache,
        trace: Option<&mut GlmTrace>,
        probe: &mut Probe<'_>,
    ) -> Result<(), ModelError> {
        let c = &self.cfg;
        let hd = c.hidden_size;
        let cm = self.compute;
        let dev = self.w.device().clone();
        let off = st.off;
        let p = format!("model.layers.{l}");
        if l >= c.num_hidden_layers {
            return Err(cfg_err(format!("glm_moe_dsa: no decoder layer {l}")));
        }
        // A one-pass cache (`Cache::one_pass`) has no past: it is at position 0.
        let past = cache.layers.get(l).map_or(&[][..], |lc| lc.0.as_slice());
        let h = phase(&dev, "norms and residual adds", || {
            let ln1 = self.norm(&format!("{p}.input_layernorm.weight"), hd)?;
            Ok(ops::rms_norm_in(&st.x, &ln1, c.rms_norm_eps, cm)?)
        })?;
        let prev = st.selection.take();
        let count_ties = probe.dsa_boundary_ties.is_some();
        let (attn, layer_cache, sel, ties) = phase(&dev, "mla attention", || {
            self.attention(l, &h, off, past, prev, count_ties)
        })?;
        if let Some(n) = probe.dsa_boundary_ties.as_deref_mut() {
            *n += ties;
        }
        // The kept positions come to the host only for the records that ask for them.
        let kept = if probe.attended.is_some() || trace.is_some() {
            Some(sel.host()?.into_owned())
        } else {
            None
        };
        if let Some(kept) = &kept {
            probe.push_attended(l, off, kept);
        }
        crate::device::trace("glm attention output", &attn);
        let (x2, h2) = phase(&dev, "norms and residual adds", || {
            let x2 = cm.round((&st.x + attn)?)?;
            let ln2 = self.norm(&format!("{p}.post_attention_layernorm.weight"), hd)?;
            let h2 = ops::rms_norm_in(&x2, &ln2, c.rms_norm_eps, cm)?;
            Ok((x2, h2))
        })?;
        st.x = x2;
        let (mlp, experts) = if c.sparse_mlp.get(l).copied().unwrap_or(false) {
            let (y, e) = phase(&dev, "moe", || self.moe(l, &p, &h2, off, probe))?;
            (y, Some(e))
        } else {
            let y = phase(&dev, "dense mlp", || {
                ops::swiglu_as(
                    &self.w,
                    &format!("{p}.mlp"),
                    &h2,
                    (hd, c.intermediate_size),
                    cm,
                    self.acts,
                )
            })?;
            (y, None)
        };
        crate::device::trace("glm mlp output", &mlp);
        st.x = phase(&dev, "norms and residual adds", || {
            Ok(cm.round((&st.x + mlp)?)?)
        })?;
        probe.push_layer(&st.x);
        if let Some(tr) = trace {
            tr.residuals.push(st.x.clone());
            tr.experts.push(experts);
            let mut kept = kept.unwrap_or_default();
            kept.iter_mut().for_each(|s| s.sort_unstable());
            tr.attended.push(kept);
        }
        st.selection = Some(sel);
        if cache.keeps_layers() {
            st.new_layers.push(layer_cache);
        }
        Ok(())
    }

    /// The final norm of a pass over `n` ids; `cache` takes the layers' caches.
    fn finish(&self, st: GlmPass, n: usize, cache: &mut Cache) -> Result<Tensor, ModelError> {
        let c = &self.cfg;
        let dev = self.w.device().clone();
        let out = phase(&dev, "norms and residual adds", || {
            let w = self.norm("model.norm.weight", c.hidden_size)?;
            Ok(ops::rms_norm_in(&st.x, &w, c.rms_norm_eps, self.compute)?)
        })?;
        cache.layers = st.new_layers;
        cache.len = st.off + n;
        Ok(out)
    }

    /// Checks that `ids` may follow `cached` positions.
    fn check_ids(&self, ids: &[u32], cached: usize) -> Result<(), ModelError> {
        if ids.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(ModelError::TokenOutOfVocab {
                id,
                vocab: self.cfg.vocab_size,
            });
        }
        let len = cached.saturating_add(ids.len());
        if len > self.cfg.max_position_embeddings {
            return Err(ModelError::TooLong {
                len,
                max: self.cfg.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// MLA attention with the DSA selection for the `t` rows of `h` at positions
    /// `off..off + t`. Returns the attention output `[t, hidden]`, the layer's new cache, the
    /// selection (per row, the absolute key positions it attends) and, with `count_ties`, how
    /// many rows of a layer with its own indexer cut through a tie (`GlmMoeDsa::indexer`).
    #[allow(clippy::type_complexity)]
    fn attention(
        &self,
        l: usize,
        h: &Tensor,
        off: usize,
        past: &[Tensor],
        prev_sel: Option<Selection>,
        count_ties: bool,
    ) -> Result<(Tensor, LayerCache, Selection, usize), ModelError> {
        let c = &self.cfg;
        let dev = h.device().clone();
        let t = h.dim(0)?;
        let total = off + t;
        let (hd, nh, nkv) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads);
        let (dn, dr, dv, qr, kvr) = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.q_lora_rank,
            c.kv_lora_rank,
        );
        let dqk = dn + dr;
        let cm = self.compute;
        let a = format!("model.layers.{l}.self_attn");
        let (past_k, past_v, past_ik) = match past {
            [] => (None, None, None),
            [k, v] => (Some(k), Some(v), None),
            [k, v, ik] => (Some(k), Some(v), Some(ik)),
            _ => return Err(cfg_err("glm_moe_dsa: the cache belongs to another model")),
        };
        if past_k.map(|k| k.dim(1)).transpose()?.unwrap_or(0) != off {
            return Err(cfg_err("glm_moe_dsa: the cache does not match its length"));
        }
        let (q_resid, q, k_all, v_all) = phase(&dev, "mla attention: projections", || {
            // Query latent and queries [nh, t, dqk].
            let q_resid = ops::rms_norm_in(
                &cm.round(self.proj(&format!("{a}.q_a_proj"), h, qr, hd, true)?)?,
                &self.norm(&format!("{a}.q_a_layernorm.weight"), qr)?,
                LATENT_NORM_EPS,
                cm,
            )?;
            let q =
                cm.round(self.proj(&format!("{a}.q_b_proj"), &q_resid, nh * dqk, qr, false)?)?;
            let q = self
                .rope(&q, nh, dqk, dn, off)?
                .transpose(0, 1)?
                .contiguous()?;
            // Keys [nkv, t, dqk] (one rope head shared by all) and values [nkv, t, dv].
            let ckv =
                cm.round(self.proj(&format!("{a}.kv_a_proj_with_mqa"), h, kvr + dr, hd, true)?)?;
            let latent = ops::rms_norm_in(
                &ckv.narrow(1, 0, kvr)?,
                &self.norm(&format!("{a}.kv_a_layernorm.weight"), kvr)?,
                LATENT_NORM_EPS,
                cm,
            )?;
            let k_rot = self
                .rope(&ckv.narrow(1, kvr, dr)?.contiguous()?, 1, dr, 0, off)?
                .reshape((1, t, dr))?;
            let kv = cm
                .round(self.proj(
                    &format!("{a}.kv_b_proj"),
                    &latent,
                    nkv * (dn + dv),
                    kvr,
                    false,
                )?)?
                .reshape((t, nkv, dn + dv))?
                .transpose(0, 1)?; // [nkv, t, dn + dv]
            let k_new = Tensor::cat(
                &[&kv.narrow(2, 0, dn)?, &k_rot.broadcast_as((nkv, t, dr))?],
                2,
            )?;
            let v_new = kv.narrow(2, dn, dv)?.contiguous()?;
            let (k_all, v_all) = match (past_k, past_v) {
                (Some(pk), Some(pv)) => (
                    Tensor::cat(&[pk, &k_new], 1)?,
                    Tensor::cat(&[pv, &v_new], 1)?,
                ),
                _ => (k_new, v_new),
            };
            Ok((q_resid, q, k_all, v_all))
        })?;
        // DSA selection, and the mask from it: on a GPU both are made there
        // (`dsa_kernels`), else on the host.
        let mut ties = 0;
        let (sel, index_k, device_mask) = match c.indexer_types[l] {
            IndexerType::Full => {
                let (sel, ik, mask, n) = phase(h.device(), "mla attention: dsa indexer", || {
                    self.indexer(&a, h, &q_resid, off, past_ik, count_ties)
                })?;
                ties = n;
                (sel, Some(ik), mask)
            }
            IndexerType::Shared => match prev_sel {
                Some(s) if s.rows()? == t => {
                    let mask = phase(&dev, "mla attention: dsa mask", || {
                        Ok(match &s {
                            Selection::Host(v) => dsa_kernels::mask(v, off, total, &dev)?,
                            Selection::Device(d) => dsa_kernels::mask_from(d, off, total)?,
                        })
                    })?;
                    (s, None, mask)
                }
                _ => {
                    return Err(cfg_err(format!(
                    "glm_moe_dsa: layer {l} is a shared indexer layer without a previous selection"
                )))
                }
            },
        };
        let mask = match device_mask {
            Some(m) => m,
            None => {
                count_host_step(&dev, HostStep::DsaTopK);
                phase(&dev, "mla attention: dsa mask", || {
                    let mut mask = vec![f32::NEG_INFINITY; t * total];
                    for (r, keys) in sel.host()?.iter().enumerate() {
                        for &s in keys {
                            if s <= off + r {
                                mask[r * total + s] = 0.0;
                            }
                        }
                    }
                    Ok(Tensor::from_vec(mask, (t, total), &dev)?)
                })?
            }
        };
        crate::device::trace("glm mla q", &q);
        crate::device::trace("glm mla keys", &k_all);
        crate::device::trace("glm mla values", &v_all);
        crate::device::trace("glm mla mask", &mask);
        let scale = 1.0 / (dqk as f64).sqrt();
        let blk = self.row_block(nh, total);
        let y = phase(&dev, "mla attention: scores to output", || {
            // In a bf16 recompute q, k and v hold bf16 values: on a GPU the scores and the
            // products run on the tensor cores, the probabilities still f32
            // ([`fused_attention::attention_f32_probs`]).
            let eager = self.attention == super::AttentionKernel::Eager;
            if cm == Compute::Bf16 && !eager {
                if let Some(y) = fused_attention::attention_f32_probs(
                    &q,
                    &k_all,
                    &v_all,
                    scale,
                    Some(&mask),
                    blk,
                )? {
                    return Ok(y);
                }
            }
            // MLA's sdpa rule is SDPA's math path, f32 inside (the output is rounded below);
            // the eager rule rounds where transformers' eager attention does.
            let rounding = if eager { cm } else { Compute::F32 };
            Ok(ops::attention_eager_in(
                &q,
                &k_all,
                &v_all,
                scale,
                Some(&mask),
                blk,
                rounding,
            )?)
        })?;
        let y = cm.round(y)?; // [t, nh * dv]
        crate::device::trace("glm mla attention", &y);
        let out = phase(&dev, "mla attention: output projection", || {
            Ok(cm.round(self.proj(&format!("{a}.o_proj"), &y, hd, nh * dv, true)?)?)
        })?;
        let mut lc = vec![k_all, v_all];
        if let Some(ik) = index_k {
            lc.push(ik);
        }
        Ok((out, LayerCache(lc), sel, ties))
    }

    /// The DSA indexer of a full layer: per query row the key positions it keeps, all indexer
    /// keys so far `[off + t, index_head_dim]` (the layer's new indexer cache), on a GPU the
    /// attention mask of the kept keys `[t, off + t]`, made there with the selection
    /// ([`dsa_kernels::topk_mask`]; `None`: the caller builds it on the host), and with
    /// `count_ties` the rows whose selection cuts through a tie (exactly on the host,
    /// [`ops::topk_cuts_tie`]; never fewer on a GPU, [`dsa_kernels::rows_cutting_ties`];
    /// 0 without `count_ties`).
    #[allow(clippy::type_complexity)]
    fn indexer(
        &self,
        a: &str,
        h: &Tensor,
        q_resid: &Tensor,
        off: usize,
        past: Option<&Tensor>,
        count_ties: bool,
    ) -> Result<(Selection, Tensor, Option<Tensor>, usize), ModelError> {
        let c = &self.cfg;
        let t = h.dim(0)?;
        let total = off + t;
        let (hd, ni, di, qr) = (
            c.hidden_size,
            c.index_n_heads,
            c.index_head_dim,
            c.q_lora_rank,
        );
        let cm = self.compute;
        let ix = format!("{a}.indexer");
        let dev = h.device();
        let (qi, ki_all, w) = phase(dev, "mla attention: dsa indexer: projections", || {
            let qi = cm.round(self.proj(&format!("{ix}.wq_b"), q_resid, ni * di, qr, false)?)?;
            let qi = self.rope(&qi, ni, di, 0, off)?;
            // torch's LayerNorm on a bf16 input computes in f32 and rounds its output once.
            let ki = cm.round(ops::layer_norm(
                &cm.round(self.proj(&format!("{ix}.wk"), h, di, hd, false)?)?,
                &self.norm(&format!("{ix}.k_norm.weight"), di)?,
                &self.norm(&format!("{ix}.k_norm.bias"), di)?,
                INDEXER_NORM_EPS,
            )?)?;
            let ki = self.rope(&ki, 1, di, 0, off)?.reshape((t, di))?;
            let ki_all = match past {
                Some(old) => Tensor::cat(&[old, &ki], 0)?,
                None => ki,
            };
            if ki_all.dim(0)? != total {
                return Err(cfg_err(
                    "glm_moe_dsa: the indexer key cache does not match the sequence",
                ));
            }
            let ww = self.w.matrix_t(&format!("{ix}.weights_proj"), ni, hd)?;
            let w = (cm.round(linear_t(h, &ww)?)? * (ni as f64).powf(-0.5))?;
            Ok((qi, ki_all, w))
        })?;
        // w [t, ni]. Per block of query rows: scores [n, ni, total] = relu(q·k · di^-0.5), then
        // index [n, total] = Σ_h w_h · scores_h (rows are independent, so blocking changes
        // nothing but the memory held).
        let kt = ki_all.t()?.contiguous()?.unsqueeze(0)?; // [1, di, total]
        let blk = self.row_block(ni, total);
        // On a GPU the index rows stay there for the device's top-k.
        let on_device = dsa_kernels::applies(h.device(), total);
        let mut index: Vec<Vec<f32>> = Vec::with_capacity(if on_device { 0 } else { t });
        let mut device_rows = Vec::new();
        phase(dev, "mla attention: dsa indexer: scores", || {
            for r0 in (0..t).step_by(blk) {
                let n = blk.min(t - r0);
                let scores = (qi
                    .narrow(0, r0, n)?
                    .matmul(&kt.broadcast_as((n, di, total))?)?
                    * (di as f64).powf(-0.5))?
                .relu()?;
                let rows = w
                    .narrow(0, r0, n)?
                    .unsqueeze(1)?
                    .matmul(&scores)?
                    .squeeze(1)?;
                if on_device {
                    device_rows.push(rows);
                } else {
                    index.extend(rows.to_vec2::<f32>()?);
                }
            }
            Ok(())
        })?;
        if on_device {
            let rows = Tensor::cat(&device_rows, 0)?;
            if let Some((sel, mask, ties)) =
                phase(dev, "mla attention: dsa indexer: top-k", || {
                    let Some((sel, mask)) =
                        dsa_kernels::topk_mask(&rows, off, c.index_topk, self.dsa_ties)?
                    else {
                        return Ok(None);
                    };
                    let ties = if count_ties {
                        dsa_kernels::rows_cutting_ties(&rows, &sel, off, c.index_topk)?
                    } else {
                        0
                    };
                    Ok(Some((sel, mask, ties)))
                })?
            {
                return Ok((Selection::Device(sel), ki_all, Some(mask), ties));
            }
            index = rows.to_vec2::<f32>()?;
        }
        // Row by row in parallel: 4,096 rows of 4,096 keys take about a second on one core.
        use rayon::prelude::*;
        let (sel, cut): (Vec<Vec<usize>>, Vec<bool>) = index
            .par_iter()
            .enumerate()
            .map(|(r, row)| {
                // Keys after the query are masked (finfo.min): a query with no more than
                // index_topk causal keys keeps them all.
                let causal = off + r + 1;
                if causal <= c.index_topk {
                    ((0..causal).collect(), false)
                } else {
                    let row = &row[..causal];
                    let kept = ops::topk_indices_ordered(row, c.index_topk, self.dsa_ties);
                    let cut = count_ties && ops::topk_cuts_tie(row, &kept);
                    (kept, cut)
                }
            })
            .unzip();
        let ties = cut.iter().filter(|&&c| c).count();
        Ok((Selection::Host(sel), ki_all, None, ties))
    }

    /// The MoE block of layer `l` (tensor prefix `p`) on `h [t, hidden]` at positions `off..`:
    /// output and each row's dispatched experts (sorted ascending); the routing goes through
    /// `probe` ([`Probe::route`]).
    fn moe(
        &self,
        l: usize,
        p: &str,
        h: &Tensor,
        off: usize,
        probe: &mut Probe<'_>,
    ) -> Result<(Tensor, Vec<Vec<usize>>), ModelError> {
        let c = &self.cfg;
        let hd = c.hidden_size;
        let (ne, mi) = (c.n_routed_experts, c.moe_intermediate_size);
        let m = format!("{p}.mlp");
        let router = self.w.matrix_t(&format!("{m}.gate"), ne, hd)?;
        let bias = self
            .w
            .tensor_shaped(&format!("{m}.gate.e_score_correction_bias"), &[ne])?
            .to_vec1::<f32>()?;
        count_host_step(h.device(), HostStep::Routing);
        let logits = linear_t(h, &router)?.to_vec2::<f32>()?;
        let (s, choice): (Vec<Vec<f32>>, Vec<Vec<f32>>) =
            logits.iter().map(|row| route_scores(c, row, &bias)).unzip();
        let own = choice
            .iter()
            .map(|ch| top_k(ch, c.num_experts_per_tok))
            .collect();
        let used = probe.route(l, off, &logits, RouteScores::new(&choice), own);
        let routes: Vec<Vec<(usize, f32)>> = used
            .iter()
            .zip(&s)
            .map(|(u, s)| route_weights(c, s, u))
            .collect();
        let cm = self.compute;
        // The weighted sum of the routed experts stays f32 and is rounded once (transformers'
        // grouped_mm experts: bf16 expert outputs times f32 weights, summed over top-k in f32).
        let routed = cm.round(if experts::grouped(&self.w) {
            let module = |e: usize| format!("{m}.experts.{e}");
            let acts = self.acts;
            experts::dispatch(&self.w, module, None, h, &routes, (hd, mi), cm, acts, false)?
        } else {
            ops::moe_dispatch(h, &routes, |e, rows| {
                let module = format!("{m}.experts.{e}");
                ops::swiglu_as(&self.w, &module, rows, (hd, mi), cm, self.acts)
            })?
        })?;
        let shared = ops::swiglu_as(
            &self.w,
            &format!("{m}.shared_experts"),
            h,
            (hd, mi * c.n_shared_experts),
            cm,
            self.acts,
        )?;
        let experts = routes
            .into_iter()
            .map(|rt| {
                let mut e: Vec<usize> = rt.into_iter().map(|(e, _)| e).collect();
                e.sort_unstable();
                e
            })
            .collect();
        probe.push_shared(&shared);
        let y = cm.round((routed + shared)?)?;
        probe.push_block(l, off, h, &y);
        Ok((y, experts))
    }
}

/// One sequence's state between decoder layers of a pass ([`GlmMoeDsa::layer`]).
struct GlmPass {
    /// The residual stream `[T, hidden]`.
    x: Tensor,
    /// The sequence's first position.
    off: usize,
    /// The last layer's DSA selection, for the next layer's shared indexer.
    selection: Option<Selection>,
    /// The layers' caches made so far, in layer order.
    new_layers: Vec<LayerCache>,
}

impl Architecture for GlmMoeDsa {
    fn config(&self) -> &TextConfig {
        &self.text
    }

    fn forward(
        &self,
        ids: &[u32],
        cache: &mut Cache,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        self.forward_probed(ids, cache, None, probe)
    }

    fn forward_many(&self, seqs: &mut [SeqPass<'_, '_>]) -> Result<Vec<Tensor>, ModelError> {
        // Layer by layer for every sequence, each layer's weights read and decoded once
        // (`Weights::hold`), released before the next layer's are read.
        let _held = self.w.held();
        let mut states = seqs
            .iter()
            .map(|s| self.begin(s.ids, s.cache))
            .collect::<Result<Vec<_>, _>>()?;
        for l in 0..self.cfg.num_hidden_layers {
            for (st, s) in states.iter_mut().zip(seqs.iter_mut()) {
                self.layer(l, st, s.cache, None, s.probe)?;
            }
            self.w.release_held();
        }
        states
            .into_iter()
            .zip(seqs.iter_mut())
            .map(|(st, s)| self.finish(st, s.ids.len(), s.cache))
            .collect()
    }

    fn moe_block(
        &self,
        layer: usize,
        x: &Tensor,
        first: usize,
        probe: &mut Probe<'_>,
    ) -> Result<Option<Tensor>, ModelError> {
        if !self.cfg.sparse_mlp.get(layer).copied().unwrap_or(false) {
            return Ok(None);
        }
        let x = self.compute.round(x.to_dtype(DType::F32)?)?;
        let p = format!("model.layers.{layer}");
        Ok(Some(self.moe(layer, &p, &x, first, probe)?.0))
    }

    fn routing_shape(&self) -> Option<RoutingShape> {
        let c = &self.cfg;
        c.sparse_mlp.iter().any(|&s| s).then_some(RoutingShape {
            layers: c.num_hidden_layers,
            top_k: c.num_experts_per_tok,
            experts: c.n_routed_experts,
        })
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        let (v, hd) = (self.cfg.vocab_size, self.cfg.hidden_size);
        let name = if self.cfg.tie_word_embeddings {
            "model.embed_tokens"
        } else {
            "lm_head"
        };
        let wt = self.w.matrix_t(name, v, hd)?;
        Ok(linear_t(&hidden.to_dtype(DType::F32)?, &wt)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_json() -> Value {
        serde_json::json!({
            "model_type": "glm_moe_dsa",
            "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "moe_intermediate_size": 8, "num_hidden_layers": 4, "num_attention_heads": 2,
            "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4,
            "qk_nope_head_dim": 4, "v_head_dim": 4, "index_topk": 3, "index_head_dim": 8,
            "index_n_heads": 2, "first_k_dense_replace": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
        })
    }

    #[test]
    fn config_defaults_follow_transformers() {
        let c = GlmMoeDsaConfig::from_json(&tiny_json()).unwrap();
        assert_eq!(c.sparse_mlp, vec![false, true, true, true]);
        assert_eq!(c.indexer_types, vec![IndexerType::Full; 4]);
        assert_eq!((c.n_group, c.topk_group, c.n_shared_experts), (1, 1, 1));
        assert!(c.norm_topk_prob);
        assert_eq!(c.rms_norm_eps, 1e-5);
        assert_eq!(c.rope_theta, 10000.0);
    }

    #[test]
    fn config_reads_transformers_4_names_and_text_config() {
        let mut j = tiny_json();
        let o = j.as_object_mut().unwrap();
        o.remove("rope_parameters");
        o.insert("rope_theta".into(), serde_json::json!(1e6));
        let nested = serde_json::json!({"model_type": "x", "text_config": j.clone()});
        for v in [&j, &nested] {
            assert_eq!(GlmMoeDsaConfig::from_json(v).unwrap().rope_theta, 1e6);
        }
    }

    #[test]
    fn indexer_schedule_fallbacks() {
        use IndexerType::{Full as F, Shared as S};
        let mut j = tiny_json();
        j["index_topk_pattern"] = serde_json::json!("FSFS");
        assert_eq!(
            GlmMoeDsaConfig::from_json(&j).unwrap().indexer_types,
            [F, S, F, S]
        );
        j["index_topk_pattern"] = serde_json::json!(["full", "shared", "shared", "full"]);
        assert_eq!(
            GlmMoeDsaConfig::from_json(&j).unwrap().indexer_types,
            [F, S, S, F]
        );
        let mut j = tiny_json();
        // transformers: "full" if max(i - offset + 1, 0) % freq == 0.
        j["index_topk_freq"] = serde_json::json!(2);
        j["index_skip_topk_offset"] = serde_json::json!(2);
        assert_eq!(
            GlmMoeDsaConfig::from_json(&j).unwrap().indexer_types,
            [F, F, S, F]
        );
        j["indexer_types"] = serde_json::json!(["full", "full", "shared", "full"]);
        assert_eq!(
            GlmMoeDsaConfig::from_json(&j).unwrap().indexer_types,
            [F, F, S, F]
        );
    }

    #[test]
    fn config_errors_name_the_field() {
        let mut j = tiny_json();
        j["indexer_types"] = serde_json::json!(["shared", "full", "full", "full"]);
        let e = GlmMoeDsaConfig::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("indexer_types[0]"), "{e}");
        let mut j = tiny_json();
        j["rope_parameters"] =
            serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4});
        let e = GlmMoeDsaConfig::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("yarn"), "{e}");
        let mut j = tiny_json();
        j.as_object_mut().unwrap().remove("kv_lora_rank");
        let e = GlmMoeDsaConfig::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("kv_lora_rank"), "{e}");
        let mut j = tiny_json();
        j["q_lora_rank"] = Value::Null;
        let e = GlmMoeDsaConfig::from_json(&j).unwrap_err().to_string();
        assert!(e.contains("q_lora_rank"), "{e}");
        let mut j = tiny_json();
        j["indexer_types"] = serde_json::json!(["full", "sparse", "full", "full"]);
        assert!(GlmMoeDsaConfig::from_json(&j).is_err());
    }

    /// The device rope (tensor operations, here on the CPU backend) is the host rope exactly:
    /// a rope slice inside the head (values before and after it), several heads, a position
    /// offset, f32 and bf16 roundings.
    #[test]
    fn the_tensor_rope_is_the_host_rope() {
        let f = inv_freq(1e4, 4);
        let (t, heads, stride, start, pos0) = (5, 3, 7, 2, 11);
        let x: Vec<f32> = (0..t * heads * stride)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 3.0)
            .collect();
        for c in [Compute::F32, Compute::Bf16] {
            let x: Vec<f32> = x.iter().map(|v| c.round_f32(*v)).collect();
            let mut want = x.clone();
            rope_inplace(&f, &mut want, heads, stride, start, pos0, c);
            let dev = candle_core::Device::Cpu;
            let xt = Tensor::from_vec(x.clone(), (t, heads, stride), &dev).unwrap();
            let got = rope_tensor(&f, &xt, start, pos0, c).unwrap();
            // A GPU matmul takes contiguous operands only.
            assert!(got.is_contiguous(), "{c:?}: {:?}", got.layout());
            let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(got, want, "{c:?}");
            assert_ne!(got, x, "the rope changed nothing");
        }
    }

    #[test]
    fn rope_writes_rotated_pairs_de_interleaved() {
        let f = inv_freq(10000.0, 4);
        assert_eq!(f, vec![1.0, 0.01]);
        // Position 0 rotates by nothing: only the de-interleaving shows.
        let mut x = vec![9.0, 1.0, 2.0, 3.0, 4.0];
        rope_inplace(&f, &mut x, 1, 5, 1, 0, Compute::F32);
        assert_eq!(x, vec![9.0, 1.0, 3.0, 2.0, 4.0]);
        // Pair (x[2i], x[2i+1]) turns by pos * inv_freq[i] (GPT-J / complex form).
        let (q, pos) = ([0.3f32, -1.2, 0.7, 2.0], 5usize);
        let mut y = q.to_vec();
        rope_inplace(&f, &mut y, 1, 4, 0, pos, Compute::F32);
        for i in 0..2 {
            let a = pos as f32 * f[i];
            let (re, im) = (q[2 * i], q[2 * i + 1]);
            let (want_re, want_im) = (re * a.cos() - im * a.sin(), re * a.sin() + im * a.cos());
            assert!((y[i] - want_re).abs() < 1e-6 && (y[2 + i] - want_im).abs() < 1e-6);
        }
    }

    #[test]
    fn routing_uses_bias_for_the_choice_and_groups_limit_it() {
        let mut j = tiny_json();
        j["n_group"] = serde_json::json!(4);
        j["topk_group"] = serde_json::json!(2);
        let mut c = GlmMoeDsaConfig::from_json(&j).unwrap();
        let logits = [0.0f32, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0];
        let s5 = 1.0 / (1.0 + (-1.0f32).exp());
        let bias = [0.2, 0.1, 0.5, -0.25, 0.3, 0.6, 0.1, 0.1];
        // choices 0.7 0.6 | 1.0 0.25 | 0.8 s5+0.6 | 0.6 0.6: groups 2 and 0 have the largest
        // top-2 sums, so expert 2 (choice 1.0) is out and 5, 4 win.
        let r = route(&c, &logits, &bias);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![5, 4]);
        // weights are the sigmoid scores, renormalised, times routed_scaling_factor (2.5).
        let (w5, w4) = (r[0].1, r[1].1);
        assert!((w5 - s5 / (s5 + 0.5) * 2.5).abs() < 1e-6, "{w5}");
        assert!((w4 - 0.5 / (s5 + 0.5) * 2.5).abs() < 1e-6, "{w4}");
        // Without groups expert 2 (choice 1.0) beats 4 (0.8).
        c.n_group = 1;
        c.topk_group = 1;
        let r = route(&c, &logits, &bias);
        assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![5, 2]);
        c.norm_topk_prob = false;
        let r = route(&c, &logits, &bias);
        assert!((r[0].1 - s5 * 2.5).abs() < 1e-6 && (r[1].1 - 1.25).abs() < 1e-6);
    }

    #[test]
    fn top_k_is_descending_with_lower_index_on_ties() {
        assert_eq!(top_k(&[0.5, 2.0, 2.0, -1.0, 3.0], 3), vec![4, 1, 2]);
        assert_eq!(top_k(&[1.0, 1.0], 5), vec![0, 1]);
    }
}
