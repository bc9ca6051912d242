//! [`CandleBackend`]: the sglang double's [`Backend`] over the real devnet model
//! ([`engy_model`], candle on CPU), honest (`bf16`) or the int4 cheat.
//!
//! Each session is a KV-cache greedy decoder ([`engy_model::Decoder`]); rows are the final
//! hidden states (post final RMSNorm, the LM-head input, sglang-native-api.md §2.6.1) rounded
//! to bf16 as a bf16 serve emits them (§2.6.2). The model computes in f32 and the prefill and
//! decode paths give bit-identical rows for the same context (tested in `engy-model`), so the
//! backend contract "a pure function of the context" holds. Each step also returns the
//! experts the model routed every position it ran to ([`engy_model::Step::routed_experts`]):
//! the first step runs the whole input, so its routing covers the cached prefix too, as
//! sglang returns it (docs/PROTOCOL.md §3.10).
use std::path::Path;
use std::sync::Arc;

use engy_model::cells::{serve_cells, CellServe};
use engy_model::{round_to_bf16, Checkpoint, Compute, Decoder, Model, ModelError, Precision};

use crate::sglang::{Backend, BackendError, ModelFacts, RoutingShape, Session, Step};

/// The devnet model served by the sglang double.
pub struct CandleBackend {
    model: Arc<Model>,
    tokenizer: tokenizers::Tokenizer,
    facts: ModelFacts,
    model_root: String,
    /// How the serve's MoE blocks produce the cells its hooks capture.
    cell_serve: CellServe,
}

impl std::fmt::Debug for CandleBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleBackend")
            .field("facts", &self.facts)
            .field("precision", &self.model.precision())
            .field("compute", &self.model.compute())
            .finish()
    }
}

impl CandleBackend {
    /// Loads the checkpoint in `dir` with `precision` (honest `Bf16`, or the `Int4` cheat that
    /// still reports the same checkpoint).
    ///
    /// # Errors
    /// As [`Checkpoint::open`].
    pub fn open(dir: &Path, precision: Precision) -> Result<Self, ModelError> {
        Self::open_with(dir, precision, Compute::F32)
    }

    /// [`CandleBackend::open`] with activations computed in `compute`: [`Compute::Bf16`] plays a
    /// bf16 GPU serve, whose honest rows differ slightly from the f32 auditor's.
    ///
    /// # Errors
    /// As [`Checkpoint::open`].
    pub fn open_with(
        dir: &Path,
        precision: Precision,
        compute: Compute,
    ) -> Result<Self, ModelError> {
        let ck = Checkpoint::open_with(dir, precision, compute)?;
        let stop = ck.stop_ids();
        let cfg = ck.model.config().clone();
        let facts = ModelFacts {
            model_path: dir.display().to_string(),
            model_type: cfg.model_type.clone(),
            architectures: cfg.architectures.clone(),
            hidden_size: cfg.hidden_size,
            vocab_size: cfg.vocab_size,
            eos_token_ids: stop,
            context_length: cfg.max_position_embeddings,
            routing: ck.model.routing_shape().map(|r| RoutingShape {
                num_hidden_layers: r.layers,
                num_experts_per_tok: r.top_k,
                num_experts: r.experts,
                // The model's own routing already has 0 rows for dense layers.
                first_k_dense: 0,
            }),
            indexer: None,
        };
        Ok(Self {
            model: Arc::new(ck.model),
            tokenizer: ck.tokenizer,
            facts,
            model_root: ck.model_root,
            cell_serve: CellServe::Honest,
        })
    }

    /// This backend with its cells built as `serve` builds them (honest by default; the
    /// cheats of [`CellServe`] for the devnet's cell phases).
    pub fn with_cell_serve(mut self, serve: CellServe) -> Self {
        self.cell_serve = serve;
        self
    }

    /// PROTOCOL.md §4 `model_root` of the checkpoint directory.
    pub fn model_root(&self) -> &str {
        &self.model_root
    }

    /// The weights' precision.
    pub fn precision(&self) -> Precision {
        self.model.precision()
    }
}

struct CandleSession {
    decoder: Decoder<Arc<Model>>,
    skip_rows: usize,
}

impl Session for CandleSession {
    fn step(&mut self) -> Result<Step, BackendError> {
        let s = self
            .decoder
            .step()
            .map_err(|e| BackendError(e.to_string()))?;
        let skip = std::mem::take(&mut self.skip_rows);
        let rows: Vec<f32> = s
            .hidden
            .iter()
            .skip(skip)
            .flat_map(|r| round_to_bf16(r))
            .collect();
        // Expert ids are below the expert count (a few hundred at most): they fit int32.
        let routing = (!s.routed_experts.is_empty()).then(|| {
            s.routed_experts
                .iter()
                .map(|&e| i32::try_from(e).unwrap_or(i32::MAX))
                .collect()
        });
        Ok(Step {
            token_id: s.token_id,
            logprob: s.logprob,
            rows,
            routing,
            indexer_topk: None,
        })
    }
}

impl Backend for CandleBackend {
    fn facts(&self) -> &ModelFacts {
        &self.facts
    }

    fn start(
        &self,
        input_ids: &[u32],
        cached_prefix: usize,
    ) -> Result<Box<dyn Session>, BackendError> {
        let decoder = Decoder::new(Arc::clone(&self.model), input_ids)
            .map_err(|e| BackendError(e.to_string()))?;
        // Positions before `cached_prefix` are recomputed (the values do not depend on it)
        // but not returned; at least the last prompt row is always returned.
        let skip_rows = cached_prefix.min(input_ids.len().saturating_sub(1));
        Ok(Box::new(CandleSession { decoder, skip_rows }))
    }

    fn cells(
        &self,
        input_ids: &[u32],
    ) -> Option<Result<Vec<engy_core::cells::Cell>, BackendError>> {
        self.model.routing_shape()?;
        Some(
            serve_cells(&self.model, input_ids, self.cell_serve)
                .map_err(|e| BackendError(e.to_string())),
        )
    }

    fn decode(&self, ids: &[u32]) -> Result<String, BackendError> {
        if let Some(id) = ids.iter().find(|&&i| i as usize >= self.facts.vocab_size) {
            return Err(BackendError(format!(
                "token id {id} is outside the vocabulary (size {})",
                self.facts.vocab_size
            )));
        }
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| BackendError(format!("detokenize: {e}")))
    }
}
