//! The architecture layer: one trait for "final hidden states of a token sequence", implemented
//! per architecture and chosen from `config.json`.
//!
//! * [`Weights`] gives f32 CPU tensors by name from mmapped shards (bf16, f16, f32, block FP8,
//!   NVFP4), in the text-only tensor layout whatever the checkpoint's prefix.
//! * [`TextConfig`] reads `config.json` with transformers 4 and 5 field names.
//! * [`Architecture`] is the forward pass: teacher-forced or incremental with a [`Cache`],
//!   optionally recording every decoder layer's residual output.
//! * [`load`] dispatches on [`ArchKind`] (`model_type`, then `architectures`).
//!
//! Every implementation computes in f32 from dequantised weights with transformers' numerics
//! (the reference is transformers' fp32 eager forward; `tests/arch_vectors.rs` holds each one to
//! it), or, with [`Compute::Bf16`], rounds to bf16 where transformers' bf16 model rounds, so
//! that a bf16 serve is recomputed in bf16 (`tests/audit_oracle.rs`; docs/AUDITOR.md
//! "Recomputes"). The two differ by more than rounding: on MoE models bf16 noise flips
//! near-tied expert (and DSA key) choices, so neither recompute explains the other's serves.
use std::path::Path;
use std::sync::Arc;

use candle_core::Tensor;

use crate::{Compute, ModelError, Precision};

pub mod config;
pub mod delta_rule;
pub mod deltanet_kernels;
pub mod dsa_kernels;
pub mod expert_kernels;
pub mod experts;
pub mod fp8_kernels;
pub mod fused_attention;
pub mod glm_moe_dsa;
pub mod grouped_gemm;
#[cfg(feature = "cuda")]
mod kernels;
pub mod norm_kernels;
pub mod ops;
pub mod qlinear;
pub mod quant;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod router_kernels;
pub mod routing;
pub mod weights;

pub use config::{ArchKind, QuantConfig, TextConfig};
pub use routing::{
    BlockIo, CommittedRouting, Divergence, LayerAgreement, Margin, Probe, RouteScores,
    RoutingCheck, RoutingRecord, RoutingShape, TokenAgreement,
};
pub use weights::{Residency, Weights};

/// Whether the architecture has a DSA indexer (a top-k key selection whose ties
/// [`TieOrder`] orders).
pub fn has_dsa(kind: ArchKind) -> bool {
    kind == ArchKind::GlmMoeDsa
}

/// How a checkpoint is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// The stored weights exactly (`Bf16`: the honest serve and the auditor), or the int4 cheat
    /// applied to every projection ([`Weights::projection`]).
    pub precision: Precision,
    /// Activation dtype: f32, or bf16-rounded at the architecture's bf16 rounding points (an
    /// honest bf16 serve, and the auditor's bf16 recompute).
    pub compute: Compute,
    /// Whether dequantised weights are kept ([`Residency::Resident`]) or decoded per use
    /// ([`Residency::Streaming`], for checkpoints larger than memory at f32).
    pub residency: Residency,
    /// Which of several keys with exactly equal DSA index scores at the `index_topk` boundary
    /// a query keeps (architectures with a DSA indexer; ignored elsewhere).
    pub dsa_ties: TieOrder,
    /// Which attention kernel's rounding points a bf16 recompute follows ([`AttentionKernel`];
    /// ignored in f32, where both compute the same rule).
    pub attention: AttentionKernel,
    /// Where the weights are placed and the forward pass runs ([`crate::DeviceSpec`]).
    pub device: crate::DeviceSpec,
    /// How products with block-FP8 weights treat their input rows ([`Fp8Activations`]).
    pub fp8_activations: Fp8Activations,
}

/// How a product with a block-FP8 weight treats its input rows (docs/design/w8a8.md).
///
/// A bf16 serve of dequantised weights (transformers with `dequantize=True`, engy's bf16 and
/// f32 recomputes) multiplies the activations as they are; sglang's block-FP8 linear method
/// and fused MoE, and transformers' native FP8 path on a GPU, quantise each input row to
/// `float8_e4m3fn` per token and per group of 128 input columns first (W8A8,
/// [`quant::act_quant_rows`]). Weights stored in any other format are multiplied as they are
/// either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fp8Activations {
    /// The activations as computed (W8A16: the weight dequantised, the product in the
    /// activation dtype).
    #[default]
    Unquantised,
    /// Each input row quantised per token and per 128-group as sglang's
    /// `per_token_group_quant_fp8` does, the weight dequantised exactly, the product
    /// accumulated in f32 (W8A8).
    PerTokenGroup,
}

impl Fp8Activations {
    /// `w8a16` or `w8a8`.
    pub fn label(self) -> &'static str {
        match self {
            Fp8Activations::Unquantised => "w8a16",
            Fp8Activations::PerTokenGroup => "w8a8",
        }
    }
}

/// Whose attention a bf16 recompute follows: the rounding points differ, and on small models
/// the difference flips MoE and DSA choices often enough to fail an honest serve's batches
/// (docs/AUDITOR.md "Recomputes").
///
/// Both take bf16 `q`, `k`, `v` and accumulate every product in f32; in an f32 recompute they
/// are the same rule ([`ops::attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionKernel {
    /// A fused kernel (transformers' `attn_implementation="sdpa"`, torch's CPU
    /// `scaled_dot_product_attention`; FlashAttention and sglang's kernels on a GPU): f32
    /// scores, softmax statistics in f32, the output rounded once ([`ops::attention_in`]; MLA's
    /// unequal head widths take SDPA's math path, its probabilities f32).
    #[default]
    Sdpa,
    /// transformers' `eager_attention_forward` (`attn_implementation="eager"`): the scores
    /// rounded to bf16, scaled and rounded again, the softmax in f32 rounded to bf16, then the
    /// product with `v` rounded ([`ops::attention_eager_in`]).
    Eager,
}

impl AttentionKernel {
    /// `sdpa` or `eager` (transformers' `attn_implementation` names).
    pub fn label(self) -> &'static str {
        match self {
            AttentionKernel::Sdpa => "sdpa",
            AttentionKernel::Eager => "eager",
        }
    }
}

/// The order among exactly equal scores when a top-k selection must cut between them.
///
/// Serves differ here: torch's CPU `topk` keeps an order of its partial-sort / nth_element,
/// and sglang's radix top-k kernel for the DSA indexer takes equal values at the threshold in
/// the order its threads reach them, so no order is the serve's. The auditor therefore treats
/// a tie at the boundary as a tie: it recomputes with either order before it calls a
/// commitment a cheat ([`crate::audit::Recompute`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TieOrder {
    /// Lower index (earlier key) first.
    #[default]
    LowerFirst,
    /// Higher index (later key) first.
    HigherFirst,
}

impl TieOrder {
    /// `lower-first` or `higher-first`.
    pub fn label(self) -> &'static str {
        match self {
            TieOrder::LowerFirst => "lower-first",
            TieOrder::HigherFirst => "higher-first",
        }
    }
}

/// What one layer keeps between incremental calls. The meaning of the tensors is the
/// architecture's own (e.g. `[k, v]` of attention, `[conv_state, recurrent_state]` of a Gated
/// DeltaNet layer); empty before the first call.
#[derive(Debug, Clone, Default)]
pub struct LayerCache(pub Vec<Tensor>);

/// The state of one sequence between incremental [`Architecture::forward`] calls.
#[derive(Debug, Clone)]
pub struct Cache {
    /// Positions already processed.
    pub len: usize,
    /// One entry per decoder layer (created empty by [`Cache::new`]; left empty by a pass
    /// over a [`Cache::one_pass`]).
    pub layers: Vec<LayerCache>,
    /// Whether a pass keeps each layer's state here ([`Cache::keeps_layers`]).
    keep: bool,
}

impl Default for Cache {
    /// [`Cache::new`] of no layers.
    fn default() -> Self {
        Self::new(0)
    }
}

impl Cache {
    /// An empty cache for `layers` decoder layers.
    pub fn new(layers: usize) -> Self {
        Self {
            len: 0,
            layers: vec![LayerCache::default(); layers],
            keep: true,
        }
    }

    /// An empty cache for one teacher-forced pass that nothing continues (an audit's
    /// recompute): the pass drops each layer's state (keys, values, recurrent states) when
    /// the layer ends instead of keeping it here. At 4,096 tokens that state is about 0.2 GB
    /// for Qwen3.6's 40 layers and 0.5 GB for each GLM-5 layer (MLA's keys and values of
    /// all 64 heads, f32), held by every sequence of a batched pass
    /// ([`Architecture::forward_many`]) until its end. The hidden states are the same as with
    /// [`Cache::new`]; a second call on the same cache is refused
    /// ([`Cache::check_continuable`]).
    pub fn one_pass() -> Self {
        Self {
            len: 0,
            layers: Vec::new(),
            keep: false,
        }
    }

    /// Whether a pass keeps each layer's state in this cache (false for
    /// [`Cache::one_pass`]).
    pub fn keeps_layers(&self) -> bool {
        self.keep
    }

    /// Whether a pass may start from this cache: any cache at position 0, and one that keeps
    /// its layers' state.
    ///
    /// # Errors
    /// [`ModelError::Config`] for a [`Cache::one_pass`] a pass already ran on: it kept no
    /// state to continue from.
    pub fn check_continuable(&self) -> Result<(), ModelError> {
        if self.keep || self.len == 0 {
            return Ok(());
        }
        Err(ModelError::Config(format!(
            "this cache was made for one pass (Cache::one_pass) and already holds {} positions \
             without their layers' state: it cannot be continued",
            self.len
        )))
    }

    /// Positions already processed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was processed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// One sequence of a batched pass ([`Architecture::forward_many`]): its ids at positions
/// `cache.len ..`, its cache, and what the pass records or follows for it.
pub struct SeqPass<'a, 'p> {
    /// The ids (checked against the vocabulary and the position limit by the caller).
    pub ids: &'a [u32],
    /// The sequence's cache, advanced by the pass.
    pub cache: &'a mut Cache,
    /// The sequence's own probe ([`Probe`]).
    pub probe: &'a mut Probe<'p>,
}

/// A decoder-only text model's forward pass.
///
/// Implementations must be deterministic: the same ids give bit-identical rows, and (for the
/// devnet serve's contract) prefill and step-by-step decode of the same context agree closely
/// (bit-identical where the arithmetic allows).
pub trait Architecture: Send + Sync {
    /// The parsed config.
    fn config(&self) -> &TextConfig;

    /// Runs `ids` at positions `cache.len ..` (ids already checked against the vocabulary and
    /// `max_position_embeddings` by the caller), returns the final hidden states
    /// `[ids.len(), hidden_size]` f32 (the final norm's output, the LM head's input) and
    /// advances `cache`. `probe` says what else the pass records or follows ([`Probe`]: each
    /// decoder layer's residual output, the routing of every MoE layer, a check of that
    /// routing against a committed trace).
    ///
    /// # Errors
    /// [`ModelError`] from weight decoding or tensor operations; on error `cache` must be left
    /// as it was.
    fn forward(
        &self,
        ids: &[u32],
        cache: &mut Cache,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError>;

    /// [`Architecture::forward`] for several sequences in one pass over the weights: an
    /// implementation may run decoder layer `l` for every sequence before layer `l + 1`, so
    /// that streamed weights ([`Residency::Streaming`]) are read and decoded once per layer
    /// for all of them ([`Weights::hold`]) instead of once per sequence. Returns each
    /// sequence's final hidden states in the order of `seqs`, each exactly what
    /// [`Architecture::forward`] returns for it alone (same values, same probe records):
    /// only the order of the work changes. The default runs the sequences one after another.
    ///
    /// # Errors
    /// As [`Architecture::forward`]; on error every cache is left as it was.
    fn forward_many(&self, seqs: &mut [SeqPass<'_, '_>]) -> Result<Vec<Tensor>, ModelError> {
        let mut out = Vec::with_capacity(seqs.len());
        let before: Vec<Cache> = seqs.iter().map(|s| s.cache.clone()).collect();
        for s in seqs.iter_mut() {
            match self.forward(s.ids, s.cache, s.probe) {
                Ok(h) => out.push(h),
                Err(e) => {
                    for (s, c) in seqs.iter_mut().zip(before) {
                        *s.cache = c;
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// The shape of the model's routing trace, `None` for a model without MoE layers.
    fn routing_shape(&self) -> Option<RoutingShape>;

    /// Only the MoE block of decoder layer `layer` on `x` `[rows, hidden]` f32 (the block's
    /// input: the post-attention norm's output) for rows at positions `first..`: the block's
    /// output `[rows, hidden]` (routed + shared experts), routing through `probe` as in
    /// [`Architecture::forward`]. `None` when `layer` is dense or out of range. Reads only the
    /// tensors the block uses: the router, the experts dispatched, the shared expert.
    ///
    /// # Errors
    /// [`ModelError`] from weight decoding or a wrongly shaped `x`.
    fn moe_block(
        &self,
        layer: usize,
        x: &Tensor,
        first: usize,
        probe: &mut Probe<'_>,
    ) -> Result<Option<Tensor>, ModelError>;

    /// Logits `[rows, vocab_size]` of final hidden states `[rows, hidden_size]`.
    ///
    /// # Errors
    /// [`ModelError`] from weight decoding or a wrongly shaped `hidden`.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError>;

    /// An empty cache for one sequence.
    fn new_cache(&self) -> Cache {
        Cache::new(self.config().num_hidden_layers)
    }
}

/// Loads the checkpoint in `dir` with the architecture its `config.json` names.
///
/// # Errors
/// [`ModelError::Config`] for an unreadable or unsupported config, [`ModelError::Unimplemented`]
/// for a recognised architecture without an implementation, and the errors of
/// [`Weights::open`] and of the architecture's loader (missing or mis-shaped tensors).
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Box<dyn Architecture>, ModelError> {
    let (cfg, weights) = open(dir, opts)?;
    load_with(cfg, weights, opts)
}

/// The parsed `config.json` of `dir` and its weights opened with `opts`' precision and
/// residency: what [`load_with`] builds an architecture from.
///
/// # Errors
/// As [`load`], less the architecture's loader.
pub fn open(dir: &Path, opts: &LoadOptions) -> Result<(TextConfig, Arc<Weights>), ModelError> {
    let cfg = TextConfig::read(dir)?;
    let weights = Arc::new(
        Weights::open(
            dir,
            cfg.quantization.as_ref(),
            opts.precision,
            opts.residency,
        )?
        .with_device(opts.device.device()?),
    );
    Ok((cfg, weights))
}

/// [`load`] from an already parsed config and opened weights.
///
/// # Errors
/// As [`load`].
pub fn load_with(
    cfg: TextConfig,
    weights: Arc<Weights>,
    opts: &LoadOptions,
) -> Result<Box<dyn Architecture>, ModelError> {
    match cfg.kind {
        ArchKind::Qwen3Moe => Ok(Box::new(qwen3_moe::Qwen3Moe::load(cfg, weights, opts)?)),
        ArchKind::Qwen3_5Moe => Ok(Box::new(qwen3_5_moe::Qwen3_5Moe::load(cfg, weights, opts)?)),
        ArchKind::GlmMoeDsa => glm_moe_dsa::load(cfg, weights, opts),
    }
}
