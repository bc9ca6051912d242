//! One `/generate` call on a serve (sglang-native-api.md §2): the request body, the reply
//! read as it arrives (non-stream body or SSE events), text deltas, rows to the proof, and
//! the row-alignment checks with their operator messages.
use std::sync::Arc;
use std::time::Duration;

use engy_core::wire;

use super::{Ask, CallOut, Engine, StreamEvent, StreamSink};
use crate::chat::Prompter;
use crate::job::{fail, Job, JobError};
use crate::proof::ProofAcc;
use crate::scan::{
    scan_reply, scan_reply_from, HiddenMode, Reply, ReplySource, RowSink, ScanError, SseReader,
};

/// The text of the curl probe that row-alignment errors print.
pub const PROBE_TEXT: &str = "Hello, world";

/// `[id,id,…]` of [`PROBE_TEXT`] in `prompter`'s tokenizer. Falls back to the start-up probe
/// conversation (which renders, [`Prompter::probe`]) if the text encodes to nothing.
pub(super) fn probe_ids(prompter: &Prompter) -> String {
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
    /// One `/generate` call with hidden states (§3.4), streamed or not; validates the rows.
    /// The kept rows go to `proofs` as they are parsed (element 0's row is the overlap
    /// token's, already kept, when `skip_first`). `ask` adds the trace fields (§3.10).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn call(
        self: &Arc<Self>,
        serve: &str,
        input_ids: &[u32],
        max_new: usize,
        stream: Option<&mut StreamSink<'_>>,
        skip_first: bool,
        job: &Arc<Job>,
        proofs: &mut ProofAcc,
        ask: Ask,
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
            return_routed_experts: ask.routing_start.is_some(),
            routed_experts_start_len: ask.routing_start,
            return_indexer_topk: ask.indexer,
        };
        // The hidden-state cap, plus what the asked traces may take (never a failure of
        // their own making, §3.10).
        let cap = self.cfg.reply_cap.saturating_add(ask.extra_bytes);
        job.add_rid(serve, &rid)?;
        let mut stream = stream;
        if let Some(s) = stream.as_deref_mut() {
            (s.emit)(StreamEvent::CallStart);
        }
        let mut rows = CallRows { proofs, skip_first };
        let res = tokio::select! {
            r = self.http_call(serve, &body, stream, skip_first, &mut rows, cap) => r,
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

    pub(super) async fn http_call(
        &self,
        serve: &str,
        body: &wire::GenerateRequest,
        stream: Option<&mut StreamSink<'_>>,
        skip_first: bool,
        rows: &mut dyn RowSink,
        cap: usize,
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
    pub(super) fn validate(
        &self,
        serve: &str,
        n_input: usize,
        r: Reply,
    ) -> Result<CallOut, JobError> {
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
            routed_experts: r.routed_experts,
            indexer_topk: r.indexer_topk,
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
