//! The sglang serve double: sglang 0.5.12's native HTTP API over a pluggable [`Backend`].
//!
//! Every shape follows `shared/spec/sglang-native-api.md` (cited as §n below):
//!
//! * `POST|PUT /generate` (§2): non-stream JSON and SSE stream (`data: <json>\n\n`, then
//!   `data: [DONE]\n\n`), cumulative `text`/`output_ids`/`output_token_logprobs`,
//!   `meta_info` keys in sglang's order, `finish_reason` shapes (§2.4), ragged
//!   `hidden_states` with element 0 = the prefill block (rows of the uncached prompt
//!   suffix) and one 1-D row per decode step, present on EVERY streamed event (§2.7).
//!   A radix cache over finished sequences reports `cached_tokens` (≤ prompt − 1).
//!   Duplicate in-flight rid → 400 (stream: an error event, §2.7). Serve without hidden
//!   states (`enable_hidden_states: false`) → sglang's ValueError text.
//! * `meta_info.routed_experts` / `indexer_topk` (docs/PROTOCOL.md §3.10, sglang's
//!   `state_capturer`): with [`SglangConfig::routed_experts`] (`--enable-return-routed-experts`)
//!   a request with `return_routed_experts` gets, on its final reply only and after
//!   `hidden_states`, base64 of int32 rows `[routed_experts_start_len, seqlen − 1)` (the start
//!   clamped to `seqlen − 1`, a negative one refused), the cached prefix's rows included;
//!   without the flag the request succeeds without the key. The indexer's rows always start
//!   at 0. [`Fault::RoutedExperts`] / [`Fault::IndexerTopk`] break them.
//! * `--forward-hooks` with the engy_cells hooks ([`SglangConfig::cells_spool`],
//!   [`cells_hooks`]): each call's prefill spools the backend's cells of `input_ids` as the
//!   Python hooks do, and the server info's `forward_hooks` names them.
//! * `POST /abort_request` (§3): 200 with an empty body, always; a running request keeps
//!   its current step and finishes with `{"type":"abort","message":"Aborted",…}`; a request
//!   still queued (see [`Fault::Hang`]) gets the reduced "Abort in waiting queue" reply.
//!   Matching is by prefix once the exact rid is live, as sglang's scheduler does.
//! * `GET /get_model_info` (alias `/model_info`, §5), `GET /get_server_info` (subset, §6,
//!   with `enable_return_routed_experts` and `enable_return_indexer_topk`),
//!   `GET /health`, `/health_generate` (§4; answered at once with an empty 200: the double
//!   has no warm-up).
//!
//! Faults ([`Fault`]) reproduce what a real serve does under concurrency or failure: the
//! batch-offset prefill bug (§2.6.3: empty element 0, foreign rows), retraction (§2.6.5),
//! slow and hung serves, dying mid-stream, 5xx, malformed JSON, hidden states disabled or
//! diverted, a connection torn on abort (§3), a final SSE line or a JSON body that stalls half-written, and
//! a 200 whose body is arbitrary bytes ([`Fault::Raw`]: non-JSON, cut or wrongly shaped
//! replies). [`SglangDouble::kill`] stops the whole serve at once as a crashed process
//! would (every reply torn mid-body, the port refusing connections) and
//! [`SglangDouble::restart`] brings it back on the same port.
//! Not modelled: batch input (`input_ids` as a list of lists gets a 400), speculative
//! decoding, `stop` strings, incremental streaming output.
//!
//! Everything served is recorded ([`GenerateRecord`]) so tests can check a miner's proofs
//! against the exact rows the double sent.
pub mod backend;
pub mod cells_hooks;
pub mod synthetic;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch, Notify};

pub use backend::{Backend, BackendError, IndexerShape, ModelFacts, RoutingShape, Session, Step};

/// A fault injected into `/generate` replies (see [`SglangDouble::push_fault`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Element 0 of `hidden_states` is `[]`: the batch-offset overshoot that engy calls
    /// "a full radix-cache hit" (§2.6.3). The first output token then has no row.
    EmptyPrefillBlock,
    /// `n` rows of another request are appended to element 0 (§2.6.3 overshoot): the
    /// block is longer than `prompt_tokens − cached_tokens` and its last row is foreign.
    ForeignPrefillRows(usize),
    /// One decode element (the last) is missing: fewer rows than output tokens.
    MissingDecodeRow,
    /// One decode row (the last) is one float short.
    RaggedRowWidth,
    /// Retraction (§2.6.5): the element at index 1 is a 2-D re-prefill block.
    Retraction,
    /// Sleep this long before each forward step.
    Slow(Duration),
    /// Drop the connection after this many SSE events (stream) or half-way through the
    /// body (non-stream, any value).
    DieAfterEvents(usize),
    /// Answer with this HTTP status and sglang's HTTPException envelope (§1).
    Status(u16),
    /// A 200 whose JSON (body or every SSE event) is cut short.
    MalformedJson,
    /// Answer as a serve started without `--enable-return-hidden-states` (§2.1).
    HiddenStatesDisabled,
    /// `meta_info.hidden_states` is `[]` (diverted by a serve-side hook, §8).
    NoHiddenStates,
    /// The request waits in the queue and never runs; an abort finishes it with the
    /// queue-abort reply (§3). A client disconnect ends it silently.
    Hang,
    /// Stream: write half of the final event line, then stall until aborted (the
    /// connection is then torn) or the client leaves.
    StallFinalLine,
    /// Non-stream: send the status line and half of the JSON body, then stall until
    /// aborted (the connection is then torn), killed, or the client leaves.
    StallBody,
    /// On abort, tear the connection down with no body (engy's live observation, §3).
    TornOnAbort,
    /// `meta_info.routed_experts` of the final reply is broken this way (the request asked
    /// for it on a serve that offers it).
    RoutedExperts(TraceFault),
    /// `meta_info.indexer_topk` of the final reply is broken this way.
    IndexerTopk(TraceFault),
    /// A 200 whose body is exactly these bytes (`application/json` without `stream`,
    /// `text/event-stream` with it; the caller writes any SSE framing): garbage, cut or
    /// wrongly shaped JSON from a broken serve or a proxy in front of it. Nothing runs.
    Raw(Vec<u8>),
}

/// How [`Fault::RoutedExperts`] / [`Fault::IndexerTopk`] break a trace field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceFault {
    /// The key is absent (a serve whose capture path was bypassed, or a proxy that drops it).
    Missing,
    /// The value is not base64.
    NotBase64,
    /// The last row is missing (whole int32 values, one row short).
    OneRowShort,
    /// Two bytes short: not a whole number of int32 values.
    CutMidValue,
    /// The value is a JSON number, not a string.
    NotAString,
}

/// Static behaviour of a double.
#[derive(Debug, Clone)]
pub struct SglangConfig {
    /// `--enable-return-hidden-states`: without it a request asking for hidden states
    /// is refused with sglang's ValueError (§2.1).
    pub enable_hidden_states: bool,
    /// Report radix-cache hits on re-sent prefixes (sglang's default). Off =
    /// `--disable-radix-cache`.
    pub radix_cache: bool,
    /// engy's serve hook (§8): element 0 cut to its last row, intermediate SSE events
    /// carry `"hidden_states":[]`.
    pub engy_trimmed: bool,
    /// `model_path` reported by `/get_model_info` (defaults to the backend's).
    pub model_path: Option<String>,
    /// Keep every `/generate` call (with its served rows) for
    /// [`SglangDouble::generate_log`] and every abort body for [`SglangDouble::aborts`]
    /// (default on, for tests). Off for a long-running serve (`engy-devnet serve`): nothing
    /// is kept per request, so memory stays bounded; both logs then stay empty and
    /// [`SglangDouble::wait_until`] sees no records.
    pub record: bool,
    /// `--enable-return-routed-experts` (sglang's default: off). With it, a request with
    /// `return_routed_experts: true` gets `meta_info.routed_experts` on its final reply
    /// (when the backend records routing). Without it such a request still succeeds,
    /// without the key, as sglang's does (its scheduler skips the collection when no
    /// capturer exists; the tokenizer manager does not refuse the field).
    pub routed_experts: bool,
    /// `--enable-return-indexer-topk` (default off): `meta_info.indexer_topk` on the final
    /// reply of a request with `return_indexer_topk: true` (when the backend has an
    /// indexer).
    pub indexer_topk: bool,
    /// `--forward-hooks "$(engy-cells-hooks SPOOL)"`: the engy_cells hooks write every
    /// prefill's cells (the backend's [`Backend::cells`]) to this spool directory
    /// ([`cells_hooks`]); `None` (default): no hooks.
    pub cells_spool: Option<std::path::PathBuf>,
}

impl SglangConfig {
    /// This config with the engy_cells `--forward-hooks` writing to `spool` (or none).
    pub fn with_cells_spool(mut self, spool: Option<std::path::PathBuf>) -> Self {
        self.cells_spool = spool;
        self
    }

    /// This config with `--enable-return-routed-experts` on or off.
    pub fn with_routed_experts(mut self, on: bool) -> Self {
        self.routed_experts = on;
        self
    }

    /// This config with `--enable-return-indexer-topk` on or off.
    pub fn with_indexer_topk(mut self, on: bool) -> Self {
        self.indexer_topk = on;
        self
    }
}

impl Default for SglangConfig {
    fn default() -> Self {
        Self {
            enable_hidden_states: true,
            radix_cache: true,
            engy_trimmed: false,
            model_path: None,
            record: true,
            routed_experts: false,
            indexer_topk: false,
            cells_spool: None,
        }
    }
}

/// One hidden-state element as served (§2.6.4).
#[derive(Debug, Clone, PartialEq)]
pub enum Element {
    /// A 2-D block `[rows][hidden]` (element 0, or a re-prefill), possibly empty.
    Block(Vec<Vec<f32>>),
    /// A 1-D decode row `[hidden]`.
    Row(Vec<f32>),
}

/// What one `/generate` call received and answered.
#[derive(Debug, Clone)]
pub struct GenerateRecord {
    /// The request's rid (the explicit one, or the double's uuid).
    pub rid: String,
    /// The raw request body.
    pub request: Value,
    /// `input_ids` of the request.
    pub input_ids: Vec<u32>,
    /// `stream` of the request.
    pub stream: bool,
    /// The fault applied, if any.
    pub fault: Option<Fault>,
    /// `cached_tokens` reported.
    pub cached_tokens: usize,
    /// Output ids of the final reply (empty until finished).
    pub output_ids: Vec<u32>,
    /// `hidden_states` of the final reply, exactly as served.
    pub hidden_states: Vec<Element>,
    /// `finish_reason` of the final reply (`Value::Null` while running).
    pub finish_reason: Value,
    /// True once the call has ended (reply sent, connection dropped, or refused).
    pub done: bool,
    /// Stream: every intermediate SSE event, in order, when it was handed to the HTTP
    /// body (the miner-added latency bench times the miner's `chunk` frames from these).
    pub events: Vec<EventMark>,
}

impl GenerateRecord {
    /// The request body read as the miner's typed `/generate` body
    /// ([`engy_core::wire::GenerateRequest`]): what engy-miner sends must parse.
    ///
    /// # Errors
    /// The serde error naming the field that does not fit.
    pub fn wire_request(&self) -> Result<engy_core::wire::GenerateRequest, serde_json::Error> {
        serde_json::from_value(self.request.clone())
    }
}

/// When one intermediate SSE event left the double, and the length in bytes of the
/// cumulative `text` it carried (§2.7).
#[derive(Debug, Clone, Copy)]
pub struct EventMark {
    /// Just after the event was handed to the response body.
    pub at: Instant,
    /// `text.len()` of the event (UTF-8 bytes).
    pub text_len: usize,
}

struct Live {
    aborted: AtomicBool,
    notify: Notify,
}

struct Inner {
    backend: Arc<dyn Backend>,
    cfg: SglangConfig,
    faults: Mutex<VecDeque<Fault>>,
    sticky: Mutex<Option<Fault>>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    radix: Mutex<VecDeque<Vec<u32>>>,
    records: Mutex<Vec<GenerateRecord>>,
    aborts: Mutex<Vec<Value>>,
    changed: watch::Sender<u64>,
    /// Bumped by [`SglangDouble::kill`]: every reply in flight is torn.
    kills: watch::Sender<u64>,
    /// The engy_cells hooks' spool ([`SglangConfig::cells_spool`]); one pass at a time, as
    /// the hooks' one capture state.
    spool: Mutex<Option<cells_hooks::Spool>>,
}

impl Inner {
    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
    fn next_fault(&self) -> Option<Fault> {
        if let Some(f) = lock(&self.faults).pop_front() {
            return Some(f);
        }
        lock(&self.sticky).clone()
    }
    fn update_record(&self, idx: usize, f: impl FnOnce(&mut GenerateRecord)) {
        if let Some(r) = lock(&self.records).get_mut(idx) {
            f(r);
        }
        self.bump();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running sglang double on 127.0.0.1. Dropping it stops the server.
pub struct SglangDouble {
    addr: SocketAddr,
    inner: Arc<Inner>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    server: Option<tokio::task::JoinHandle<()>>,
    /// While killed: `addr` held (bound, not listening: connections are refused and no
    /// other process is given the port, [`crate::ports`]); [`SglangDouble::restart`]
    /// listens on it.
    held: Option<crate::ports::ReservedPort>,
}

impl Drop for SglangDouble {
    fn drop(&mut self) {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }
}

impl SglangDouble {
    /// Start on an ephemeral port of 127.0.0.1.
    ///
    /// # Errors
    /// The bind error.
    pub async fn start(backend: Arc<dyn Backend>, cfg: SglangConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        Self::start_on(listener, backend, cfg)
    }

    /// Start on an already bound listener (the devnet picks its own port).
    ///
    /// # Errors
    /// The listener's `local_addr` error.
    pub fn start_on(
        listener: TcpListener,
        backend: Arc<dyn Backend>,
        cfg: SglangConfig,
    ) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let spool = match &cfg.cells_spool {
            Some(dir) => Some(cells_hooks::Spool::open(dir)?),
            None => None,
        };
        let (changed, _) = watch::channel(0u64);
        let (kills, _) = watch::channel(0u64);
        let inner = Arc::new(Inner {
            backend,
            cfg,
            faults: Mutex::new(VecDeque::new()),
            sticky: Mutex::new(None),
            live: Mutex::new(HashMap::new()),
            radix: Mutex::new(VecDeque::new()),
            records: Mutex::new(Vec::new()),
            aborts: Mutex::new(Vec::new()),
            changed,
            kills,
            spool: Mutex::new(spool),
        });
        let (tx, server) = crate::spawn_server_joinable(listener, router(&inner));
        Ok(Self {
            addr,
            inner,
            shutdown: Some(tx),
            server: Some(server),
            held: None,
        })
    }

    /// Stop the serve as a crashed process would: every reply in flight is torn where it
    /// is (mid-body, or before its status line), idle connections are closed, and the port
    /// refuses new connections. Returns once the listener and every connection are gone
    /// (at most 10 s). Running generations end as on a client disconnect; records and
    /// abort bodies are kept. A no-op when already killed.
    ///
    /// The port stays reserved for [`SglangDouble::restart`]: a socket bound to it, not
    /// listening (connections are refused, as by a dead process), which no port-0 bind or
    /// outgoing connection of another process can be given meanwhile.
    pub async fn kill(&mut self) {
        self.inner.kills.send_modify(|v| *v = v.wrapping_add(1));
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        if let Some(task) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
            if self.held.is_none() {
                self.held = crate::ports::ReservedPort::at(self.addr)
                    .map_err(|e| {
                        tracing::debug!("sglang double: {} not held while killed: {e}", self.addr)
                    })
                    .ok();
            }
        }
        self.inner.bump();
    }

    /// Serve again on the same address after [`SglangDouble::kill`] (same backend,
    /// faults, records and radix cache), listening on the socket `kill` kept bound. A
    /// no-op while running.
    ///
    /// # Errors
    /// The listen or bind error (bind only when `kill` could not keep the port).
    pub async fn restart(&mut self) -> std::io::Result<()> {
        if self.server.is_some() {
            return Ok(());
        }
        let listener = match self.held.take() {
            Some(port) => port.listen()?,
            None => TcpListener::bind(self.addr).await?,
        };
        let (tx, server) = crate::spawn_server_joinable(listener, router(&self.inner));
        self.shutdown = Some(tx);
        self.server = Some(server);
        Ok(())
    }

    /// Base URL, e.g. `http://127.0.0.1:41234`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The backend's facts.
    pub fn facts(&self) -> &ModelFacts {
        self.inner.backend.facts()
    }

    /// Apply `fault` to the next `/generate` call (faults queue in order).
    pub fn push_fault(&self, fault: Fault) {
        lock(&self.inner.faults).push_back(fault);
    }

    /// Apply `fault` to every `/generate` call with no queued fault (`None` clears it).
    pub fn set_fault(&self, fault: Option<Fault>) {
        *lock(&self.inner.sticky) = fault;
    }

    /// Every `/generate` call so far, in arrival order.
    pub fn generate_log(&self) -> Vec<GenerateRecord> {
        lock(&self.inner.records).clone()
    }

    /// Every `/abort_request` body received, in order.
    pub fn aborts(&self) -> Vec<Value> {
        lock(&self.inner.aborts).clone()
    }

    /// rids currently generating.
    pub fn live_rids(&self) -> Vec<String> {
        lock(&self.inner.live).keys().cloned().collect()
    }

    /// Forget every cached prefix (sglang `/flush_cache`).
    pub fn flush_cache(&self) {
        lock(&self.inner.radix).clear();
    }

    /// Wait until `pred` holds over (records, aborts, live rid count), re-checking on
    /// every change; `None` after `timeout`.
    pub async fn wait_until<T>(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[GenerateRecord], &[Value], usize) -> Option<T>,
    ) -> Option<T> {
        let mut rx = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            {
                let recs = lock(&self.inner.records);
                let aborts = lock(&self.inner.aborts);
                let live = lock(&self.inner.live).len();
                if let Some(v) = pred(&recs, &aborts, live) {
                    return Some(v);
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }
}

// ---------------------------------------------------------------------------- handlers

fn router(inner: &Arc<Inner>) -> Router {
    Router::new()
        .route("/generate", post(generate).put(generate))
        .route("/abort_request", post(abort_request))
        .route("/get_model_info", get(model_info))
        .route("/model_info", get(model_info))
        .route("/get_server_info", get(server_info))
        .route("/server_info", get(server_info))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .with_state(Arc::clone(inner))
}

/// Resolves when [`SglangDouble::kill`] is called after `kill` was subscribed.
async fn killed(mut kill: watch::Receiver<u64>) {
    if kill.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn json_response(status: StatusCode, body: Value) -> Response {
    let mut r = (status, body.to_string()).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

/// sglang's native error envelope, HTTP 400 (§1.1).
fn native_error(msg: &str) -> Response {
    json_response(StatusCode::BAD_REQUEST, json!({"error": {"message": msg}}))
}

/// An SSE body carrying one error event (§2.7: ValueErrors in a stream are still 200).
fn sse_error(msg: &str) -> Response {
    let body = format!(
        "data: {}\n\ndata: [DONE]\n\n",
        json!({"error": {"message": msg}})
    );
    sse_response(Body::from(body))
}

fn sse_response(body: Body) -> Response {
    let mut r = (StatusCode::OK, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    r
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn model_info(State(st): State<Arc<Inner>>) -> Response {
    let f = st.backend.facts();
    let path = st
        .cfg
        .model_path
        .clone()
        .unwrap_or_else(|| f.model_path.clone());
    json_response(
        StatusCode::OK,
        json!({"model_path": path, "tokenizer_path": path, "is_generation": true,
               "preferred_sampling_params": null, "weight_version": "default",
               "has_image_understanding": false, "has_audio_understanding": false,
               "model_type": f.model_type, "architectures": f.architectures}),
    )
}

async fn server_info(State(st): State<Arc<Inner>>) -> Response {
    let f = st.backend.facts();
    let path = st
        .cfg
        .model_path
        .clone()
        .unwrap_or_else(|| f.model_path.clone());
    json_response(
        StatusCode::OK,
        json!({"model_path": path, "tp_size": 1, "dp_size": 1, "chunked_prefill_size": 8192,
               "enable_return_hidden_states": st.cfg.enable_hidden_states,
               "enable_return_routed_experts": st.cfg.routed_experts,
               "enable_return_indexer_topk": st.cfg.indexer_topk,
               "forward_hooks": st.cfg.cells_spool.as_deref().map(cells_hooks::forward_hooks),
               "disable_radix_cache": !st.cfg.radix_cache, "speculative_algorithm": null,
               "context_length": f.context_length, "stream_interval": 1,
               "status": "ready", "max_total_num_tokens": f.context_length,
               "max_req_input_len": f.context_length.saturating_sub(6),
               "internal_states": [{"last_gen_throughput": 0.0,
                   "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": f.context_length, "graph": 0.0},
                   "effective_max_running_requests_per_dp": 64}],
               "version": "0.5.12.post1"}),
    )
}

async fn abort_request(State(st): State<Arc<Inner>>, body: Bytes) -> Response {
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let rid = v
        .get("rid")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let all = v.get("abort_all").and_then(Value::as_bool).unwrap_or(false);
    {
        let live = lock(&st.live);
        // The tokenizer manager forwards only an exact live rid (or abort_all); the
        // scheduler then aborts every live rid with that prefix (§3).
        if all || live.contains_key(&rid) {
            for (r, l) in live.iter() {
                if all || r.starts_with(&rid) {
                    l.aborted.store(true, Ordering::SeqCst);
                    l.notify.notify_waiters();
                    l.notify.notify_one();
                }
            }
        }
    }
    if st.cfg.record {
        lock(&st.aborts).push(v);
    }
    st.bump();
    StatusCode::OK.into_response()
}

/// A validated `/generate` request.
struct GenReq {
    rid: String,
    input_ids: Vec<u32>,
    max_new: usize,
    ignore_eos: bool,
    stream: bool,
    hidden: bool,
    logprob: bool,
    routed_experts: bool,
    /// `routed_experts_start_len` (absolute start position, default 0).
    routed_start: usize,
    indexer_topk: bool,
}

fn parse_req(v: &Value) -> Result<GenReq, String> {
    let ids = v
        .get("input_ids")
        .ok_or("Either text or input_ids should be provided.")?;
    let arr = ids.as_array().ok_or("input_ids must be a list of ints")?;
    if arr.iter().any(Value::is_array) {
        return Err("batch input is not supported by the sglang double".into());
    }
    let mut input_ids = Vec::with_capacity(arr.len());
    for x in arr {
        let t = x
            .as_u64()
            .filter(|t| *t <= u64::from(u32::MAX))
            .ok_or("input_ids must be a list of ints")?;
        input_ids.push(t as u32);
    }
    if input_ids.is_empty() {
        return Err("input_ids cannot be empty.".into());
    }
    let sp = v.get("sampling_params").cloned().unwrap_or(Value::Null);
    let max_new = sp
        .get("max_new_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(128) as usize;
    let ignore_eos = sp
        .get("ignore_eos")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let rid = match v.get("rid") {
        Some(Value::String(s)) => s.clone(),
        _ => uuid::Uuid::new_v4().simple().to_string(),
    };
    Ok(GenReq {
        rid,
        input_ids,
        max_new,
        ignore_eos,
        stream: v.get("stream").and_then(Value::as_bool).unwrap_or(false),
        hidden: v
            .get("return_hidden_states")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        logprob: v
            .get("return_logprob")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        routed_experts: v
            .get("return_routed_experts")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        routed_start: match v.get("routed_experts_start_len") {
            None | Some(Value::Null) => 0,
            Some(n) => match n.as_i64() {
                // sglang's `get_topk` raises this ValueError for a negative start.
                Some(i) if i < 0 => return Err(format!("start_len={i} must be non-negative")),
                Some(i) => usize::try_from(i).unwrap_or(usize::MAX),
                None => return Err("routed_experts_start_len must be an integer".into()),
            },
        },
        indexer_topk: v
            .get("return_indexer_topk")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    })
}

const HIDDEN_DISABLED: &str = "The server is not configured to return the hidden states. Please set `--enable-return-hidden-states` to enable this feature.";

async fn generate(State(st): State<Arc<Inner>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return json_response(
                StatusCode::BAD_REQUEST,
                json!({"object":"error","message":e.to_string(),"type":"Bad Request","param":null,"code":400}),
            )
        }
    };
    let kill = st.kills.subscribe();
    let fault = st.next_fault();
    let stream = v.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let refuse = |msg: &str| {
        if stream {
            sse_error(msg)
        } else {
            native_error(msg)
        }
    };
    let req = match parse_req(&v) {
        Ok(r) => r,
        Err(m) => return refuse(&m),
    };
    // `usize::MAX` (never an index) when not recording: every `update_record` is a no-op.
    let idx = if !st.cfg.record {
        usize::MAX
    } else {
        let mut recs = lock(&st.records);
        recs.push(GenerateRecord {
            rid: req.rid.clone(),
            request: v.clone(),
            input_ids: req.input_ids.clone(),
            stream,
            fault: fault.clone(),
            cached_tokens: 0,
            output_ids: Vec::new(),
            hidden_states: Vec::new(),
            finish_reason: Value::Null,
            done: false,
            events: Vec::new(),
        });
        recs.len() - 1
    };
    st.bump();
    let finish_refused = |st: &Inner| st.update_record(idx, |r| r.done = true);
    if let Some(Fault::Status(code)) = fault {
        finish_refused(&st);
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return json_response(
            status,
            json!({"object":"error","message":"injected fault","type":code.to_string(),"param":null,"code":code}),
        );
    }
    if let Some(Fault::Raw(bytes)) = fault {
        finish_refused(&st);
        let mut r = (StatusCode::OK, bytes).into_response();
        let ct = if stream {
            "text/event-stream; charset=utf-8"
        } else {
            "application/json"
        };
        r.headers_mut()
            .insert(header::CONTENT_TYPE, header::HeaderValue::from_static(ct));
        return r;
    }
    if req.hidden && (!st.cfg.enable_hidden_states || fault == Some(Fault::HiddenStatesDisabled)) {
        finish_refused(&st);
        return refuse(HIDDEN_DISABLED);
    }
    let facts = st.backend.facts();
    if req.input_ids.len() + req.max_new > facts.context_length {
        finish_refused(&st);
        return refuse(&format!(
            "Requested token count exceeds the model's maximum context length of {} tokens.",
            facts.context_length
        ));
    }
    let live = Arc::new(Live {
        aborted: AtomicBool::new(false),
        notify: Notify::new(),
    });
    {
        let mut l = lock(&st.live);
        if l.contains_key(&req.rid) {
            drop(l);
            finish_refused(&st);
            return refuse(&format!("Duplicate request ID detected: {}", req.rid));
        }
        l.insert(req.rid.clone(), Arc::clone(&live));
    }
    st.bump();
    let (tx, mut rx) = mpsc::channel::<Out>(4);
    let stream_flag = req.stream;
    let gen = Generation {
        st: Arc::clone(&st),
        idx,
        req,
        fault,
        live,
        tx,
        started: Instant::now(),
    };
    tokio::spawn(gen.run());
    if stream_flag {
        return sse_response(body_of(None, rx, kill));
    }
    // Non-stream: like sglang, nothing (not even the status line) until the reply exists.
    // A client that leaves drops this future, which closes the channel and stops the run.
    let first = tokio::select! {
        o = rx.recv() => o,
        _ = killed(kill.clone()) => Some(Out::Tear),
    };
    match first {
        Some(Out::Error(code, b)) => {
            let mut r = (code, b).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            r
        }
        first => {
            let mut r = (StatusCode::OK, body_of(first, rx, kill)).into_response();
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                header::HeaderValue::from_static("application/json"),
            );
            r
        }
    }
}

/// What a generation hands the HTTP layer.
enum Out {
    /// Body bytes.
    Data(Bytes),
    /// Non-stream: an error status and body (stream: sent as data).
    Error(StatusCode, Bytes),
    /// Tear the connection down here.
    Tear,
}

/// The reply body: `first`, then what the generation sends, torn at once on
/// [`SglangDouble::kill`] (`kill` subscribed when the request arrived).
fn body_of(first: Option<Out>, rx: mpsc::Receiver<Out>, kill: watch::Receiver<u64>) -> Body {
    let conv = |o: Out| match o {
        Out::Data(b) | Out::Error(_, b) => Ok(b),
        Out::Tear => Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "injected: connection torn",
        )),
    };
    let head = futures_util::stream::iter(first.map(conv));
    let rest = futures_util::stream::unfold(Some((rx, kill)), move |state| async move {
        let (mut rx, kill) = state?;
        tokio::select! {
            o = rx.recv() => o.map(|o| (conv(o), Some((rx, kill)))),
            _ = killed(kill.clone()) => Some((conv(Out::Tear), None)),
        }
    });
    Body::from_stream(futures_util::StreamExt::chain(head, rest))
}

/// Removes the rid from the live set however the generation ends.
struct LiveGuard {
    st: Arc<Inner>,
    rid: String,
    idx: usize,
}

impl Drop for LiveGuard {
    fn drop(&mut self) {
        lock(&self.st.live).remove(&self.rid);
        self.st.update_record(self.idx, |r| r.done = true);
    }
}

struct Generation {
    st: Arc<Inner>,
    idx: usize,
    req: GenReq,
    fault: Option<Fault>,
    live: Arc<Live>,
    tx: mpsc::Sender<Out>,
    started: Instant,
}

/// Accumulated state of one generation, rendered into events.
struct Acc {
    cached: usize,
    output_ids: Vec<u32>,
    logprobs: Vec<f32>,
    elements: Vec<Element>,
    /// Routed experts of every position run so far (all input positions, then one per
    /// decode step), int32 row-major.
    routing: Vec<i32>,
    /// Indexer top-k of the same positions.
    indexer: Vec<i32>,
}

impl Generation {
    async fn run(self) {
        let _guard = LiveGuard {
            st: Arc::clone(&self.st),
            rid: self.req.rid.clone(),
            idx: self.idx,
        };
        let hidden = self.st.backend.facts().hidden_size;
        // Hang: wait in the "queue" until aborted or the client leaves.
        if self.fault == Some(Fault::Hang) {
            tokio::select! {
                _ = self.tx.closed() => return,
                _ = wait_abort(&self.live) => {}
            }
            let fin = json!({"type":"abort","message":"Abort in waiting queue"});
            let mut meta = serde_json::Map::new();
            meta.insert("id".into(), json!(self.req.rid));
            meta.insert("finish_reason".into(), fin.clone());
            meta.insert("weight_version".into(), json!("default"));
            meta.insert(
                "e2e_latency".into(),
                json!(self.started.elapsed().as_secs_f64()),
            );
            if self.req.logprob {
                meta.insert("input_token_logprobs".into(), json!([]));
                meta.insert("output_token_logprobs".into(), json!([]));
                meta.insert("output_token_logprobs_length".into(), json!(0));
            }
            meta.insert("completion_tokens".into(), json!(0));
            meta.insert("response_sent_to_client_ts".into(), json!(unix_now()));
            let ev = json!({"text":"","output_ids":[],"meta_info":meta});
            self.st.update_record(self.idx, |r| r.finish_reason = fin);
            let out = if self.req.stream {
                format!("data: {ev}\n\ndata: [DONE]\n\n")
            } else {
                ev.to_string()
            };
            let _ = self.tx.send(Out::Data(Bytes::from(out))).await;
            return;
        }
        let cached = if self.st.cfg.radix_cache {
            self.radix_match()
        } else {
            0
        };
        self.st
            .update_record(self.idx, |r| r.cached_tokens = cached);
        if self.st.cfg.cells_spool.is_some() {
            self.run_cells_hooks(cached).await;
        }
        let mut acc = Acc {
            cached,
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            elements: Vec::new(),
            routing: Vec::new(),
            indexer: Vec::new(),
        };
        let backend = Arc::clone(&self.st.backend);
        let ids = self.req.input_ids.clone();
        let started = tokio::task::spawn_blocking(move || backend.start(&ids, cached)).await;
        let mut session = match started {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return self.scheduler_error(&e.0).await,
            Err(e) => return self.scheduler_error(&e.to_string()).await,
        };
        let eos = self.st.backend.facts().eos_token_ids.clone();
        let mut events_sent = 0usize;
        let finish: Value;
        loop {
            if let Some(Fault::Slow(d)) = self.fault {
                tokio::select! {
                    _ = tokio::time::sleep(d) => {}
                    _ = self.tx.closed() => return,
                }
            }
            let res = tokio::task::spawn_blocking(move || {
                let r = session.step();
                (session, r)
            })
            .await;
            let step = match res {
                Ok((s, Ok(step))) => {
                    session = s;
                    step
                }
                Ok((_, Err(e))) => return self.scheduler_error(&e.0).await,
                Err(e) => return self.scheduler_error(&e.to_string()).await,
            };
            let rows: Vec<Vec<f32>> = step
                .rows
                .chunks(hidden.max(1))
                .map(<[f32]>::to_vec)
                .collect();
            if acc.output_ids.is_empty() {
                acc.elements.push(Element::Block(rows));
            } else {
                acc.elements
                    .push(Element::Row(rows.into_iter().next().unwrap_or_default()));
            }
            acc.routing.extend(step.routing.unwrap_or_default());
            acc.indexer.extend(step.indexer_topk.unwrap_or_default());
            acc.output_ids.push(step.token_id);
            acc.logprobs.push(step.logprob);
            let n = acc.output_ids.len();
            let fin = if !self.req.ignore_eos && eos.contains(&step.token_id) {
                Some(json!({"type":"stop","matched":step.token_id}))
            } else if n >= self.req.max_new {
                Some(json!({"type":"length","length":self.req.max_new}))
            } else if self.live.aborted.load(Ordering::SeqCst) {
                if self.fault == Some(Fault::TornOnAbort) {
                    let _ = self.tx.send(Out::Tear).await;
                    return;
                }
                Some(json!({"type":"abort","message":"Aborted","status_code":null,"err_type":null}))
            } else {
                None
            };
            if let Some(f) = fin {
                finish = f;
                break;
            }
            if self.req.stream {
                if let Some(Fault::DieAfterEvents(k)) = self.fault {
                    if events_sent >= k {
                        let _ = self.tx.send(Out::Tear).await;
                        return;
                    }
                }
                let ev = self.render(&acc, &Value::Null, events_sent == 0, false);
                if self
                    .tx
                    .send(Out::Data(Bytes::from(format!("data: {ev}\n\n"))))
                    .await
                    .is_err()
                {
                    return; // client left
                }
                events_sent += 1;
                if self.st.cfg.record {
                    let mark = EventMark {
                        at: Instant::now(),
                        text_len: self.visible_text(&acc, false).len(),
                    };
                    self.st.update_record(self.idx, |r| r.events.push(mark));
                }
            } else if self.tx.is_closed() {
                return;
            }
        }
        // Final reply, rendered off the runtime: at hidden 2048 it is megabytes of floats,
        // and the other generations' events must not wait behind it.
        self.apply_row_faults(&mut acc);
        let first = events_sent == 0 || !self.req.stream;
        let fin = finish.clone();
        let rendered = tokio::task::spawn_blocking(move || {
            let ev = self.render(&acc, &fin, first, true);
            (self, acc, ev)
        })
        .await;
        if let Ok((this, acc, ev)) = rendered {
            this.send_final(acc, finish, ev, events_sent).await;
        }
    }

    /// The engy_cells hooks on this call's prefill (positions `cached..`): the backend's
    /// cells spooled as [`cells_hooks::Spool::pass`] writes them. A hook never fails the
    /// serve: problems are logged (and, as the hooks do, written to the manifest).
    async fn run_cells_hooks(&self, cached: usize) {
        let backend = Arc::clone(&self.st.backend);
        let ids = self.req.input_ids.clone();
        let st = Arc::clone(&self.st);
        let r = tokio::task::spawn_blocking(move || {
            let cells = match backend.cells(&ids) {
                None => return Ok(()),
                Some(Ok(c)) => c,
                Some(Err(e)) => return Err(std::io::Error::other(e.0)),
            };
            let mut spool = lock(&st.spool);
            let Some(spool) = spool.as_mut() else {
                return Ok(());
            };
            let n_layers = cells
                .iter()
                .take_while(|c| c.position() == 0)
                .count()
                .max(1);
            let pass_cells = cells.get(cached * n_layers..).unwrap_or(&[]);
            spool.pass(cached, &ids[cached.min(ids.len())..], pass_cells)
        })
        .await;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!("engy_cells: {e} (this request's cells are marked failed)")
            }
            Err(e) => tracing::error!("engy_cells: hook task failed: {e}"),
        }
    }

    /// Record the finished call and send its final reply (after [`Self::render`]).
    async fn send_final(self, acc: Acc, finish: Value, ev: String, events_sent: usize) {
        if self.st.cfg.radix_cache {
            let mut seq = self.req.input_ids.clone();
            seq.extend_from_slice(
                acc.output_ids
                    .get(..acc.output_ids.len().saturating_sub(1))
                    .unwrap_or(&[]),
            );
            let mut radix = lock(&self.st.radix);
            radix.push_back(seq);
            while radix.len() > 512 {
                radix.pop_front();
            }
        }
        let served = acc.elements.clone();
        let out_ids = acc.output_ids.clone();
        self.st.update_record(self.idx, |r| {
            r.output_ids = out_ids;
            r.hidden_states = served;
            r.finish_reason = finish.clone();
        });
        let text = if self.req.stream {
            format!("data: {ev}\n\n")
        } else {
            ev
        };
        let bytes = Bytes::from(text.into_bytes());
        let stall = matches!(
            (&self.fault, self.req.stream),
            (Some(Fault::StallFinalLine), true) | (Some(Fault::StallBody), false)
        );
        match self.fault {
            Some(Fault::DieAfterEvents(_)) if !self.req.stream => {
                let half = bytes.slice(..bytes.len() / 2);
                let _ = self.tx.send(Out::Data(half)).await;
                let _ = self.tx.send(Out::Tear).await;
            }
            Some(Fault::DieAfterEvents(k)) if events_sent >= k => {
                let _ = self.tx.send(Out::Tear).await;
            }
            _ if stall => {
                let half = bytes.slice(..bytes.len() / 2);
                if self.tx.send(Out::Data(half)).await.is_err() {
                    return;
                }
                tokio::select! {
                    _ = self.tx.closed() => {}
                    _ = wait_abort(&self.live) => { let _ = self.tx.send(Out::Tear).await; }
                }
            }
            _ => {
                if self.tx.send(Out::Data(bytes)).await.is_err() {
                    return;
                }
                if self.req.stream {
                    let _ = self
                        .tx
                        .send(Out::Data(Bytes::from_static(b"data: [DONE]\n\n")))
                        .await;
                }
            }
        }
    }

    fn radix_match(&self) -> usize {
        let ids = &self.req.input_ids;
        let radix = lock(&self.st.radix);
        let best = radix
            .iter()
            .map(|s| s.iter().zip(ids.iter()).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0);
        best.min(ids.len().saturating_sub(1))
    }

    async fn scheduler_error(&self, msg: &str) {
        let fin = json!({"type":"abort","message":msg,"status_code":500,"err_type":"InternalServerError"});
        self.st
            .update_record(self.idx, |r| r.finish_reason = fin.clone());
        let body = json!({"object":"error","message":msg,"type":"500","param":null,"code":500});
        let out = if self.req.stream {
            Out::Data(Bytes::from(format!("data: {body}\n\ndata: [DONE]\n\n")))
        } else {
            Out::Error(
                StatusCode::INTERNAL_SERVER_ERROR,
                Bytes::from(body.to_string()),
            )
        };
        let _ = self.tx.send(out).await;
    }

    fn apply_row_faults(&self, acc: &mut Acc) {
        match &self.fault {
            Some(Fault::EmptyPrefillBlock) => {
                if let Some(Element::Block(b)) = acc.elements.first_mut() {
                    b.clear();
                }
            }
            Some(Fault::ForeignPrefillRows(n)) => {
                let hidden = self.st.backend.facts().hidden_size;
                if let Some(Element::Block(b)) = acc.elements.first_mut() {
                    for i in 0..*n {
                        b.push(
                            (0..hidden)
                                .map(|j| ((i * 7 + j) % 13) as f32 * 0.25 - 1.5)
                                .collect(),
                        );
                    }
                }
            }
            Some(Fault::MissingDecodeRow) if acc.elements.len() > 1 => {
                acc.elements.pop();
            }
            Some(Fault::RaggedRowWidth) => {
                if let Some(Element::Row(r)) = acc.elements.last_mut() {
                    r.pop();
                }
            }
            Some(Fault::Retraction) => {
                if let Some(e) = acc.elements.get_mut(1) {
                    if let Element::Row(r) = e {
                        *e = Element::Block(vec![r.clone(), r.clone()]);
                    }
                }
            }
            Some(Fault::NoHiddenStates) => acc.elements.clear(),
            _ => {}
        }
        if self.st.cfg.engy_trimmed {
            if let Some(Element::Block(b)) = acc.elements.first_mut() {
                if let Some(last) = b.pop() {
                    *b = vec![last];
                }
            }
        }
    }

    /// The routing rows of the final reply, with the fault to apply, when they are sent:
    /// `[routed_experts_start_len, seqlen − 1)` with `seqlen` = prompt + output tokens and
    /// the start clamped to `seqlen − 1` (sglang's `BaseTopkCapturer.get_topk`).
    fn routed_rows(&self, acc: &Acc) -> Option<(Vec<i32>, Option<TraceFault>)> {
        let shape = self.st.backend.facts().routing?;
        if !(self.req.routed_experts && self.st.cfg.routed_experts) || acc.routing.is_empty() {
            return None;
        }
        let row = shape.num_hidden_layers * shape.num_experts_per_tok;
        let seqlen = self.req.input_ids.len() + acc.output_ids.len();
        let start = self.req.routed_start.min(seqlen - 1);
        let rows = acc
            .routing
            .get(start * row..(seqlen - 1) * row)
            .unwrap_or_default()
            .to_vec();
        let fault = match self.fault {
            Some(Fault::RoutedExperts(f)) => Some(f),
            _ => None,
        };
        Some((rows, fault))
    }

    /// The indexer rows of the final reply: always `[0, seqlen − 1)` (sglang's
    /// `_maybe_collect_indexer_topk` passes no start).
    fn indexer_rows(&self, acc: &Acc) -> Option<(Vec<i32>, Option<TraceFault>)> {
        let shape = self.st.backend.facts().indexer?;
        if !(self.req.indexer_topk && self.st.cfg.indexer_topk) || acc.indexer.is_empty() {
            return None;
        }
        let row = shape.layers * shape.index_topk;
        let seqlen = self.req.input_ids.len() + acc.output_ids.len();
        let rows = acc
            .indexer
            .get(..(seqlen - 1) * row)
            .unwrap_or_default()
            .to_vec();
        let fault = match self.fault {
            Some(Fault::IndexerTopk(f)) => Some(f),
            _ => None,
        };
        Some((rows, fault))
    }

    /// `,"<key>":"<base64 of LE int32>"` (sglang's detokenizer encoding), broken by `fault`.
    fn push_trace(&self, s: &mut String, key: &str, rows: Option<(Vec<i32>, Option<TraceFault>)>) {
        let Some((rows, fault)) = rows else { return };
        let row_len = match key {
            "routed_experts" => self
                .st
                .backend
                .facts()
                .routing
                .map(|r| r.num_hidden_layers * r.num_experts_per_tok),
            _ => self
                .st
                .backend
                .facts()
                .indexer
                .map(|i| i.layers * i.index_topk),
        }
        .unwrap_or(1);
        let value = match fault {
            None => Value::String(engy_core::trace::sglang_int32_base64(&rows)),
            Some(TraceFault::Missing) => return,
            Some(TraceFault::NotBase64) => Value::String("!not base64!".into()),
            Some(TraceFault::NotAString) => json!(12345),
            Some(TraceFault::OneRowShort) => {
                let keep = rows.len().saturating_sub(row_len);
                Value::String(engy_core::trace::sglang_int32_base64(&rows[..keep]))
            }
            Some(TraceFault::CutMidValue) => {
                let mut bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
                bytes.truncate(bytes.len().saturating_sub(2));
                use base64::Engine as _;
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            }
        };
        s.push_str(&format!(",\"{key}\":{value}"));
    }

    /// The cumulative text of an event: on a streamed event before the last, trailing
    /// U+FFFD (an incomplete UTF-8 sequence of the last tokens) is held back until the
    /// bytes complete, as sglang's incremental detokenizer does (sglang-native-api.md
    /// §2.7); the last event and a non-stream body carry the whole decode.
    fn visible_text(&self, acc: &Acc, last: bool) -> String {
        let text = self.st.backend.decode(&acc.output_ids).unwrap_or_default();
        if last || !self.req.stream {
            return text;
        }
        let keep = text.trim_end_matches('\u{fffd}').len();
        let mut text = text;
        text.truncate(keep);
        text
    }

    /// One reply object (non-stream body or SSE event payload), keys in sglang's order.
    fn render(&self, acc: &Acc, finish: &Value, first: bool, last: bool) -> String {
        let mut s = String::with_capacity(256 + acc.elements.len() * 16);
        let text = self.visible_text(acc, last);
        s.push_str("{\"text\":");
        s.push_str(&Value::String(text).to_string());
        s.push_str(",\"output_ids\":");
        s.push_str(&json!(acc.output_ids).to_string());
        s.push_str(",\"meta_info\":{\"id\":");
        s.push_str(&Value::String(self.req.rid.clone()).to_string());
        s.push_str(",\"finish_reason\":");
        s.push_str(&finish.to_string());
        let n = acc.output_ids.len();
        s.push_str(&format!(
            ",\"prompt_tokens\":{},\"weight_version\":\"default\",\"num_retractions\":{}",
            self.req.input_ids.len(),
            u8::from(self.fault == Some(Fault::Retraction))
        ));
        if self.req.logprob {
            s.push_str(",\"input_token_logprobs\":[],\"output_token_logprobs\":[");
            for (i, (lp, id)) in acc.logprobs.iter().zip(acc.output_ids.iter()).enumerate() {
                if i > 0 {
                    s.push(',');
                }
                s.push('[');
                push_f64(&mut s, f64::from(*lp));
                s.push_str(&format!(",{id},null]"));
            }
            s.push_str(&format!("],\"output_token_logprobs_length\":{n}"));
        }
        s.push_str(&format!(
            ",\"reasoning_tokens\":0,\"completion_tokens\":{n},\"cached_tokens\":{}",
            acc.cached
        ));
        if acc.cached == 0 {
            s.push_str(",\"cached_tokens_details\":null");
        } else {
            s.push_str(&format!(
                ",\"cached_tokens_details\":{{\"device\":{},\"host\":0}}",
                acc.cached
            ));
        }
        if self.req.hidden {
            s.push_str(",\"hidden_states\":");
            if self.st.cfg.engy_trimmed && !last {
                s.push_str("[]");
            } else {
                push_elements(&mut s, &acc.elements);
            }
        }
        if last {
            // Collected when the request finishes (sglang's `_maybe_collect_routed_experts`):
            // the final reply only, after `hidden_states`.
            self.push_trace(&mut s, "routed_experts", self.routed_rows(acc));
            self.push_trace(&mut s, "indexer_topk", self.indexer_rows(acc));
        }
        s.push_str(",\"dp_rank\":null");
        if last {
            s.push_str(",\"e2e_latency\":");
            push_f64(&mut s, self.started.elapsed().as_secs_f64());
        }
        if first {
            s.push_str(",\"response_sent_to_client_ts\":");
            push_f64(&mut s, unix_now());
        }
        s.push_str("}}");
        if self.fault == Some(Fault::MalformedJson) {
            s.truncate(s.len() / 2);
        }
        s
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

async fn wait_abort(live: &Live) {
    loop {
        let n = live.notify.notified();
        if live.aborted.load(Ordering::SeqCst) {
            return;
        }
        n.await;
    }
}

/// Shortest round-trip decimal of a float, as orjson prints Python floats (values are
/// bf16-exact, so the f64 of the f32 is the same number).
fn push_f64(s: &mut String, v: f64) {
    if v.is_finite() {
        let mut buf = Vec::with_capacity(24);
        if serde_json::to_writer(&mut buf, &v).is_ok() {
            s.push_str(std::str::from_utf8(&buf).unwrap_or("0.0"));
            return;
        }
    }
    s.push_str("null");
}

fn push_row(s: &mut String, row: &[f32]) {
    s.push('[');
    for (i, v) in row.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        push_f64(s, f64::from(*v));
    }
    s.push(']');
}

fn push_elements(s: &mut String, elements: &[Element]) {
    s.push('[');
    for (i, e) in elements.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        match e {
            Element::Block(rows) => {
                s.push('[');
                for (j, r) in rows.iter().enumerate() {
                    if j > 0 {
                        s.push(',');
                    }
                    push_row(s, r);
                }
                s.push(']');
            }
            Element::Row(r) => push_row(s, r),
        }
    }
    s.push(']');
}
