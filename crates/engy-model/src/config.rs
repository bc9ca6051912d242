//! `config.json` of the devnet checkpoint, with Hugging Face `transformers` field names for
//! `Qwen3ForCausalLM` (`model_type` `qwen3`) and `Qwen3MoeForCausalLM` (`qwen3_moe`).
use serde::{Deserialize, Serialize};

/// The fields of a Qwen3 / Qwen3-MoE `config.json` this crate reads and writes.
///
/// Names and meaning follow `transformers`' `Qwen3Config` / `Qwen3MoeConfig`. A layer `i` uses
/// the sparse MoE block when `num_experts > 0`, `i` is not in `mlp_only_layers` and
/// `(i + 1) % decoder_sparse_step == 0` (the rule of `Qwen3MoeDecoderLayer`); otherwise it uses
/// the dense SwiGLU MLP of width `intermediate_size`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qwen3Config {
    /// `["Qwen3ForCausalLM"]` or `["Qwen3MoeForCausalLM"]`.
    pub architectures: Vec<String>,
    /// Always false for Qwen3.
    #[serde(default)]
    pub attention_bias: bool,
    /// Unused at inference (0.0).
    #[serde(default)]
    pub attention_dropout: f64,
    /// Id of `<|endoftext|>`.
    pub bos_token_id: u32,
    /// Id of `<|im_end|>` (the ChatML end of turn).
    pub eos_token_id: u32,
    /// Width of one attention head.
    pub head_dim: usize,
    /// `"silu"` (SwiGLU).
    pub hidden_act: String,
    /// Model width `d`.
    pub hidden_size: usize,
    /// Std of the reference initialiser (informational).
    #[serde(default)]
    pub initializer_range: f64,
    /// Width of the dense MLP.
    pub intermediate_size: usize,
    /// Longest sequence (prompt + output) the model accepts.
    pub max_position_embeddings: usize,
    /// `qwen3` or `qwen3_moe`.
    pub model_type: String,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Key/value heads (grouped-query attention: `num_attention_heads % num_key_value_heads == 0`).
    pub num_key_value_heads: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Whether `lm_head` shares `embed_tokens` (false here: separate `lm_head.weight`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// `"bfloat16"`.
    pub torch_dtype: String,
    /// `transformers` version the format follows.
    pub transformers_version: String,
    /// Always true.
    #[serde(default = "yes")]
    pub use_cache: bool,
    /// Always false (no sliding window).
    #[serde(default)]
    pub use_sliding_window: bool,
    /// Vocabulary size (rows of `embed_tokens` and `lm_head`).
    pub vocab_size: usize,
    /// Routed experts per MoE layer (0 or absent: dense model).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub num_experts: usize,
    /// Experts each token is routed to.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub num_experts_per_tok: usize,
    /// Width of one expert's SwiGLU MLP.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub moe_intermediate_size: usize,
    /// Every `decoder_sparse_step`-th layer is sparse.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub decoder_sparse_step: usize,
    /// Renormalise the top-k routing weights to sum to 1.
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Layers forced to the dense MLP.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

fn yes() -> bool {
    true
}
fn one() -> usize {
    1
}
fn is_zero(v: &usize) -> bool {
    *v == 0
}
fn is_one(v: &usize) -> bool {
    *v == 1
}

impl Qwen3Config {
    /// Whether layer `i` uses the sparse MoE block (rule of `Qwen3MoeDecoderLayer`).
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.num_experts > 0
            && self.decoder_sparse_step > 0
            && !self.mlp_only_layers.contains(&i)
            && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Checks the shape invariants the forward pass relies on.
    ///
    /// # Errors
    /// A message naming the first violated invariant.
    pub fn validate(&self) -> Result<(), String> {
        let checks: [(bool, &str); 9] = [
            (self.hidden_size > 0, "hidden_size must be > 0"),
            (self.vocab_size > 0, "vocab_size must be > 0"),
            (self.num_hidden_layers > 0, "num_hidden_layers must be > 0"),
            (
                self.num_attention_heads > 0,
                "num_attention_heads must be > 0",
            ),
            (
                self.num_key_value_heads > 0
                    && self
                        .num_attention_heads
                        .is_multiple_of(self.num_key_value_heads),
                "num_attention_heads must be a multiple of num_key_value_heads",
            ),
            (
                self.head_dim > 0 && self.head_dim.is_multiple_of(2),
                "head_dim must be even and > 0",
            ),
            (
                self.max_position_embeddings > 0,
                "max_position_embeddings must be > 0",
            ),
            (
                self.num_experts == 0
                    || (self.num_experts_per_tok > 0
                        && self.num_experts_per_tok <= self.num_experts
                        && self.moe_intermediate_size > 0),
                "MoE needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0",
            ),
            (
                self.hidden_act == "silu",
                "hidden_act must be \"silu\" (SwiGLU)",
            ),
        ];
        for (ok, msg) in checks {
            if !ok {
                return Err(msg.to_string());
            }
        }
        Ok(())
    }
}
