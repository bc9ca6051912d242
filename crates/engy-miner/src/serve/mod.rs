//! Serving one request on the sglang serves (docs/PROTOCOL.md §3), top to bottom in
//! [`Engine::process`]: prompt, serve choice ([`pool`]), chunked generation with the
//! one-token overlap ([`Engine::generate_chunked`]), each call ([`http`]), the proof
//! ([`crate::proof`]), the routing / indexer traces ([`trace`], asked of serves that
//! [`offers`] says have them), the commit pass of the activation cells ([`cells`], on
//! serves started with the engy_cells hooks), then `output` and `commitment`.
use std::sync::Arc;
use std::time::{Duration, Instant};

use engy_core::toploc::Params;
use engy_core::wire;
use serde_json::Value;

pub mod cells;
mod http;
pub mod offers;
pub mod pool;
pub mod trace;

pub use http::PROBE_TEXT;
use pool::Pool;

use crate::cell_store::CellStore;
use crate::chat::Prompter;
use crate::job::{fail, Job, JobError};
use crate::metrics::Metrics;
use crate::proof::ProofAcc;
use crate::scan::{Finish, Rows, TraceText};
use offers::OfferCache;
use trace::{Kind, TraceAcc, TraceShapes};

/// Largest reply to a commit pass (`max_new_tokens` 1, no hidden states: a few hundred
/// bytes from sglang) read before the pass counts as failed.
const COMMIT_REPLY_CAP: usize = 1 << 20;

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
    /// Cap on one reply (body or SSE line), bytes, before the traces' allowance.
    pub reply_cap: usize,
    /// The traces to collect (settings × config.json), docs/PROTOCOL.md §3.10.
    pub traces: TraceShapes,
}

/// The request path, shared by every leg.
pub struct Engine {
    cfg: EngineConfig,
    prompter: Arc<Prompter>,
    pool: Pool,
    metrics: Arc<Metrics>,
    gen_client: reqwest::Client,
    abort_client: reqwest::Client,
    /// What each serve offers (server info), for the traces.
    offers: OfferCache,
    /// `input_ids` of the curl probe in misalignment errors: [`PROBE_TEXT`] in the
    /// checkpoint's own tokenizer, so the operator can paste it against this serve.
    probe_ids: String,
    /// The cells' commit pass and retention store (`ENGY_CELLS=on`), else `None`.
    cells: Option<cells::CommitPass>,
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
    routed_experts: Option<TraceText>,
    indexer_topk: Option<TraceText>,
}

/// The trace fields one call asks for (§3.10).
#[derive(Debug, Clone, Copy, Default)]
struct Ask {
    /// `routed_experts_start_len` when routing is asked.
    routing_start: Option<u64>,
    /// `return_indexer_topk`.
    indexer: bool,
    /// Bytes the asked fields may add to the reply.
    extra_bytes: usize,
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
        metrics: Arc<Metrics>,
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
        // never starve them (docs/PROTOCOL.md §2 cancel).
        let abort_client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()?;
        let probe_ids = http::probe_ids(&prompter);
        Ok(Self {
            cfg,
            prompter,
            probe_ids,
            metrics,
            pool: Pool::new(serve_urls),
            gen_client,
            abort_client,
            offers: OfferCache::default(),
            cells: None,
        })
    }

    /// This engine with the cells' commit pass (`ENGY_CELLS=on`) or without (`None`).
    pub fn with_cells(mut self, cells: Option<cells::CommitPass>) -> Self {
        self.cells = cells;
        self
    }

    /// The retention store of committed cells, when cells are on (`open_cells` reads it).
    pub fn cell_store(&self) -> Option<&Arc<CellStore>> {
        self.cells.as_ref().map(cells::CommitPass::store)
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
                    Err(e) => {
                        tracing::warn!(%serve, %rid, error = %crate::error_chain(&e), "abort_request failed")
                    }
                }
            });
        }
    }

    /// Start-up: read every serve's server info and log which traces it offers (INFO) or
    /// why its commitments will lack one (WARN). Nothing is read when no trace is
    /// collected.
    pub async fn probe_offers(self: &Arc<Self>) {
        let want = (
            self.cfg.traces.routing.is_some(),
            self.cfg.traces.indexer.is_some(),
            self.cells.is_some(),
        );
        self.offers
            .probe_all(&self.abort_client, &self.pool.urls(), want)
            .await;
    }

    /// Serve one gateway request end to end; `stream` receives text deltas when the
    /// gateway asked for streaming. Returns `(commitment, output)`; the request's cells,
    /// when committed, are kept under `request_id` (the `response`'s).
    ///
    /// # Errors
    /// [`JobError::Cancelled`] when the job was cancelled, [`JobError::Failed`] otherwise.
    pub async fn process(
        self: &Arc<Self>,
        request: &Value,
        request_id: &Value,
        job: &Arc<Job>,
        mut stream: Option<StreamSink<'_>>,
    ) -> Result<(wire::Commitment, wire::Completion), JobError> {
        if job.is_cancelled() {
            return Err(JobError::Cancelled);
        }
        // Absent reads as `[]`, as production reads it (refused: docs/PROTOCOL.md §3.1).
        let messages = request
            .get("messages")
            .cloned()
            .unwrap_or_else(|| Value::Array(Vec::new()));
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
            .pool
            .pick()
            .ok_or_else(|| fail("no serve configured"))?;
        let serve = slot.url().to_string();
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
        let proofs = gen
            .proofs
            .finish_or_null()
            .map_err(|e| fail(format!("null proofs: {e}")))?;
        if let Some(e) = &proofs.unproven {
            tracing::warn!(
                rows = n_rows, width, error = %e,
                "TOPLOC proof cannot be built over these rows; answering with null proofs"
            );
        }
        self.metrics.proof_built_in(proofs.build_time);
        let proofs = proofs.proofs;
        let prompter = Arc::clone(&self.prompter);
        let ids_for_text = gen.output_ids.clone();
        let text = tokio::task::spawn_blocking(move || prompter.decode(&ids_for_text))
            .await
            .map_err(|e| fail(format!("detokenize task failed: {e}")))?;
        let text = text.map_err(|e| fail(e.to_string()))?;
        let mut prompt_full = prompt_ids;
        prompt_full.extend_from_slice(&gen.prompt_extra);
        let n_prompt = prompt_full.len() as u64;
        let n_tokens = n_rows as u64;
        // Positions with a forward pass: all but the last output token (§3.10).
        let positions = (n_prompt + n_tokens).saturating_sub(1);
        let routing = self.finish_trace(gen.routing, positions, &serve);
        let indexer_topk = self.finish_trace(gen.indexer, positions, &serve);
        let usage = wire::Usage {
            prompt_tokens: n_prompt,
            completion_tokens: n_tokens,
            total_tokens: n_prompt + n_tokens,
            prompt_tokens_details: (gen.cached > 0).then(|| wire::PromptTokensDetails {
                cached_tokens: gen.cached.min(n_prompt),
            }),
        };
        let output = wire::Completion::of_text(text, usage);
        let cells = self
            .commit_cells(request_id, &serve, &prompt_full, &gen.output_ids, job)
            .await;
        if job.is_cancelled() {
            return Err(JobError::Cancelled);
        }
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
            routing,
            indexer_topk,
            cells,
        };
        tracing::info!(
            serve = %serve, prompt_tokens = n_prompt, completion_tokens = n_rows,
            cached = gen.cached, calls = gen.calls, ms = started.elapsed().as_millis() as u64,
            "generated and proved"
        );
        Ok((commitment, output))
    }

    /// A request's trace of one kind, or `None` with the reason counted (and logged at
    /// WARN when the serve offered it: the request still succeeds, §3.10).
    fn finish_trace(
        &self,
        acc: Option<TraceAcc>,
        positions: u64,
        serve: &str,
    ) -> Option<engy_core::trace::Trace> {
        let acc = acc?;
        let kind = acc.kind();
        match acc.finish(positions) {
            Ok(t) => {
                self.metrics.trace(kind.label(), "attached");
                Some(t)
            }
            Err(d) => {
                self.metrics.trace(kind.label(), d.label());
                if d == trace::Dropped::NotOffered {
                    tracing::debug!(%serve, trace = kind.label(), "the serve does not offer this trace; the commitment goes out without it");
                } else {
                    tracing::warn!(%serve, trace = kind.label(), reason = d.label(), "no {} trace for this request: {d}; the commitment goes out without it", kind.field());
                }
                None
            }
        }
    }

    /// The request's `commitment.cells` (§10), or `None` with the reason counted (and logged
    /// at WARN when the serve has the hooks: the request still succeeds).
    async fn commit_cells(
        self: &Arc<Self>,
        request_id: &Value,
        serve: &str,
        prompt: &[u32],
        output: &[u32],
        job: &Arc<Job>,
    ) -> Option<wire::CellsCommitment> {
        let pass = self.cells.as_ref()?;
        let offered = self
            .offers
            .get(&self.abort_client, serve)
            .await
            .is_some_and(|o| o.cells);
        let mut ids = Vec::with_capacity(prompt.len() + output.len());
        ids.extend_from_slice(prompt);
        ids.extend_from_slice(output);
        let started = Instant::now();
        let r = if offered {
            pass.commit(request_id, &ids, |body| self.commit_call(serve, body, job))
                .await
        } else {
            Err(cells::Dropped::NotOffered)
        };
        match r {
            Ok(c) => {
                self.metrics.cells("attached");
                tracing::info!(%serve, %request_id, root = %c.root, cells = c.shape.n_cells(), ms = started.elapsed().as_millis() as u64, "cells committed and retained");
                Some(c)
            }
            Err(_) if job.is_cancelled() => None,
            Err(d) => {
                self.metrics.cells(d.label());
                if d == cells::Dropped::NotOffered {
                    tracing::debug!(%serve, "the serve has no engy_cells hooks; the commitment goes out without cells");
                } else {
                    if matches!(d, cells::Dropped::Pass(_)) {
                        self.offers.forget(serve);
                    }
                    tracing::warn!(%serve, %request_id, reason = d.label(), "no cells for this request: {d}; the commitment goes out without them");
                }
                None
            }
        }
    }

    /// One commit-pass `/generate` call (§10): abortable with the job, answered when the
    /// serve ran the prefill.
    async fn commit_call(
        self: &Arc<Self>,
        serve: &str,
        body: wire::GenerateRequest,
        job: &Arc<Job>,
    ) -> Result<(), String> {
        job.add_rid(serve, &body.rid)
            .map_err(|_| "the request was cancelled".to_string())?;
        let send = async {
            let resp = self
                .gen_client
                .post(format!("{serve}/generate"))
                .json(&body)
                .send()
                .await
                .map_err(|e| format!("serve {serve} unreachable: {}", crate::error_chain(&e)))?;
            let status = resp.status();
            let mut resp = resp;
            let mut raw = Vec::new();
            while let Some(c) = resp
                .chunk()
                .await
                .map_err(|e| format!("serve {serve} reply cut: {}", crate::error_chain(&e)))?
            {
                raw.extend_from_slice(&c);
                if raw.len() > COMMIT_REPLY_CAP {
                    return Err(format!(
                        "serve {serve} reply to the commit pass exceeds {COMMIT_REPLY_CAP} bytes"
                    ));
                }
            }
            let text = String::from_utf8_lossy(&raw);
            if !status.is_success() {
                let msg: String = text.chars().take(200).collect();
                return Err(format!(
                    "serve {serve} answered HTTP {}: {msg}",
                    status.as_u16()
                ));
            }
            let v: Value = serde_json::from_str(&text)
                .map_err(|e| format!("serve {serve} reply is not JSON: {e}"))?;
            let finish = v
                .pointer("/meta_info/finish_reason/type")
                .and_then(Value::as_str);
            if finish == Some("abort") || v.get("error").is_some() {
                return Err(format!(
                    "serve {serve} did not run the pass: {}",
                    text.chars().take(200).collect::<String>()
                ));
            }
            Ok(())
        };
        let r = tokio::select! {
            r = send => r,
            _ = job.cancelled() => Err("the request was cancelled".to_string()),
        };
        job.remove_rid(&body.rid);
        if r.is_err() {
            self.abort_rids(vec![(serve.to_string(), body.rid.clone())]);
        }
        r
    }

    /// The traces this request collects on `serve`: one accumulator per kind the settings
    /// and checkpoint ask for, marked not offered when the serve's server info lacks it.
    async fn trace_accs(&self, serve: &str) -> (Option<TraceAcc>, Option<TraceAcc>) {
        let shapes = self.cfg.traces;
        if shapes.routing.is_none() && shapes.indexer.is_none() {
            return (None, None);
        }
        let offers = self
            .offers
            .get(&self.abort_client, serve)
            .await
            .unwrap_or_default();
        (
            shapes
                .routing
                .map(|s| TraceAcc::new(Kind::Routing, s, offers.routing)),
            shapes
                .indexer
                .map(|s| TraceAcc::new(Kind::Indexer, s, offers.indexer)),
        )
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
        let (routing, indexer) = self.trace_accs(serve).await;
        let mut g = Generated {
            proofs: ProofAcc::new(params),
            routing,
            indexer,
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
                let ask = g.ask(prompt_ids.len(), want);
                let out = self
                    .call(
                        serve,
                        prompt_ids,
                        want,
                        stream.as_mut(),
                        false,
                        job,
                        &mut g.proofs,
                        ask,
                    )
                    .await?;
                g.calls += 1;
                self.take_traces(&mut g, &out, prompt_ids.len(), serve);
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
                let ask = g.ask(input.len(), want + 1);
                let out = self
                    .call(
                        serve,
                        &input,
                        want + 1,
                        stream.as_mut(),
                        true,
                        job,
                        &mut g.proofs,
                        ask,
                    )
                    .await?;
                g.calls += 1;
                self.take_traces(&mut g, &out, input.len(), serve);
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
}

impl Engine {
    /// Hand one call's trace fields to the accumulators that asked for them; a field
    /// missing where the serve said it offers it makes that serve's offers unknown again.
    fn take_traces(&self, g: &mut Generated, out: &CallOut, n_input: usize, serve: &str) {
        let n_out = out.output_ids.len() as u64;
        for (acc, field) in [
            (g.routing.as_mut(), &out.routed_experts),
            (g.indexer.as_mut(), &out.indexer_topk),
        ] {
            if let Some(acc) = acc.filter(|a| a.asking()) {
                if field.is_none() {
                    self.offers.forget(serve);
                }
                acc.add_call(field.clone(), n_input as u64, n_out);
            }
        }
    }
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
    routing: Option<TraceAcc>,
    indexer: Option<TraceAcc>,
}

impl Generated {
    /// The trace fields the next call over `n_input` tokens (up to `max_new` more) asks for.
    fn ask(&self, n_input: usize, max_new: usize) -> Ask {
        let (n, m) = (n_input as u64, max_new as u64);
        let mut ask = Ask::default();
        let mut extra = 0u64;
        if let Some(acc) = self.routing.as_ref().filter(|a| a.asking()) {
            ask.routing_start = Some(acc.covered());
            extra = extra.saturating_add(acc.reply_bytes(n, m));
        }
        if let Some(acc) = self.indexer.as_ref().filter(|a| a.asking()) {
            ask.indexer = true;
            extra = extra.saturating_add(acc.reply_bytes(n, m));
        }
        ask.extra_bytes = usize::try_from(extra).unwrap_or(usize::MAX);
        ask
    }

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
