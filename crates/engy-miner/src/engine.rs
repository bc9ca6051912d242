//! Serving one request on the sglang serves (PROTOCOL.md §3): prompt, serve choice,
//! chunked generation with the one-token overlap, row collection and alignment checks,
//! streaming deltas, the TOPLOC proof, `output` and `commitment`.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engy_core::toploc::{
    build_proofs_base64, null_proofs_like_reference, Dtype, Params, ProofPoly, ToplocError,
};
use engy_core::wire;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::chat::Prompter;
use crate::scan::{
    scan_reply, scan_reply_from, Finish, HiddenMode, Reply, ReplySource, RowSink, Rows, ScanError,
    SseReader,
};

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

/// Stop state of one gateway request (corr_id), shared by the leg that received it and the
/// task serving it. Registered before the task starts, so a `cancel` that arrives first is
/// honoured.
///
/// A job stops in one of two ways: the gateway's `cancel` ([`Job::cancel`]: nothing more
/// goes on the wire for it) or the miner's own abort ([`Job::abort`], e.g. a SIGTERM drain
/// that timed out: the request still gets its terminal `response`, with the reason as
/// `error`).
#[derive(Debug, Default)]
pub struct Job {
    token: CancellationToken,
    state: Mutex<JobState>,
}

#[derive(Debug, Default)]
struct JobState {
    cancelled: bool,
    aborted: Option<String>,
    /// (serve URL, rid) of every live serve call.
    rids: Vec<(String, String)>,
}

impl Job {
    /// A fresh, live job.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True once cancelled or aborted: the request path stops at its next check.
    pub fn is_cancelled(&self) -> bool {
        let st = self.state();
        st.cancelled || st.aborted.is_some()
    }

    /// The gateway cancelled it: mark it and return the live serve calls to abort.
    /// Idempotent (a second call returns nothing).
    pub fn cancel(&self) -> Vec<(String, String)> {
        let mut st = self.state();
        if st.cancelled {
            return Vec::new();
        }
        st.cancelled = true;
        self.token.cancel();
        std::mem::take(&mut st.rids)
    }

    /// The miner stops it for `why` (it still answers with an error `response`); returns
    /// the live serve calls to abort. Nothing happens to a job already cancelled or
    /// aborted.
    pub fn abort(&self, why: &str) -> Vec<(String, String)> {
        let mut st = self.state();
        if st.cancelled || st.aborted.is_some() {
            return Vec::new();
        }
        st.aborted = Some(why.to_string());
        self.token.cancel();
        std::mem::take(&mut st.rids)
    }

    /// Why the miner aborted it, if it did.
    pub fn abort_reason(&self) -> Option<String> {
        self.state().aborted.clone()
    }

    /// Run `f` unless the gateway cancelled the job, atomically with respect to
    /// [`Job::cancel`]: used to put a frame on the wire only while the gateway still
    /// waits for it.
    pub fn if_live<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let st = self.state();
        if st.cancelled {
            None
        } else {
            Some(f())
        }
    }

    /// Resolves when cancelled or aborted.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    fn add_rid(&self, serve: &str, rid: &str) -> Result<(), JobError> {
        let mut st = self.state();
        if st.cancelled || st.aborted.is_some() {
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
    /// `input_ids` of the curl probe in misalignment errors: [`PROBE_TEXT`] in the
    /// checkpoint's own tokenizer, so the operator can paste it against this serve.
    probe_ids: String,
}

/// What the request path tells the streaming sink (docs/PROTOCOL.md §3.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEvent<'a> {
    /// A `/generate` call is about to start: its coalescing window starts now.
    CallStart,
    /// New text (never empty, never ending in a held-back U+FFFD).
    Delta(&'a str),
    /// Time passed with nothing new: flush what is due.
    Tick,
    /// A `/generate` call ended: flush everything pending.
    CallEnd,
}

/// Streaming state: events of the cumulative text go to `emit`.
pub struct StreamSink<'a> {
    emit: &'a mut (dyn FnMut(StreamEvent<'_>) + Send),
    /// Trailing U+FFFD of a call that ended at its token budget: not sent, because the
    /// next call may complete the character (§3.6).
    held: String,
    /// Bytes of a continuation's text that were already delivered: the overlap token's own
    /// text, or 0 when the previous call held its tail back (then the overlap token's text
    /// is sent with the character it completes).
    skip: usize,
}

impl<'a> StreamSink<'a> {
    /// Wrap an event callback.
    pub fn new(emit: &'a mut (dyn FnMut(StreamEvent<'_>) + Send)) -> Self {
        Self {
            emit,
            held: String::new(),
            skip: 0,
        }
    }

    /// Send what was held back at the end of the last call (the request is complete).
    fn release_held(&mut self) {
        if !self.held.is_empty() {
            let held = std::mem::take(&mut self.held);
            (self.emit)(StreamEvent::Delta(&held));
            (self.emit)(StreamEvent::CallEnd);
        }
    }
}

/// What one serve call returned, validated.
struct CallOut {
    output_ids: Vec<u32>,
    rows: Rows,
    finish: Finish,
    cached: u64,
}

/// The text of the curl probe that row-alignment errors print.
pub const PROBE_TEXT: &str = "Hello, world";

/// `[id,id,…]` of [`PROBE_TEXT`] in `prompter`'s tokenizer. Falls back to the start-up probe
/// conversation (which renders, [`Prompter::probe`]) if the text encodes to nothing.
fn probe_ids(prompter: &Prompter) -> String {
    let ids = prompter
        .encode(PROBE_TEXT)
        .ok()
        .filter(|ids| !ids.is_empty())
        .or_else(|| {
            let msgs = serde_json::json!([{"role": "user", "content": PROBE_TEXT}]);
            prompter.prompt_ids(&msgs).ok()
        })
        .unwrap_or_default();
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!("[{}]", list.join(","))
}

/// A curl command that shows what `serve` returns for a 4-token greedy generation with
/// hidden states.
fn probe(serve: &str, input_ids: &str) -> String {
    format!(
        "curl -s {serve}/generate -H 'Content-Type: application/json' -d '{{\"input_ids\":{input_ids},\"sampling_params\":{{\"max_new_tokens\":4,\"temperature\":0}},\"return_hidden_states\":true,\"return_logprob\":true}}' | head -c 600"
    )
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
        let probe_ids = probe_ids(&prompter);
        Ok(Self {
            cfg,
            prompter,
            probe_ids,
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
                    .json(&wire::AbortRequest { rid: rid.clone() })
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
    ) -> Result<(wire::Commitment, wire::Completion), JobError> {
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
        let requested = wire::max_tokens(request)
            .map_err(|e| fail(e.to_string()))?
            .unwrap_or(self.cfg.max_tokens);
        let max_new = requested.min(self.cfg.max_output_tokens) as usize;
        let slot = self
            .pick_serve()
            .ok_or_else(|| fail("no serve configured"))?;
        let serve = slot.slot.url.clone();
        let started = Instant::now();
        let params = Params {
            topk: self.cfg.topk,
            decode_batching_size: self.cfg.dbs,
            skip_prefill: true,
        };
        let gen = self
            .generate_chunked(&serve, &prompt_ids, max_new, &mut stream, job, params)
            .await;
        drop(slot);
        let gen = gen?;
        if job.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        let n_rows = gen.proofs.rows();
        let width = gen.width;
        if n_rows != gen.output_ids.len() {
            return Err(fail(format!(
                "misaligned hidden states: {n_rows} rows kept for {} output tokens; no proof built",
                gen.output_ids.len()
            )));
        }
        // Every full batch was proven as its rows arrived; only the last one is left.
        let proofs = gen.proofs.finish();
        let prompter = Arc::clone(&self.prompter);
        let ids_for_text = gen.output_ids.clone();
        let text = tokio::task::spawn_blocking(move || prompter.decode(&ids_for_text))
            .await
            .map_err(|e| fail(format!("detokenize task failed: {e}")))?;
        let proofs = match proofs {
            Ok(p) => p,
            Err(e) => {
                // As the reference does (docs/PROTOCOL.md §5): the completion goes out with
                // null proofs, which every verifier calls unproven.
                tracing::warn!(
                    rows = n_rows, width, error = %e,
                    "TOPLOC proof cannot be built over these rows; answering with null proofs"
                );
                null_proofs_like_reference(n_rows, &params)
                    .map_err(|e| fail(format!("null proofs: {e}")))?
                    .iter()
                    .map(ProofPoly::to_base64)
                    .collect()
            }
        };
        let text = text.map_err(|e| fail(e.to_string()))?;
        let mut prompt_full = prompt_ids;
        prompt_full.extend_from_slice(&gen.prompt_extra);
        let n_prompt = prompt_full.len() as u64;
        let n_tokens = n_rows as u64;
        let usage = wire::Usage {
            prompt_tokens: n_prompt,
            completion_tokens: n_tokens,
            total_tokens: n_prompt + n_tokens,
            prompt_tokens_details: (gen.cached > 0).then(|| wire::PromptTokensDetails {
                cached_tokens: gen.cached.min(n_prompt),
            }),
        };
        let output = wire::Completion::of_text(text, usage);
        let commitment = wire::Commitment {
            model_root: self.cfg.model_root.clone(),
            output_token_ids: gen.output_ids,
            toploc: wire::ToplocCommitment {
                proofs,
                topk: self.cfg.topk as u64,
                decode_batching_size: self.cfg.dbs as u64,
                skip_prefill: true,
                n_tokens,
                prompt_ids: prompt_full,
            },
        };
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
        params: Params,
    ) -> Result<Generated, JobError> {
        let mut g = Generated {
            proofs: ProofAcc::new(params),
            ..Generated::default()
        };
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
                    .call(
                        serve,
                        prompt_ids,
                        want,
                        stream.as_mut(),
                        false,
                        job,
                        &mut g.proofs,
                    )
                    .await?;
                g.calls += 1;
                g.cached = out.cached;
                let offset = out.rows.offset;
                let mut oids = out.output_ids;
                if offset > 0 {
                    // Prompt already cached → those tokens have no row: fold them in.
                    g.prompt_extra = oids.drain(..offset.min(oids.len())).collect();
                }
                g.check_rows(&out.rows, 0, oids.len())?;
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
                if let Some(sink) = stream.as_mut() {
                    // The continuation's text starts with the overlap token's own text: skip
                    // what of it was delivered (all of it, unless its tail was held back).
                    let overlap = g.output_ids.last().copied().unwrap_or_default();
                    let own = self.prompter.decode(&[overlap]).unwrap_or_default();
                    sink.skip = if std::mem::take(&mut sink.held).is_empty() {
                        own.len()
                    } else {
                        own.trim_end_matches('\u{fffd}').len()
                    };
                }
                let out = self
                    .call(
                        serve,
                        &input,
                        want + 1,
                        stream.as_mut(),
                        true,
                        job,
                        &mut g.proofs,
                    )
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
                g.check_rows(&out.rows, start, oids.len())?;
                produced = oids.len();
                g.output_ids.extend(oids);
                finish = out.finish;
            }
            if finish.kind != "length" || produced < want {
                break;
            }
        }
        if let Some(sink) = stream.as_mut() {
            sink.release_held();
        }
        Ok(g)
    }

    /// One `/generate` call with hidden states (§3.4), streamed or not; validates the rows.
    /// The kept rows go to `proofs` as they are parsed (element 0's row is the overlap
    /// token's, already kept, when `skip_first`).
    #[allow(clippy::too_many_arguments)]
    async fn call(
        self: &Arc<Self>,
        serve: &str,
        input_ids: &[u32],
        max_new: usize,
        stream: Option<&mut StreamSink<'_>>,
        skip_first: bool,
        job: &Arc<Job>,
        proofs: &mut ProofAcc,
    ) -> Result<CallOut, JobError> {
        let rid = format!("engy-{}", uuid::Uuid::new_v4().simple());
        let body = wire::GenerateRequest {
            input_ids: input_ids.to_vec(),
            sampling_params: wire::SamplingParams {
                temperature: 0.0,
                max_new_tokens: max_new as u64,
            },
            rid: rid.clone(),
            return_hidden_states: true,
            return_logprob: true,
            stream: stream.is_some(),
        };
        job.add_rid(serve, &rid)?;
        let mut stream = stream;
        if let Some(s) = stream.as_deref_mut() {
            (s.emit)(StreamEvent::CallStart);
        }
        let mut rows = CallRows { proofs, skip_first };
        let res = tokio::select! {
            r = self.http_call(serve, &body, stream, skip_first, &mut rows) => r,
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
        body: &wire::GenerateRequest,
        stream: Option<&mut StreamSink<'_>>,
        skip_first: bool,
        rows: &mut dyn RowSink,
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
                    crate::error_chain(&e)
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
                // Parsed as it arrives: the body is never held whole (issue 7).
                scan_reply_from(
                    BodySource {
                        resp,
                        pacer: Pacer::default(),
                    },
                    HiddenMode::Always,
                    false,
                    cap,
                    rows,
                )
                .await
                .map_err(|e| scan_fail(serve, e, false, cap))
            }
            Some(sink) => read_sse(serve, resp, cap, sink, skip_first, rows).await,
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
                    probe(serve, &self.probe_ids)
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
                probe(serve, &self.probe_ids)
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
                probe(serve, &self.probe_ids)
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

/// The engine's error for a reply that could not be scanned.
fn scan_fail(serve: &str, e: ScanError, stream: bool, cap: usize) -> JobError {
    let what = if stream { "stream" } else { "reply" };
    match e {
        ScanError::TooLarge { .. } if stream => fail(format!(
            "serve stream line exceeds the {cap}-byte cap (ENGY_MAX_RESPONSE_MB)"
        )),
        ScanError::TooLarge { .. } => fail(format!(
            "serve reply exceeds the {cap}-byte cap (ENGY_MAX_RESPONSE_MB)"
        )),
        ScanError::Source(s) => fail(format!("serve {serve} {what} broke off: {s}")),
        e if stream => fail(format!("serve {serve} stream: {e}")),
        e => fail(format!("serve {serve}: {e}")),
    }
}

/// A non-stream `/generate` body as it arrives.
struct BodySource {
    resp: reqwest::Response,
    pacer: Pacer,
}

/// Bytes of a reply scanned between two yields to the runtime: about a millisecond of
/// scanning, so a final reply of megabytes (hidden states) never holds a worker thread
/// while other streams' events wait for their `chunk` frames (issue 7, latency).
const YIELD_EVERY: usize = 1 << 20;

/// Yields to the runtime after every [`YIELD_EVERY`] bytes handed to the scanner.
#[derive(Default)]
struct Pacer {
    since_yield: usize,
}

impl Pacer {
    async fn handed(&mut self, n: usize) {
        self.since_yield += n;
        if self.since_yield >= YIELD_EVERY {
            self.since_yield = 0;
            tokio::task::yield_now().await;
        }
    }
}

impl ReplySource for BodySource {
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
        match self.resp.chunk().await {
            Ok(Some(c)) => {
                self.pacer.handed(c.len()).await;
                buf.extend_from_slice(&c);
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(ScanError::Source(crate::error_chain(&e))),
        }
    }
}

/// An SSE `/generate` stream as it arrives; while the serve is quiet it wakes every
/// [`FLUSH_TICK`] so the delta sink can flush coalesced text.
struct SseSource<'a, 'b> {
    resp: reqwest::Response,
    sink: &'a mut StreamSink<'b>,
    pacer: Pacer,
}

impl ReplySource for SseSource<'_, '_> {
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
        loop {
            // `chunk()` only polls the body, so dropping it on the tick loses nothing; an
            // empty delta lets the sink flush what is due.
            match tokio::time::timeout(FLUSH_TICK, self.resp.chunk()).await {
                Err(_) => (self.sink.emit)(StreamEvent::Tick),
                Ok(Ok(Some(c))) => {
                    self.pacer.handed(c.len()).await;
                    buf.extend_from_slice(&c);
                    return Ok(true);
                }
                Ok(Ok(None)) => return Ok(false),
                Ok(Err(e)) => return Err(ScanError::Source(crate::error_chain(&e))),
            }
        }
    }
}

impl RowSink for ProofAcc {
    fn row(&mut self, _element: usize, bits: &[u16]) {
        self.push(bits);
    }
}

/// The rows of one serve call, on their way to the proof accumulator.
struct CallRows<'a> {
    proofs: &'a mut ProofAcc,
    /// Continuation: element 0 is the overlap token's row, already kept (§3.5).
    skip_first: bool,
}

impl RowSink for CallRows<'_> {
    fn row(&mut self, element: usize, bits: &[u16]) {
        if !(self.skip_first && element == 0) {
            self.proofs.push(bits);
        }
    }
}

/// Builds the TOPLOC proofs of a request batch by batch as its rows arrive (PROTOCOL.md
/// §3.8, skip_prefill: batches are groups of `decode_batching_size` rows from row 0), so a
/// request holds at most one batch of rows (32 × hidden × 2 bytes), never all of them. Each
/// batch's proof depends only on that batch's rows, so the proofs equal
/// `engy_core::toploc::build_proofs_base64` over every row at once (bf16 rows).
#[derive(Debug, Default)]
pub struct ProofAcc {
    params: Option<Params>,
    /// Rows of the batch being filled, concatenated.
    pending: Vec<u16>,
    /// End offset of each pending row in `pending`.
    ends: Vec<usize>,
    proofs: Vec<String>,
    /// Rows received in total.
    rows: usize,
    err: Option<ToplocError>,
}

impl ProofAcc {
    /// An empty accumulator for `params` (`skip_prefill` must be true, as engy uses).
    pub fn new(params: Params) -> Self {
        Self {
            params: Some(params),
            ..Self::default()
        }
    }

    /// Rows received so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Add the next row (bf16 bit patterns); proves the batch once it is full.
    pub fn push(&mut self, bits: &[u16]) {
        self.rows += 1;
        if self.err.is_some() {
            return;
        }
        self.pending.extend_from_slice(bits);
        self.ends.push(self.pending.len());
        let dbs = self.params.map_or(0, |p| p.decode_batching_size);
        if self.ends.len() >= dbs {
            self.prove_pending();
        }
    }

    fn prove_pending(&mut self) {
        if self.ends.is_empty() || self.err.is_some() {
            return;
        }
        let Some(params) = self.params else {
            self.err = Some(ToplocError::ZeroDecodeBatchingSize);
            return;
        };
        let mut start = 0;
        let elements: Vec<&[u16]> = self
            .ends
            .iter()
            .map(|&end| {
                let row = self.pending.get(start..end).unwrap_or(&[]);
                start = end;
                row
            })
            .collect();
        let batch = self.proofs.len();
        match build_proofs_base64(&elements, Dtype::Bf16, &params) {
            Ok(p) => self.proofs.extend(p),
            Err(mut e) => {
                // Report the batch's index in the whole request, as one build would.
                if let ToplocError::TopkExceedsBatch { batch: b, .. }
                | ToplocError::BatchTooLarge { batch: b, .. } = &mut e
                {
                    *b = batch;
                }
                self.err = Some(e);
            }
        }
        self.pending.clear();
        self.ends.clear();
    }

    /// Prove the last (short) batch and return every proof, as base64 wire strings.
    ///
    /// # Errors
    /// The first [`ToplocError`] of any batch (then no proof is returned, as the
    /// reference nulls every proof when one batch fails).
    pub fn finish(mut self) -> Result<Vec<String>, ToplocError> {
        self.prove_pending();
        match self.err {
            Some(e) => Err(e),
            None => Ok(self.proofs),
        }
    }
}

/// How often a quiet stream lets the delta sink flush pending text.
const FLUSH_TICK: Duration = Duration::from_millis(25);

/// Read an SSE `/generate` stream (§2.7) as it arrives, one event at a time with a
/// per-event cap; send text deltas; return the final event (its hidden-state rows went to
/// `rows` while it was parsed).
async fn read_sse(
    serve: &str,
    resp: reqwest::Response,
    cap: usize,
    sink: &mut StreamSink<'_>,
    skip_first: bool,
    rows: &mut dyn RowSink,
) -> Result<Reply, JobError> {
    let base = if skip_first { sink.skip } else { 0 };
    let mut rd = SseReader::new(
        SseSource {
            resp,
            sink,
            pacer: Pacer::default(),
        },
        cap,
    );
    let mut last: Option<Reply> = None;
    let mut sent = 0usize;
    while let Some(ev) = rd
        .next_event(HiddenMode::IfFinished, true, rows)
        .await
        .map_err(|e| scan_fail(serve, e, true, cap))?
    {
        if ev.error.is_some() {
            return Ok(ev);
        }
        if let Some(full) = ev.text.as_deref() {
            // A serve that streams an incomplete UTF-8 sequence shows it as U+FFFD, which
            // a later event replaces by the real character: trailing U+FFFD is held back
            // (sglang itself holds such bytes back), on the final event too when the call
            // ended at its budget and a continuation may complete the character.
            let at_budget = ev.finish.as_ref().is_some_and(|f| f.kind == "length");
            let text = if ev.finish.is_some() && !at_budget {
                full
            } else {
                full.trim_end_matches('\u{fffd}')
            };
            // `get` is None off a character boundary or before the continuation's
            // overlap text is complete: nothing is sent until the text lines up.
            if let Some(new) = text.get(base + sent..) {
                if !new.is_empty() {
                    (rd.source_mut().sink.emit)(StreamEvent::Delta(new));
                    sent = text.len() - base;
                }
            }
            if at_budget {
                let held = full.get(text.len()..).unwrap_or_default().to_string();
                rd.source_mut().sink.held = held;
            }
        }
        if ev.finish.is_some() {
            if last.is_some() {
                // Its rows were already taken once: a second final event would double them.
                return Err(fail(format!(
                    "serve {serve} stream sent a second final event"
                )));
            }
            last = Some(ev);
        }
    }
    let last =
        last.ok_or_else(|| fail(format!("serve {serve} stream ended before its final event")))?;
    (rd.source_mut().sink.emit)(StreamEvent::CallEnd);
    Ok(last)
}

/// Ids collected across calls; the rows went to the proof accumulator.
#[derive(Default)]
struct Generated {
    output_ids: Vec<u32>,
    prompt_extra: Vec<u32>,
    proofs: ProofAcc,
    width: usize,
    cached: u64,
    calls: usize,
}

impl Generated {
    /// Check that a call's rows `start .. start + n` are the rows its sink kept (count and
    /// width).
    fn check_rows(&mut self, rows: &Rows, start: usize, n: usize) -> Result<(), JobError> {
        if rows.n_rows != start + n {
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
        Ok(())
    }
}
