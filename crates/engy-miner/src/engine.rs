//! Serving one request on the sglang serves (PROTOCOL.md §3): prompt, serve choice,
//! chunked generation with the one-token overlap, row collection and alignment checks,
//! streaming deltas, the TOPLOC proof, `output` and `commitment`.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engy_core::toploc::{build_proofs_base64, Dtype, Params};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::chat::Prompter;
use crate::scan::{scan_reply, Finish, HiddenMode, Reply, Rows};

/// How a job ended without a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobError {
    /// The gateway cancelled it: nothing more goes on the wire.
    Cancelled,
    /// It failed; the string is the (≤ 300 char) error sent to the gateway.
    Failed(String),
}

fn fail(msg: impl Into<String>) -> JobError {
    JobError::Failed(msg.into())
}

/// Cancellation state of one gateway request (corr_id), shared by the leg that received
/// it and the task serving it. Registered before the task starts, so a `cancel` that
/// arrives first is honoured.
#[derive(Debug, Default)]
pub struct Job {
    token: CancellationToken,
    state: Mutex<JobState>,
}

#[derive(Debug, Default)]
struct JobState {
    cancelled: bool,
    /// (serve URL, rid) of every live serve call.
    rids: Vec<(String, String)>,
}

impl Job {
    /// A fresh, uncancelled job.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True once cancelled.
    pub fn is_cancelled(&self) -> bool {
        self.state().cancelled
    }

    /// Mark cancelled and return the live serve calls to abort. Idempotent (a second call
    /// returns nothing).
    pub fn cancel(&self) -> Vec<(String, String)> {
        let mut st = self.state();
        if st.cancelled {
            return Vec::new();
        }
        st.cancelled = true;
        self.token.cancel();
        st.rids.clone()
    }

    /// Run `f` unless cancelled, atomically with respect to [`Job::cancel`]: used to put a
    /// frame on the wire only while the job is live.
    pub fn if_live<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let st = self.state();
        if st.cancelled {
            None
        } else {
            Some(f())
        }
    }

    /// Resolves when cancelled.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    fn add_rid(&self, serve: &str, rid: &str) -> Result<(), JobError> {
        let mut st = self.state();
        if st.cancelled {
            return Err(JobError::Cancelled);
        }
        st.rids.push((serve.to_string(), rid.to_string()));
        Ok(())
    }

    fn remove_rid(&self, rid: &str) {
        self.state().rids.retain(|(_, r)| r != rid);
    }
}

/// Settings of the request path.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// `model_root` (§4) stamped on every commitment.
    pub model_root: String,
    /// TOPLOC parameters (`skip_prefill` is always true, §3.8).
    pub topk: usize,
    /// Decode batching size.
    pub dbs: usize,
    /// Default max_tokens.
    pub max_tokens: u64,
    /// MAX_OUTPUT_TOKENS.
    pub max_output_tokens: u64,
    /// Output tokens per serve call.
    pub gen_chunk: usize,
    /// HTTP timeout per serve call.
    pub serve_timeout: Duration,
    /// `hidden_size` from config.json, when known: every row must have it.
    pub hidden_size: Option<usize>,
    /// Cap on one reply (body or SSE line), bytes.
    pub reply_cap: usize,
}

/// One configured serve and its in-flight count.
#[derive(Debug)]
struct ServeSlot {
    url: String,
    inflight: AtomicUsize,
}

/// Releases a serve slot when dropped (always, on every exit path).
pub struct SlotGuard<'a> {
    slot: &'a ServeSlot,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.slot.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The request path, shared by every leg.
pub struct Engine {
    cfg: EngineConfig,
    prompter: Arc<Prompter>,
    serves: Vec<ServeSlot>,
    pick: Mutex<()>,
    gen_client: reqwest::Client,
    abort_client: reqwest::Client,
}

/// Streaming state: deltas of the cumulative text go to `emit`.
pub struct StreamSink<'a> {
    emit: &'a mut (dyn FnMut(&str) + Send),
}

impl<'a> StreamSink<'a> {
    /// Wrap a delta callback.
    pub fn new(emit: &'a mut (dyn FnMut(&str) + Send)) -> Self {
        Self { emit }
    }
}

/// What one serve call returned, validated.
struct CallOut {
    output_ids: Vec<u32>,
    rows: Rows,
    finish: Finish,
    cached: u64,
}

fn probe(serve: &str) -> String {
    format!(
        "curl -s {serve}/generate -H 'Content-Type: application/json' -d '{{\"input_ids\":[9707,11,1879],\"sampling_params\":{{\"max_new_tokens\":4,\"temperature\":0}},\"return_hidden_states\":true,\"return_logprob\":true}}' | head -c 600"
    )
}

/// Truncate an error for the `error` field (≤ 300 chars, PROTOCOL.md §2).
pub fn short(msg: &str) -> String {
    if msg.chars().count() <= 300 {
        msg.to_string()
    } else {
        let mut s: String = msg.chars().take(297).collect();
        s.push_str("...");
        s
    }
}

impl Engine {
    /// Build the engine.
    ///
    /// # Errors
    /// When an HTTP client cannot be built or no serve URL is given.
    pub fn new(
        cfg: EngineConfig,
        prompter: Arc<Prompter>,
        serve_urls: &[String],
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !serve_urls.is_empty(),
            "no serve URL configured (--serve-url / SERVE_URL)"
        );
        let gen_client = reqwest::Client::builder()
            .timeout(cfg.serve_timeout)
            .pool_max_idle_per_host(256)
            .build()?;
        // Aborts get their own client (own connection pool): busy generation calls can
        // never starve them (PROTOCOL.md §2 cancel).
        let abort_client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        let serves = serve_urls
            .iter()
            .map(|u| ServeSlot {
                url: u.clone(),
                inflight: AtomicUsize::new(0),
            })
            .collect();
        Ok(Self {
            cfg,
            prompter,
            serves,
            pick: Mutex::new(()),
            gen_client,
            abort_client,
        })
    }

    /// Least-in-flight serve (§3.3); the guard releases it.
    fn pick_serve(&self) -> Option<SlotGuard<'_>> {
        let _g = self.pick.lock().unwrap_or_else(|p| p.into_inner());
        let slot = self
            .serves
            .iter()
            .min_by_key(|s| s.inflight.load(Ordering::SeqCst))?;
        slot.inflight.fetch_add(1, Ordering::SeqCst);
        Some(SlotGuard { slot })
    }

    /// Send `/abort_request` for each (serve, rid), on the dedicated client. Best effort;
    /// failures are logged.
    pub fn abort_rids(self: &Arc<Self>, rids: Vec<(String, String)>) {
        for (serve, rid) in rids {
            let client = self.abort_client.clone();
            tokio::spawn(async move {
                let r = client
                    .post(format!("{serve}/abort_request"))
                    .json(&json!({ "rid": rid }))
                    .send()
                    .await;
                match r {
                    Ok(resp) if resp.status().is_success() => {
                        tracing::info!(%serve, %rid, "abort sent")
                    }
                    Ok(resp) => {
                        tracing::warn!(%serve, %rid, status = %resp.status(), "abort_request refused")
                    }
                    Err(e) => tracing::warn!(%serve, %rid, error = %e, "abort_request failed"),
                }
            });
        }
    }

    /// Serve one gateway request end to end; `stream` receives text deltas when the
    /// gateway asked for streaming. Returns `(commitment, output)`.
    ///
    /// # Errors
    /// [`JobError::Cancelled`] when the job was cancelled, [`JobError::Failed`] otherwise.
    pub async fn process(
        self: &Arc<Self>,
        request: &Value,
        job: &Arc<Job>,
        mut stream: Option<StreamSink<'_>>,
    ) -> Result<(Value, Value), JobError> {
        if job.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        let messages = request.get("messages").cloned().unwrap_or(Value::Null);
        let prompter = Arc::clone(&self.prompter);
        let prompt_ids = tokio::task::spawn_blocking(move || prompter.prompt_ids(&messages))
            .await
            .map_err(|e| fail(format!("prompt task failed: {e}")))?
            .map_err(|e| fail(e.to_string()))?;
        if prompt_ids.is_empty() {
            return Err(fail("chat template produced an empty prompt"));
        }
        let requested = match request
            .get("max_tokens")
            .or_else(|| request.get("max_completion_tokens"))
        {
            Some(Value::Number(n)) => n.as_u64().filter(|v| *v > 0).unwrap_or(self.cfg.max_tokens),
            _ => self.cfg.max_tokens,
        };
        let max_new = requested.min(self.cfg.max_output_tokens) as usize;
        let slot = self
            .pick_serve()
            .ok_or_else(|| fail("no serve configured"))?;
        let serve = slot.slot.url.clone();
        let started = Instant::now();
        let gen = self
            .generate_chunked(&serve, &prompt_ids, max_new, &mut stream, job)
            .await;
        drop(slot);
        let gen = gen?;
        if job.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        let n_rows = gen.n_rows();
        let width = gen.width;
        let params = Params {
            topk: self.cfg.topk,
            decode_batching_size: self.cfg.dbs,
            skip_prefill: true,
        };
        let prompter = Arc::clone(&self.prompter);
        let ids_for_text = gen.output_ids.clone();
        let bits = gen.bits;
        let (proofs, text) = tokio::task::spawn_blocking(move || {
            let elements: Vec<&[u16]> = bits.chunks_exact(width.max(1)).collect();
            let proofs = build_proofs_base64(&elements, Dtype::Bf16, &params);
            let text = prompter.decode(&ids_for_text);
            (proofs, text)
        })
        .await
        .map_err(|e| fail(format!("proof task failed: {e}")))?;
        let proofs = proofs.map_err(|e| {
            fail(format!(
                "TOPLOC proof could not be built over {n_rows} rows of {width}: {e}"
            ))
        })?;
        let text = text.map_err(|e| fail(e.to_string()))?;
        let mut prompt_full = prompt_ids;
        prompt_full.extend_from_slice(&gen.prompt_extra);
        let n_prompt = prompt_full.len() as u64;
        let mut usage = json!({
            "prompt_tokens": n_prompt,
            "completion_tokens": n_rows,
            "total_tokens": n_prompt + n_rows as u64,
        });
        if gen.cached > 0 {
            usage["prompt_tokens_details"] = json!({ "cached_tokens": gen.cached.min(n_prompt) });
        }
        let output = json!({
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}],
            "usage": usage,
        });
        let commitment = json!({
            "model_root": self.cfg.model_root,
            "output_token_ids": gen.output_ids,
            "toploc": {
                "proofs": proofs,
                "topk": self.cfg.topk,
                "decode_batching_size": self.cfg.dbs,
                "skip_prefill": true,
                "n_tokens": n_rows,
                "prompt_ids": prompt_full,
            },
        });
        tracing::info!(
            serve = %serve, prompt_tokens = n_prompt, completion_tokens = n_rows,
            cached = gen.cached, calls = gen.calls, ms = started.elapsed().as_millis() as u64,
            "generated and proved"
        );
        Ok((commitment, output))
    }

    /// §3.4–§3.5: chunks of at most GEN_CHUNK tokens, one-token overlap on continuations.
    async fn generate_chunked(
        self: &Arc<Self>,
        serve: &str,
        prompt_ids: &[u32],
        max_new: usize,
        stream: &mut Option<StreamSink<'_>>,
        job: &Arc<Job>,
    ) -> Result<Generated, JobError> {
        let mut g = Generated::default();
        let chunk = self.cfg.gen_chunk.max(1);
        while g.output_ids.len() < max_new {
            if job.is_cancelled() {
                return Err(JobError::Cancelled);
            }
            let want = chunk.min(max_new - g.output_ids.len());
            let produced;
            let finish;
            if g.output_ids.is_empty() {
                let out = self
                    .call(serve, prompt_ids, want, stream.as_mut(), false, job)
                    .await?;
                g.calls += 1;
                g.cached = out.cached;
                let offset = out.rows.offset;
                let mut oids = out.output_ids;
                if offset > 0 {
                    // Prompt already cached → those tokens have no row: fold them in.
                    g.prompt_extra = oids.drain(..offset.min(oids.len())).collect();
                }
                g.push_rows(&out.rows, 0, oids.len())?;
                produced = oids.len();
                g.output_ids.extend(oids);
                finish = out.finish;
            } else {
                let mut input = Vec::with_capacity(
                    prompt_ids.len() + g.prompt_extra.len() + g.output_ids.len(),
                );
                input.extend_from_slice(prompt_ids);
                input.extend_from_slice(&g.prompt_extra);
                input.extend_from_slice(g.output_ids.get(..g.output_ids.len() - 1).unwrap_or(&[]));
                let out = self
                    .call(serve, &input, want + 1, stream.as_mut(), true, job)
                    .await?;
                g.calls += 1;
                if out.rows.offset > 1 {
                    return Err(fail(format!(
                        "serve returned {} empty leading hidden-state elements on a continuation; rows misaligned",
                        out.rows.offset
                    )));
                }
                let mut oids = out.output_ids;
                if oids.is_empty() {
                    return Err(fail("serve returned no tokens on a continuation"));
                }
                let overlap = oids.remove(0);
                if let Some(last) = g.output_ids.last_mut() {
                    if *last != overlap {
                        // Greedy near-tie flipped: the regenerated token is what every later
                        // row was conditioned on, and its row (the same context) is already
                        // kept, so take the new id.
                        tracing::warn!(
                            old = *last,
                            new = overlap,
                            "overlap token regenerated differently; keeping the new id"
                        );
                        *last = overlap;
                    }
                }
                // Row index where the new tokens begin: skip element 0's row unless it
                // was empty (offset 1).
                let start = 1 - out.rows.offset;
                g.push_rows(&out.rows, start, oids.len())?;
                produced = oids.len();
                g.output_ids.extend(oids);
                finish = out.finish;
            }
            if finish.kind != "length" || produced < want {
                break;
            }
        }
        Ok(g)
    }

    /// One `/generate` call with hidden states (§3.4), streamed or not; validates the rows.
    async fn call(
        self: &Arc<Self>,
        serve: &str,
        input_ids: &[u32],
        max_new: usize,
        stream: Option<&mut StreamSink<'_>>,
        skip_first: bool,
        job: &Arc<Job>,
    ) -> Result<CallOut, JobError> {
        let rid = format!("engy-{}", uuid::Uuid::new_v4().simple());
        let body = json!({
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new},
            "rid": rid,
            "return_hidden_states": true,
            "return_logprob": true,
            "stream": stream.is_some(),
        });
        job.add_rid(serve, &rid)?;
        let res = tokio::select! {
            r = self.http_call(serve, &body, stream, skip_first) => r,
            _ = job.cancelled() => Err(JobError::Cancelled),
        };
        job.remove_rid(&rid);
        if job.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        let reply = match res {
            Ok(r) => r,
            Err(e) => {
                // The serve may still be generating for nobody: stop it.
                self.abort_rids(vec![(serve.to_string(), rid.clone())]);
                return Err(e);
            }
        };
        self.validate(serve, input_ids.len(), reply)
    }

    async fn http_call(
        &self,
        serve: &str,
        body: &Value,
        stream: Option<&mut StreamSink<'_>>,
        skip_first: bool,
    ) -> Result<Reply, JobError> {
        let url = format!("{serve}/generate");
        let resp = self
            .gen_client
            .post(&url)
            .json(body)
            .send()
            .await
            .map_err(|e| {
                fail(format!(
                    "serve {serve} unreachable or failed: {}",
                    err_chain(&e)
                ))
            })?;
        let status = resp.status();
        if !status.is_success() {
            let mut text = String::new();
            let mut resp = resp;
            while let Ok(Some(c)) = resp.chunk().await {
                text.push_str(&String::from_utf8_lossy(&c));
                if text.len() > 600 {
                    break;
                }
            }
            let msg = scan_reply(text.as_bytes(), HiddenMode::Skip, false)
                .ok()
                .and_then(|r| r.error)
                .unwrap_or_else(|| text.chars().take(200).collect());
            return Err(fail(format!(
                "serve {serve} answered HTTP {}: {msg}",
                status.as_u16()
            )));
        }
        let cap = self.cfg.reply_cap;
        match stream {
            None => {
                if let Some(len) = resp.content_length() {
                    if len as usize > cap {
                        return Err(fail(format!("serve reply of {len} bytes exceeds the {cap}-byte cap (ENGY_MAX_RESPONSE_MB)")));
                    }
                }
                let mut buf: Vec<u8> = Vec::new();
                let mut resp = resp;
                loop {
                    match resp.chunk().await {
                        Ok(Some(c)) => {
                            if buf.len() + c.len() > cap {
                                return Err(fail(format!(
                                    "serve reply exceeds the {cap}-byte cap (ENGY_MAX_RESPONSE_MB)"
                                )));
                            }
                            buf.extend_from_slice(&c);
                        }
                        Ok(None) => break,
                        Err(e) => {
                            return Err(fail(format!(
                                "serve {serve} reply broke off: {}",
                                err_chain(&e)
                            )))
                        }
                    }
                }
                let reply = scan_big(&buf, HiddenMode::Always, false)
                    .map_err(|e| fail(format!("serve {serve}: {e}")))?;
                Ok(reply)
            }
            Some(sink) => read_sse(serve, resp, cap, sink, skip_first).await,
        }
    }

    /// Row alignment checks (issue item 4; sglang-native-api.md §2.6).
    fn validate(&self, serve: &str, n_input: usize, r: Reply) -> Result<CallOut, JobError> {
        if let Some(e) = r.error {
            return Err(fail(format!("serve {serve} error: {e}")));
        }
        let finish = r.finish.ok_or_else(|| {
            fail(format!(
                "serve {serve} reply has no finish_reason (stream cut short?)"
            ))
        })?;
        if finish.kind == "abort" {
            return Err(fail(format!(
                "serve {serve} aborted the generation: {}",
                finish.message.as_deref().unwrap_or("no message")
            )));
        }
        let rows = match r.rows {
            Some(rows) if rows.n_rows > 0 => rows,
            _ => {
                return Err(fail(format!(
                    "serve returned no hidden states: start sglang with --enable-return-hidden-states (and nothing on its PYTHONPATH trimming them); probe: {}",
                    probe(serve)
                )))
            }
        };
        if !r.has_logprobs || (r.output_token_ids.is_empty() && r.n_output_ids > 0) {
            return Err(fail(format!(
                "serve {serve} sent no output_token_logprobs (return_logprob ignored)"
            )));
        }
        if r.n_output_ids > 0 && r.n_output_ids != r.output_token_ids.len() {
            return Err(fail(format!(
                "serve {serve}: output_ids has {} tokens but output_token_logprobs {}",
                r.n_output_ids,
                r.output_token_ids.len()
            )));
        }
        if let Some((i, w)) = rows.ragged {
            return Err(fail(format!(
                "misaligned hidden states: row {i} has {w} values, the first row {}; no proof built. Probe: {}",
                rows.width,
                probe(serve)
            )));
        }
        if let Some(h) = self.cfg.hidden_size {
            if rows.width != h {
                return Err(fail(format!(
                    "hidden-state rows have {} values but config.json hidden_size is {h}: wrong checkpoint for this serve?",
                    rows.width
                )));
            }
        }
        if rows.late_blocks > 0 || rows.holes > 0 {
            return Err(fail(format!(
                "misaligned hidden states: {} re-prefill block(s) and {} empty element(s) inside the sequence (retraction or batch-offset bug); no proof built",
                rows.late_blocks, rows.holes
            )));
        }
        let computed = (n_input as u64).saturating_sub(r.cached_tokens) as usize;
        if rows.offset == 0 && rows.first_block_rows > computed {
            return Err(fail(format!(
                "misaligned hidden states: prefill block has {} rows but only {computed} prompt tokens were computed (foreign rows from sglang's batch-offset bug); no proof built",
                rows.first_block_rows
            )));
        }
        if rows.n_rows + rows.offset != r.output_token_ids.len() {
            return Err(fail(format!(
                "misaligned hidden states: {} rows (+{} empty) for {} output tokens; no proof built. Probe: {}",
                rows.n_rows,
                rows.offset,
                r.output_token_ids.len(),
                probe(serve)
            )));
        }
        Ok(CallOut {
            output_ids: r.output_token_ids,
            rows,
            finish,
            cached: r.cached_tokens,
        })
    }
}

/// Scan a possibly huge reply without stalling the async workers.
fn scan_big(buf: &[u8], mode: HiddenMode, text: bool) -> Result<Reply, crate::scan::ScanError> {
    if buf.len() > (1 << 20) {
        if let Ok(h) = tokio::runtime::Handle::try_current() {
            if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread {
                return tokio::task::block_in_place(|| scan_reply(buf, mode, text));
            }
        }
    }
    scan_reply(buf, mode, text)
}

fn err_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// How often a quiet stream lets the delta sink flush pending text.
const FLUSH_TICK: Duration = Duration::from_millis(25);

/// Read an SSE `/generate` stream (§2.7) line by line in linear time with a per-line cap;
/// send text deltas; return the final event (parsed with its hidden states).
async fn read_sse(
    serve: &str,
    mut resp: reqwest::Response,
    cap: usize,
    sink: &mut StreamSink<'_>,
    skip_first: bool,
) -> Result<Reply, JobError> {
    let mut buf: Vec<u8> = Vec::new();
    let mut scanned = 0usize;
    let mut last: Option<Reply> = None;
    let mut base: Option<usize> = if skip_first { None } else { Some(0) };
    let mut sent = 0usize;
    let mut done = false;
    while !done {
        // Wake at least every FLUSH_TICK so coalesced text is not held while the serve is
        // quiet (an empty delta lets the sink flush what is due). `chunk()` only polls the
        // body, so dropping it on the tick loses nothing.
        let chunk = match tokio::time::timeout(FLUSH_TICK, resp.chunk()).await {
            Err(_) => {
                (sink.emit)("");
                continue;
            }
            Ok(Ok(Some(c))) => c,
            Ok(Ok(None)) => break,
            Ok(Err(e)) => {
                return Err(fail(format!(
                    "serve {serve} stream broke off: {}",
                    err_chain(&e)
                )))
            }
        };
        buf.extend_from_slice(&chunk);
        let mut consumed = 0usize;
        loop {
            let Some(k) = buf
                .get(scanned..)
                .and_then(|rest| memchr::memchr(b'\n', rest))
            else {
                scanned = buf.len();
                break;
            };
            let nl = scanned + k;
            let line = buf.get(consumed..nl).unwrap_or(&[]);
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            scanned = nl + 1;
            consumed = nl + 1;
            let Some(data) = line.strip_prefix(b"data:") else {
                continue;
            };
            let data = data.strip_prefix(b" ").unwrap_or(data);
            if data == b"[DONE]" {
                done = true;
                break;
            }
            if data.is_empty() {
                continue;
            }
            let ev = scan_big(data, HiddenMode::IfFinished, true)
                .map_err(|e| fail(format!("serve {serve} stream: {e}")))?;
            if ev.error.is_some() {
                return Ok(ev);
            }
            if let Some(text) = ev.text.as_deref() {
                match base {
                    None => {
                        // Continuation: everything up to the regenerated overlap token was
                        // already delivered.
                        if ev.n_output_ids >= 1 {
                            base = Some(text.len());
                        }
                    }
                    Some(b) => {
                        if let Some(new) = text.get(b + sent..) {
                            if !new.is_empty() {
                                (sink.emit)(new);
                                sent = text.len() - b;
                            }
                        }
                    }
                }
            }
            if ev.finish.is_some() {
                last = Some(ev);
            }
        }
        if consumed > 0 {
            buf.drain(..consumed);
            scanned -= consumed;
        }
        if buf.len() > cap {
            return Err(fail(format!(
                "serve stream line exceeds the {cap}-byte cap (ENGY_MAX_RESPONSE_MB)"
            )));
        }
    }
    last.ok_or_else(|| fail(format!("serve {serve} stream ended before its final event")))
}

/// Rows and ids collected across calls.
#[derive(Default)]
struct Generated {
    output_ids: Vec<u32>,
    prompt_extra: Vec<u32>,
    bits: Vec<u16>,
    width: usize,
    cached: u64,
    calls: usize,
}

impl Generated {
    fn n_rows(&self) -> usize {
        self.bits.len().checked_div(self.width).unwrap_or(0)
    }

    /// Append rows `start .. start + n` of `rows`, checking the count and width.
    fn push_rows(&mut self, rows: &Rows, start: usize, n: usize) -> Result<(), JobError> {
        if rows.n_rows < start + n {
            return Err(fail(format!(
                "misaligned hidden states: {} rows for {n} new tokens (from row {start}); no proof built",
                rows.n_rows
            )));
        }
        if self.width == 0 {
            self.width = rows.width;
        } else if rows.width != self.width {
            return Err(fail(format!(
                "misaligned hidden states: rows of {} values after rows of {}; no proof built",
                rows.width, self.width
            )));
        }
        let w = rows.width;
        let slice = rows
            .bits
            .get(start * w..(start + n) * w)
            .ok_or_else(|| fail("misaligned hidden states: row buffer too short"))?;
        self.bits.extend_from_slice(slice);
        Ok(())
    }
}
