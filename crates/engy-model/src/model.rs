//! [`Model`]: a checkpoint of any supported architecture ([`crate::arch`]) on CPU with candle:
//! loading (optionally with the int4 cheat), step-by-step greedy decoding with a cache, and a
//! teacher-forced pass.
//!
//! Weights are dequantised to f32 and computed in f32. The *hidden state* this module returns for a
//! position is the output of the final RMSNorm, i.e. the input of the LM head: the tensor sglang
//! hands to its logits processor for Llama/Qwen models and returns as `hidden_states`
//! (sglang-native-api.md §2.6.1).
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use half::bf16;

use crate::arch::{
    self, Architecture, Cache, LoadOptions, Probe, RoutingRecord, RoutingShape, TextConfig, Weights,
};
use crate::ModelError;

/// How the checkpoint's weights are turned into the weights the forward pass uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// The stored bf16 weights, exactly (the honest serve and the auditor).
    #[default]
    Bf16,
    /// The cheat: every projection matrix (`*_proj.weight` of attention, dense MLPs and
    /// experts) rounded to symmetric 4-bit integers per group of `group_size` consecutive input
    /// columns (scale = max |w| / 7, levels −8..=7, round to nearest), then dequantised to bf16.
    /// Embeddings, norms, the router and `lm_head` stay bf16, as in common int4 (GPTQ/AWQ-style)
    /// exports.
    Int4 {
        /// Columns per quantisation group (32 or 128 are usual); 0 is treated as 1.
        group_size: usize,
    },
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Precision::Bf16 => write!(f, "bf16"),
            Precision::Int4 { group_size } => write!(f, "int4 (group {group_size})"),
        }
    }
}

/// Rounds `w` (row-major, `cols` per row) to symmetric int4 groups in place (see
/// [`Precision::Int4`]).
pub fn quantize_int4(w: &mut [f32], cols: usize, group_size: usize) {
    let g = group_size.max(1);
    let cols = cols.max(1);
    for row in w.chunks_mut(cols) {
        for group in row.chunks_mut(g) {
            let max = group.iter().fold(0f32, |m, x| m.max(x.abs()));
            if max == 0.0 || !max.is_finite() {
                continue;
            }
            let scale = max / 7.0;
            for x in group.iter_mut() {
                let q = (*x / scale).round().clamp(-8.0, 7.0);
                *x = bf16::from_f32(q * scale).to_f32();
            }
        }
    }
}

/// The dtype the forward pass computes activations in. Weights are stored in bf16 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// f32 activations (the auditor, and the default serve): prefill and decode give
    /// bit-identical rows on CPU.
    #[default]
    F32,
    /// bf16 activations (every operation's output rounded to bf16), as a bf16 GPU serve
    /// computes: an honest serve whose numbers differ slightly from the f32 auditor's (the
    /// "different hardware" case of the SN53 experiment).
    Bf16,
}

impl Compute {
    /// `f32` or `bf16`.
    pub fn label(self) -> &'static str {
        match self {
            Compute::F32 => "f32",
            Compute::Bf16 => "bf16",
        }
    }

    /// Rounds `t` (f32) to the activation dtype: bf16 storage with f32 accumulation inside each
    /// operation, as GPU bf16 kernels do (candle's CPU matmul has no bf16 kernel). An f32
    /// tensor on a GPU rounds in one kernel ([`crate::arch::norm_kernels::round_bf16`], the
    /// same values as the two casts).
    pub(crate) fn round(self, t: Tensor) -> candle_core::Result<Tensor> {
        match self {
            Compute::F32 => Ok(t),
            Compute::Bf16 => {
                if t.dtype() == DType::F32 {
                    if let Some(r) = crate::arch::norm_kernels::round_bf16(&t)? {
                        return Ok(r);
                    }
                }
                t.to_dtype(DType::BF16)?.to_dtype(DType::F32)
            }
        }
    }

    /// Rounds one value to the activation dtype.
    pub(crate) fn round_f32(self, x: f32) -> f32 {
        match self {
            Compute::F32 => x,
            Compute::Bf16 => bf16::from_f32(x).to_f32(),
        }
    }
}

/// The numerics of one forward pass over the same weights: what the auditor varies between
/// recomputes of one commitment ([`crate::audit::Recompute::plan`]; docs/AUDITOR.md
/// "Recomputes").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Numerics {
    /// The activation dtype ([`LoadOptions::compute`]).
    pub compute: Compute,
    /// Whose attention rounding a bf16 pass follows ([`LoadOptions::attention`]).
    pub attention: arch::AttentionKernel,
    /// The DSA tie order ([`LoadOptions::dsa_ties`]).
    pub dsa_ties: arch::TieOrder,
    /// How products with block-FP8 weights treat their input rows
    /// ([`LoadOptions::fp8_activations`]: W8A16 or sglang's W8A8).
    pub fp8_activations: arch::Fp8Activations,
}

/// The state of one sequence between decoding steps (see [`arch::Cache`]).
pub type KvCache = Cache;

/// A loaded checkpoint: the architecture [`arch::load`] chose, with the options it was loaded
/// with.
pub struct Model {
    arch: Box<dyn Architecture>,
    opts: LoadOptions,
    /// The parsed config and opened weights it was loaded from ([`Model::open`]), so that
    /// [`Model::with_compute`] can load a sibling over the same weights.
    source: Option<(TextConfig, Arc<Weights>)>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cfg = self.config();
        f.debug_struct("Model")
            .field("arch", &cfg.kind)
            .field("model_type", &cfg.model_type)
            .field("hidden_size", &cfg.hidden_size)
            .field("layers", &cfg.num_hidden_layers)
            .field("vocab_size", &cfg.vocab_size)
            .field("opts", &self.opts)
            .finish()
    }
}

impl Model {
    /// Loads the checkpoint in `dir` (its `config.json` and every `*.safetensors` shard)
    /// with `precision`, f32 activations, weights kept resident.
    ///
    /// # Errors
    /// As [`arch::load`].
    pub fn load(dir: &Path, precision: Precision) -> Result<Self, ModelError> {
        Self::load_with(dir, precision, Compute::F32)
    }

    /// [`Model::load`] with the activations computed in `compute` (see [`Compute`]).
    ///
    /// # Errors
    /// As [`arch::load`].
    pub fn load_with(
        dir: &Path,
        precision: Precision,
        compute: Compute,
    ) -> Result<Self, ModelError> {
        Self::open(
            dir,
            &LoadOptions {
                precision,
                compute,
                ..LoadOptions::default()
            },
        )
    }

    /// Loads `dir` with `opts`.
    ///
    /// # Errors
    /// As [`arch::load`].
    pub fn open(dir: &Path, opts: &LoadOptions) -> Result<Self, ModelError> {
        let (cfg, weights) = arch::open(dir, opts)?;
        Ok(Self {
            arch: arch::load_with(cfg.clone(), weights.clone(), opts)?,
            opts: *opts,
            source: Some((cfg, weights)),
        })
    }

    /// The same checkpoint and weights (shared, not reopened: with
    /// [`Residency::Resident`](crate::Residency::Resident) the decoded weights are decoded once
    /// for both) with activations computed in `compute`. The auditor uses it to recompute a
    /// commitment in bf16 and in f32 ([`crate::audit::Recompute`]).
    ///
    /// # Errors
    /// [`ModelError::Config`] for a model made by [`Model::from_arch`] (it has no checkpoint to
    /// reload), and the errors of the architecture's loader.
    pub fn with_compute(&self, compute: Compute) -> Result<Self, ModelError> {
        self.with_numerics(Numerics {
            compute,
            ..self.numerics()
        })
    }

    /// [`Model::with_compute`] that also sets the attention kernel's rounding points and the
    /// DSA tie order ([`Numerics`]).
    ///
    /// # Errors
    /// As [`Model::with_compute`].
    pub fn with_numerics(&self, n: Numerics) -> Result<Self, ModelError> {
        let Some((cfg, weights)) = &self.source else {
            return Err(ModelError::Config(
                "a model wrapped with Model::from_arch cannot be reloaded in another compute dtype"
                    .into(),
            ));
        };
        let opts = LoadOptions {
            compute: n.compute,
            attention: n.attention,
            dsa_ties: n.dsa_ties,
            fp8_activations: n.fp8_activations,
            ..self.opts
        };
        Ok(Self {
            arch: arch::load_with(cfg.clone(), weights.clone(), &opts)?,
            opts,
            source: self.source.clone(),
        })
    }

    /// Drops the decoded weights this model (and every sibling of [`Model::with_numerics`],
    /// which share them) keeps ([`arch::Weights::drop_kept`]); a model wrapped by
    /// [`Model::from_arch`] keeps its own and is left alone.
    pub fn drop_kept_weights(&self) {
        if let Some((_, w)) = &self.source {
            w.drop_kept();
        }
    }

    /// How this model's passes compute ([`Numerics`], from its [`LoadOptions`]).
    pub fn numerics(&self) -> Numerics {
        Numerics {
            compute: self.opts.compute,
            attention: self.opts.attention,
            dsa_ties: self.opts.dsa_ties,
            fp8_activations: self.opts.fp8_activations,
        }
    }

    /// Wraps an already loaded architecture.
    pub fn from_arch(arch: Box<dyn Architecture>, opts: LoadOptions) -> Self {
        Self {
            arch,
            opts,
            source: None,
        }
    }

    /// The checkpoint's config.
    pub fn config(&self) -> &TextConfig {
        self.arch.config()
    }

    /// The architecture's forward pass.
    pub fn arch(&self) -> &dyn Architecture {
        &*self.arch
    }

    /// The precision the weights were loaded with.
    pub fn precision(&self) -> Precision {
        self.opts.precision
    }

    /// The activation dtype.
    pub fn compute(&self) -> Compute {
        self.opts.compute
    }

    /// The options it was loaded with.
    pub fn options(&self) -> LoadOptions {
        self.opts
    }

    /// An empty cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        self.arch.new_cache()
    }

    /// Checks that `ids` may be appended to a sequence of `cached` positions.
    fn check_ids(&self, ids: &[u32], cached: usize) -> Result<(), ModelError> {
        let cfg = self.config();
        if ids.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(ModelError::TokenOutOfVocab {
                id,
                vocab: cfg.vocab_size,
            });
        }
        let len = cached.saturating_add(ids.len());
        if len > cfg.max_position_embeddings {
            return Err(ModelError::TooLong {
                len,
                max: cfg.max_position_embeddings,
            });
        }
        Ok(())
    }

    /// Runs `ids` (appended after the `cache.len()` cached positions) through the model and
    /// returns the final hidden states `[ids.len(), hidden_size]` (post final norm, f32).
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`];
    /// the cache is left unchanged on error.
    pub fn forward(&self, ids: &[u32], cache: &mut KvCache) -> Result<Tensor, ModelError> {
        self.forward_probed(ids, cache, &mut Probe::default())
    }

    /// [`Model::forward`] with a [`Probe`]: what the pass records (residual outputs, routing)
    /// or checks (a committed routing trace) besides the hidden states.
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn forward_probed(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        probe: &mut Probe<'_>,
    ) -> Result<Tensor, ModelError> {
        self.check_ids(ids, cache.len)?;
        self.arch.forward(ids, cache, probe)
    }

    /// The shape of the model's routing trace (`None` without MoE layers).
    pub fn routing_shape(&self) -> Option<RoutingShape> {
        self.arch.routing_shape()
    }

    /// Logits `[rows, vocab]` of final hidden states `[rows, hidden]`.
    ///
    /// # Errors
    /// A candle error when `hidden` has the wrong width.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor, ModelError> {
        self.arch.logits(hidden)
    }

    /// Teacher-forced: the final hidden state of every position of `ids`, computed in ONE pass
    /// without a cache (`ids.len()` rows of `hidden_size` f32).
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn hidden_states(&self, ids: &[u32]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.hidden_states_probed(ids, &mut Probe::default())
    }

    /// [`Model::hidden_states`] with a [`Probe`] (routing record or check).
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn hidden_states_probed(
        &self,
        ids: &[u32],
        probe: &mut Probe<'_>,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut cache = KvCache::one_pass();
        let dev = self.opts.device.device()?;
        crate::device::phase(&dev, "forward", || {
            let h = self.forward_probed(ids, &mut cache, probe)?;
            crate::device::phase(
                &dev,
                "hidden states to the host",
                || Ok(h.to_vec2::<f32>()?),
            )
        })
    }

    /// Rows `rows.0 .. rows.0 + rows.1` of the final hidden states of a teacher-forced pass
    /// over `ids`, as bf16 bits rounded to nearest even (the rows a bf16 serve returns and
    /// TOPLOC proves, PROTOCOL.md §3 item 8: the same bits as
    /// `engy_core::toploc::f32_to_bf16_bits` of the f32 rows for every finite value). The rows
    /// are cut and rounded where the pass ran, so on a GPU only they come to the host, at 2
    /// bytes a value instead of 4 for every position.
    ///
    /// # Errors
    /// As [`Model::forward`]; [`ModelError::Config`] when the rows are out of range.
    pub fn hidden_rows_bf16_probed(
        &self,
        ids: &[u32],
        rows: (usize, usize),
        probe: &mut Probe<'_>,
    ) -> Result<Vec<Vec<u16>>, ModelError> {
        let mut cache = KvCache::one_pass();
        let dev = self.opts.device.device()?;
        crate::device::phase(&dev, "forward", || {
            let h = self.forward_probed(ids, &mut cache, probe)?;
            crate::device::phase(&dev, "hidden states to the host", || rows_bf16(&h, rows))
        })
    }

    /// [`Model::hidden_rows_bf16_probed`] for several sequences in one pass over the weights
    /// ([`Model::hidden_states_probed_many`]); `rows[i]` belongs to `seqs[i]`.
    ///
    /// # Errors
    /// As [`Model::hidden_states_probed_many`]; [`ModelError::Config`] when `rows` differs in
    /// length or a range is out of its sequence.
    pub fn hidden_rows_bf16_probed_many(
        &self,
        seqs: &[&[u32]],
        rows: &[(usize, usize)],
        probes: &mut [Probe<'_>],
    ) -> Result<Vec<Vec<Vec<u16>>>, ModelError> {
        if seqs.len() != rows.len() {
            return Err(ModelError::Config(format!(
                "{} sequences with {} row ranges",
                seqs.len(),
                rows.len()
            )));
        }
        let dev = self.opts.device.device()?;
        let hs = self.forward_many(seqs, probes)?;
        crate::device::phase(&dev, "hidden states to the host", || {
            hs.iter()
                .zip(rows)
                .map(|(h, &r)| rows_bf16(h, r))
                .collect::<Result<Vec<_>, ModelError>>()
        })
    }

    /// The final hidden states of each of `seqs` in one pass ([`Architecture::forward_many`]),
    /// left where the pass ran.
    fn forward_many(
        &self,
        seqs: &[&[u32]],
        probes: &mut [Probe<'_>],
    ) -> Result<Vec<Tensor>, ModelError> {
        if seqs.len() != probes.len() {
            return Err(ModelError::Config(format!(
                "{} sequences with {} probes",
                seqs.len(),
                probes.len()
            )));
        }
        for ids in seqs {
            self.check_ids(ids, 0)?;
        }
        let mut caches: Vec<KvCache> = seqs.iter().map(|_| KvCache::one_pass()).collect();
        let dev = self.opts.device.device()?;
        crate::device::phase(&dev, "forward", || {
            let mut passes: Vec<crate::arch::SeqPass<'_, '_>> = seqs
                .iter()
                .zip(caches.iter_mut())
                .zip(probes.iter_mut())
                .map(|((ids, cache), probe)| crate::arch::SeqPass { ids, cache, probe })
                .collect();
            self.arch.forward_many(&mut passes)
        })
    }

    /// [`Model::hidden_states_probed`] for several sequences in one pass over the weights
    /// ([`Architecture::forward_many`]: with streamed weights, each layer read and decoded once
    /// for all of them). `probes[i]` belongs to `seqs[i]`; each result is exactly what
    /// [`Model::hidden_states_probed`] gives for that sequence alone.
    ///
    /// # Errors
    /// As [`Model::forward`] for any of the sequences; [`ModelError::Config`] when `probes`
    /// and `seqs` differ in length.
    pub fn hidden_states_probed_many(
        &self,
        seqs: &[&[u32]],
        probes: &mut [Probe<'_>],
    ) -> Result<Vec<Vec<Vec<f32>>>, ModelError> {
        if seqs.len() != probes.len() {
            return Err(ModelError::Config(format!(
                "{} sequences with {} probes",
                seqs.len(),
                probes.len()
            )));
        }
        let dev = self.opts.device.device()?;
        let hs = self.forward_many(seqs, probes)?;
        crate::device::phase(&dev, "hidden states to the host", || {
            hs.iter()
                .map(|h| Ok(h.to_vec2::<f32>()?))
                .collect::<Result<Vec<_>, ModelError>>()
        })
    }

    /// Teacher-forced, with every decoder layer's residual output: `(final [T, H], layers)`
    /// where `layers[l]` is `[T, H]` after layer `l` (before the final norm), for debugging
    /// against a reference's `output_hidden_states`.
    ///
    /// # Errors
    /// As [`Model::forward`].
    pub fn hidden_states_traced(&self, ids: &[u32]) -> Result<(Tensor, Vec<Tensor>), ModelError> {
        self.check_ids(ids, 0)?;
        let mut cache = KvCache::one_pass();
        let mut layers = Vec::new();
        let h = self
            .arch
            .forward(ids, &mut cache, &mut Probe::with_layers(Some(&mut layers)))?;
        Ok((h, layers))
    }

    /// Starts greedy decoding of `prompt_ids` (see [`Decoder`]).
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`].
    pub fn decoder(&self, prompt_ids: &[u32]) -> Result<Decoder<&Model>, ModelError> {
        Decoder::new(self, prompt_ids)
    }

    /// Greedy decoding of up to `max_new` tokens, stopping after a token in `stop` (which is
    /// kept, like sglang's output ids). Returns every step.
    ///
    /// # Errors
    /// As [`Model::decoder`] and [`Decoder::step`].
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        max_new: usize,
        stop: &[u32],
    ) -> Result<Vec<Step>, ModelError> {
        let mut dec = self.decoder(prompt_ids)?;
        let mut steps = Vec::new();
        while steps.len() < max_new && !dec.is_full() {
            let s = dec.step()?;
            let done = stop.contains(&s.token_id);
            steps.push(s);
            if done {
                break;
            }
        }
        Ok(steps)
    }
}

/// One greedy decoding step.
#[derive(Debug, Clone)]
pub struct Step {
    /// The sampled (argmax) token.
    pub token_id: u32,
    /// Its log-probability under the model (natural log).
    pub logprob: f32,
    /// The final hidden states computed by this step's forward pass: every prompt position for
    /// the first step (its last row sampled `token_id`), one row afterwards (f32, not rounded).
    pub hidden: Vec<Vec<f32>>,
    /// The experts each row of `hidden` was routed to, row-major
    /// `[rows, num_hidden_layers, num_experts_per_tok]` in choice order, 0 for dense layers
    /// (sglang's `routed_experts` layout); empty for a model without MoE layers.
    pub routed_experts: Vec<u32>,
}

/// Step-by-step greedy decoding with a KV cache: each step feeds the tokens not yet seen (the
/// prompt at first, then the last sampled token) and samples the argmax of the last row.
///
/// `M` is how the decoder holds the model: `&Model` ([`Model::decoder`]) or an owning pointer
/// such as `Arc<Model>` for a session that outlives the caller's borrow.
pub struct Decoder<M: std::ops::Deref<Target = Model>> {
    model: M,
    cache: KvCache,
    pending: Vec<u32>,
}

impl<M: std::ops::Deref<Target = Model>> Decoder<M> {
    /// Starts greedy decoding of `prompt_ids` on `model`.
    ///
    /// # Errors
    /// [`ModelError::EmptyInput`], [`ModelError::TokenOutOfVocab`], [`ModelError::TooLong`].
    pub fn new(model: M, prompt_ids: &[u32]) -> Result<Self, ModelError> {
        model.check_ids(prompt_ids, 0)?;
        let cache = model.new_cache();
        Ok(Self {
            model,
            cache,
            pending: prompt_ids.to_vec(),
        })
    }

    /// Whether the sequence reached `max_position_embeddings` (no further step is possible).
    pub fn is_full(&self) -> bool {
        self.cache.len + self.pending.len() > self.model.config().max_position_embeddings
    }

    /// Positions processed so far.
    pub fn positions(&self) -> usize {
        self.cache.len
    }

    /// Runs one forward pass and samples the next token greedily (ties: lowest id).
    ///
    /// # Errors
    /// [`ModelError::TooLong`] once the context is full; candle errors.
    pub fn step(&mut self) -> Result<Step, ModelError> {
        let first = self.cache.len;
        let mut record = self.model.routing_shape().map(RoutingRecord::new);
        let hidden = self.model.forward_probed(
            &self.pending,
            &mut self.cache,
            &mut Probe {
                routing: record.as_mut(),
                ..Probe::default()
            },
        )?;
        let rows = hidden.dim(0)?;
        let routed_experts = record
            .map(|r| r.ids(first, first + rows))
            .unwrap_or_default();
        let last = hidden.narrow(0, rows.saturating_sub(1), 1)?;
        let logits = self.model.logits(&last)?.squeeze(0)?;
        let lv = logits.to_vec1::<f32>()?;
        let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
        for (i, &x) in lv.iter().enumerate() {
            if x > best_v {
                best = i;
                best_v = x;
            }
        }
        let lse = {
            let m = best_v;
            m + lv.iter().map(|x| (x - m).exp()).sum::<f32>().ln()
        };
        let token_id = best as u32;
        self.pending = vec![token_id];
        Ok(Step {
            token_id,
            logprob: best_v - lse,
            hidden: hidden.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            routed_experts,
        })
    }
}

/// Rounds f32 values to the nearest bf16 (ties to even), returned as f32: what a bf16 serve
/// would emit in `hidden_states` (sglang-native-api.md §2.6.2).
pub fn round_to_bf16(row: &[f32]) -> Vec<f32> {
    row.iter().map(|x| bf16::from_f32(*x).to_f32()).collect()
}

/// Rows `first .. first + n` of `h` `[T, hidden]` f32, rounded to bf16 (nearest even) where
/// `h` is, as bits.
fn rows_bf16(h: &Tensor, (first, n): (usize, usize)) -> Result<Vec<Vec<u16>>, ModelError> {
    let t = h.dim(0)?;
    if first.checked_add(n).is_none_or(|end| end > t) {
        return Err(ModelError::Config(format!(
            "rows {first}..{} of a pass over {t} positions",
            first.saturating_add(n)
        )));
    }
    let rows = h
        .narrow(0, first, n)?
        .to_dtype(candle_core::DType::BF16)?
        .to_vec2::<half::bf16>()?;
    Ok(rows
        .into_iter()
        .map(|r| r.into_iter().map(half::bf16::to_bits).collect())
        .collect())
}
