//! The model behind the sglang double: a step-wise greedy generator.
//!
//! The HTTP layer ([`super::SglangDouble`]) owns everything sglang does around the model
//! (rids, radix-cache accounting, ragged `hidden_states`, SSE framing, aborts, faults);
//! a [`Backend`] owns only the model: facts for `/get_model_info`, detokenization, and
//! greedy forward steps that return the hidden state the logits processor saw.
//!
//! Two implementations exist:
//! * [`super::synthetic::SyntheticBackend`] (this crate): hash-seeded, deterministic,
//!   instant; used by the miner's tests.
//! * the candle Qwen3-style model in `engy-model` (devnet), which runs real forward passes.
//!
//! # Contract (what the miner's proofs depend on)
//! * **Greedy and a pure function of the context.** The token sampled after a context
//!   and the hidden row computed at a position depend only on the token ids up to and
//!   including that position, never on how the sequence was split between prefill and
//!   decode, on the `cached_prefix` hint, or on other sessions. This is what makes a
//!   chunked generation (docs/PROTOCOL.md §3.4, one-token overlap) return the same rows as one
//!   long call.
//! * **Rows are the LM-head input** (post final norm for Qwen/Llama, sglang-native-api.md
//!   §2.6.1), `hidden_size` floats each, and **bf16-exact**: every value must be exactly
//!   representable in bfloat16 (sglang's serve emits bf16 `.tolist()` values, §2.6.2).
//! * Sessions are driven from a blocking thread (`tokio::task::spawn_blocking`), one step
//!   at a time, so a backend may compute synchronously and hold per-session state such as
//!   a KV cache. A session is dropped as soon as the request finishes or is aborted.
use std::fmt;

/// Facts about the served model (sglang-native-api.md §5 `/get_model_info`, plus the
/// sizes the double and the miner need).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFacts {
    /// `model_path` / `tokenizer_path` reported by `/get_model_info` (the checkpoint folder).
    pub model_path: String,
    /// HF `config.json` `model_type`, e.g. `qwen3`.
    pub model_type: String,
    /// HF `config.json` `architectures`, e.g. `["Qwen3ForCausalLM"]`.
    pub architectures: Vec<String>,
    /// Width of every hidden-state row (HF `hidden_size`).
    pub hidden_size: usize,
    /// Vocabulary size (rows of the LM head).
    pub vocab_size: usize,
    /// Token ids that finish a generation with `{"type":"stop","matched":<id>}` (unless
    /// the request sets `ignore_eos`).
    pub eos_token_ids: Vec<u32>,
    /// Maximum prompt + output tokens; the double rejects longer requests with a 400 as
    /// sglang does (§2.1).
    pub context_length: usize,
    /// The MoE routing the model records for `--enable-return-routed-experts`; `None` for
    /// a dense model, or a backend that records none (the double then never sends
    /// `routed_experts`).
    pub routing: Option<RoutingShape>,
    /// The DSA indexer's top-k for `--enable-return-indexer-topk`; `None` without an
    /// indexer.
    pub indexer: Option<IndexerShape>,
}

/// The shape of sglang's `routed_experts` rows (`python/sglang/srt/state_capturer/
/// routed_experts.py`): every row has `num_hidden_layers × num_experts_per_tok` logical
/// expert ids; the rows of dense (non-MoE) layers are 0 (the capture buffers are
/// zero-initialised and indexed by layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoutingShape {
    /// HF `num_hidden_layers` (dense layers included).
    pub num_hidden_layers: usize,
    /// HF `num_experts_per_tok` (top-k).
    pub num_experts_per_tok: usize,
    /// Routed experts per MoE layer (ids are below it).
    pub num_experts: usize,
    /// HF `first_k_dense_replace`: the leading dense layers, whose rows are 0 (the
    /// synthetic backend writes them as 0; a real model's routing already has them 0).
    pub first_k_dense: usize,
}

/// The shape of sglang's `indexer_topk` rows (`python/sglang/srt/state_capturer/
/// indexer_topk.py`): `layers × index_topk` key positions per row, `-1` in the slots of a
/// position with fewer than `index_topk` keys (`layers/attention/nsa/topk.py`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexerShape {
    /// Indexer layers (`num_hidden_layers` for DSA models).
    pub layers: usize,
    /// HF `index_topk`.
    pub index_topk: usize,
}

/// A backend failure. The double turns it into a scheduler-side abort
/// (`finish_reason {"type":"abort","status_code":500}`, sglang-native-api.md §2.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendError(pub String);

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BackendError {}

/// One forward step of a [`Session`].
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The greedy (argmax) token sampled from the LAST row of `rows`.
    pub token_id: u32,
    /// Natural log-probability of `token_id` under the model (reported in
    /// `output_token_logprobs`; not used by proofs).
    pub logprob: f32,
    /// Hidden-state rows computed in this step, row-major, `n × hidden_size` floats,
    /// bf16-exact. The first step (prefill) returns one row per computed prompt position
    /// (`input_ids[cached_prefix..]`, at least one row); every later step returns exactly
    /// one row (the position of the previously sampled token).
    pub rows: Vec<f32>,
    /// The routed experts of the positions this step ran, sglang's int32 row-major
    /// `[n, num_hidden_layers, num_experts_per_tok]` ([`RoutingShape`]). The first step
    /// returns a row for EVERY input position, the cached prefix included (sglang returns
    /// the routing recorded when a cached prefix was computed, which for a model that is a
    /// pure function of the context is the same); every later step returns one row.
    /// `None` when the backend records no routing.
    pub routing: Option<Vec<i32>>,
    /// The indexer top-k of the same positions as `routing`, `[n, layers, index_topk]`
    /// ([`IndexerShape`]), `-1` padded; `None` without an indexer.
    pub indexer_topk: Option<Vec<i32>>,
}

/// A model that the sglang double serves. Implementations must be cheap to share
/// (`Arc<dyn Backend>`) and safe to call from many blocking threads at once.
pub trait Backend: Send + Sync + 'static {
    /// Facts for `/get_model_info` and row sizing. Must not change while serving.
    fn facts(&self) -> &ModelFacts;

    /// Start a greedy generation over `input_ids` (never empty; the double rejects empty
    /// input before calling).
    ///
    /// `cached_prefix` is the number of leading tokens the double's radix cache claims to
    /// hold (`0 ≤ cached_prefix < input_ids.len()`): the first [`Session::step`] must
    /// return rows only for positions `cached_prefix..input_ids.len()`. A backend may
    /// still recompute the cached positions internally; the values must not depend on it.
    ///
    /// # Errors
    /// [`BackendError`] for an input the model cannot run (token id ≥ vocab, too long).
    fn start(
        &self,
        input_ids: &[u32],
        cached_prefix: usize,
    ) -> Result<Box<dyn Session>, BackendError>;

    /// Detokenize `ids` with special tokens skipped (sglang's default
    /// `skip_special_tokens: true`). The double calls it on the cumulative output ids of
    /// a request to build the cumulative `text` of every reply and SSE event.
    ///
    /// # Errors
    /// [`BackendError`] if an id is outside the vocabulary.
    fn decode(&self, ids: &[u32]) -> Result<String, BackendError>;

    /// The activation cells (specs/CELLS.md §2) of one teacher-forced pass over
    /// `input_ids`: every position × every MoE layer, in leaf order (position-major, then
    /// layer), as the engy_cells hooks capture them from the serve's MoE blocks. `None`
    /// (the default) for a backend without MoE blocks: the hooks then spool nothing.
    fn cells(
        &self,
        _input_ids: &[u32],
    ) -> Option<Result<Vec<engy_core::cells::Cell>, BackendError>> {
        None
    }
}

/// One in-progress greedy generation (holds whatever state the model needs, e.g. a KV cache).
pub trait Session: Send {
    /// Run the next forward step.
    ///
    /// The first call runs prefill over the input (rows for `input_ids[cached_prefix..]`)
    /// and samples output token 0 from the last prompt row. Each later call feeds the
    /// token returned by the previous call and returns that position's row and the next
    /// token. The double decides when to stop (EOS, `max_new_tokens`, abort); a session is
    /// never stepped past the backend's `context_length`.
    ///
    /// # Errors
    /// [`BackendError`] on a model failure; the double aborts the request.
    fn step(&mut self) -> Result<Step, BackendError>;
}
