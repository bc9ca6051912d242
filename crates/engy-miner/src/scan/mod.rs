//! Single-pass scanner for sglang `/generate` replies (a non-stream body or one SSE event
//! payload), sglang-native-api.md §2.2–§2.7.
//!
//! The reply can be hundreds of MB, almost all of it `meta_info.hidden_states`. The scanner
//! walks the bytes once, as they arrive ([`ReplySource`]: it holds only a small window of
//! the body, never the whole reply), never builds a generic JSON value, and converts each
//! hidden float straight to a bfloat16 bit pattern (float32 first, then
//! round-to-nearest-even, as numpy float32 → `torch.bfloat16` does; docs/PROTOCOL.md §3.8),
//! handing each kept row to a [`RowSink`] (the miner proves batches of rows as they
//! complete). Of each 2-D element (a prefill or re-prefill block) only the LAST row is
//! kept: it is the hidden state that sampled that element's token (§2.6.1).
//!
//! [`scan_reply`] reads bytes already in memory; [`scan_reply_from`] and [`SseReader`] read
//! them from a [`ReplySource`] as they arrive.
//!
//! Everything else the miner needs is picked out on the way: `text`, the output ids
//! (`output_token_logprobs[*][1]`, §2.5), `output_ids` length, `finish_reason`,
//! `prompt_tokens`, `cached_tokens`, and sglang's error envelopes.
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

mod cursor;
pub mod decimal;
mod sse;

use cursor::Cur;
pub use sse::SseReader;

/// Why a reply could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    /// Not valid JSON at byte `at`.
    #[error("malformed JSON from the serve at byte {at}: {what}")]
    Malformed {
        /// Byte offset.
        at: usize,
        /// What was expected.
        what: &'static str,
    },
    /// A hidden value that is not a finite number (orjson writes NaN/Inf as `null`).
    #[error("hidden_states holds a non-finite or non-numeric value at byte {at}")]
    BadHidden {
        /// Byte offset.
        at: usize,
    },
    /// The reply (a body, or one SSE event) is longer than the cap.
    #[error("reply exceeds the {cap}-byte cap")]
    TooLarge {
        /// The cap, bytes.
        cap: usize,
    },
    /// The byte source failed (the body broke off); the text is its error chain.
    #[error("reply broke off: {0}")]
    Source(String),
}

/// Where the bytes of a reply come from, in order: an HTTP body, an SSE stream, a slice.
pub trait ReplySource: Send {
    /// Append the next bytes of the reply to `buf` (any amount, possibly none);
    /// `Ok(false)` once the reply has ended (nothing was appended).
    ///
    /// # Errors
    /// [`ScanError::Source`] when the body broke off.
    fn read_into(
        &mut self,
        buf: &mut Vec<u8>,
    ) -> impl Future<Output = Result<bool, ScanError>> + Send;
}

/// Receives the kept hidden-state rows as they are parsed, in element order.
pub trait RowSink: Send {
    /// One kept row: a 1-D element, or the last row of a 2-D element. `element` is its
    /// index in `hidden_states`; `bits` are bf16 bit patterns.
    fn row(&mut self, element: usize, bits: &[u16]);
}

/// A [`RowSink`] that drops every row (only the row counts in [`Rows`] are wanted).
#[derive(Debug, Default, Clone, Copy)]
pub struct DropRows;

impl RowSink for DropRows {
    fn row(&mut self, _element: usize, _bits: &[u16]) {}
}

/// A [`RowSink`] that appends every row to one flat buffer.
#[derive(Debug, Default)]
struct KeepRows(Vec<u16>);

impl RowSink for KeepRows {
    fn row(&mut self, _element: usize, bits: &[u16]) {
        self.0.extend_from_slice(bits);
    }
}

/// A [`ReplySource`] over bytes already in memory, read in 64 KiB pieces.
#[derive(Debug, Clone)]
pub struct SliceSource<'a> {
    rest: &'a [u8],
}

impl<'a> SliceSource<'a> {
    /// Read `bytes` from the start.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { rest: bytes }
    }
}

impl ReplySource for SliceSource<'_> {
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
        if self.rest.is_empty() {
            return Ok(false);
        }
        let (a, b) = self.rest.split_at(self.rest.len().min(1 << 16));
        buf.extend_from_slice(a);
        self.rest = b;
        Ok(true)
    }
}

/// Run a future that never waits (its source is always ready) to completion.
fn run_ready<T>(f: impl Future<Output = Result<T, ScanError>>) -> Result<T, ScanError> {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => Err(ScanError::Source("in-memory source was not ready".into())),
    }
}

/// `finish_reason` of a reply (§2.4).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Finish {
    /// `"length"`, `"stop"` or `"abort"`.
    pub kind: String,
    /// `message` of an abort, if any.
    pub message: Option<String>,
    /// `status_code` of a scheduler-side abort, if any.
    pub status_code: Option<u64>,
}

/// The hidden-state rows of a reply, reduced to one row per element (§2.6.4).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rows {
    /// bf16 bit patterns, row-major, `n_rows × width` ([`scan_reply`] only; empty when the
    /// rows went to a [`RowSink`]).
    pub bits: Vec<u16>,
    /// Width of the first row seen (0 when there is none).
    pub width: usize,
    /// Number of rows kept.
    pub n_rows: usize,
    /// Number of leading empty elements (radix-cache / batch-offset empty prefill block:
    /// those output tokens have no row).
    pub offset: usize,
    /// Number of elements (one per output token on a healthy serve).
    pub n_elements: usize,
    /// Rows in element 0 when it is a 2-D block (0 if it is empty or 1-D).
    pub first_block_rows: usize,
    /// 2-D elements at index ≥ 1 (re-prefill after a retraction, §2.6.5).
    pub late_blocks: usize,
    /// Empty elements after the first row (a hole in the sequence).
    pub holes: usize,
    /// First row whose width differs from `width`: (row index, its width).
    pub ragged: Option<(usize, usize)>,
}

/// What the miner reads from one reply.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    /// Cumulative `text` (only when asked for).
    pub text: Option<String>,
    /// Length of `output_ids`.
    pub n_output_ids: usize,
    /// Token ids from `output_token_logprobs` (element `[1]`).
    pub output_token_ids: Vec<u32>,
    /// Whether `output_token_logprobs` was present.
    pub has_logprobs: bool,
    /// `meta_info.id`.
    pub rid: Option<String>,
    /// `meta_info.finish_reason` (None while `null`).
    pub finish: Option<Finish>,
    /// `meta_info.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `meta_info.cached_tokens`.
    pub cached_tokens: u64,
    /// `meta_info.hidden_states`, when present and parsed.
    pub rows: Option<Rows>,
    /// sglang error envelope message (`{"error":{"message"}}`, `{"error":"…"}`, or
    /// `{"object":"error","message"}`).
    pub error: Option<String>,
    /// `meta_info.routed_experts` (read where `hidden_states` would be: a non-stream
    /// body, or the final SSE event), as sent.
    pub routed_experts: Option<TraceText>,
    /// `meta_info.indexer_topk`, likewise.
    pub indexer_topk: Option<TraceText>,
}

/// A trace field of `meta_info` as sent (docs/PROTOCOL.md §3.10): its string (base64,
/// decoded later), or a value that is no string (a malformed field, never a failed reply).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TraceText {
    /// The string.
    Text(String),
    /// Not a string (skipped).
    NotText,
}

/// When to parse `hidden_states`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenMode {
    /// Always (non-stream bodies).
    Always,
    /// Only on the final event: when `finish_reason` was non-null before `hidden_states`
    /// (sglang's key order, §2.3). In an [`SseReader`], an event whose `finish_reason` is
    /// `null` is not read past it (its `text` and `output_ids` come first and are read).
    IfFinished,
    /// Never.
    Skip,
}

/// Scan a reply held in memory. `want_text` decodes `text`. The kept rows are returned in
/// [`Rows::bits`].
///
/// # Errors
/// [`ScanError`] on malformed JSON or non-numeric hidden values.
pub fn scan_reply(b: &[u8], hidden: HiddenMode, want_text: bool) -> Result<Reply, ScanError> {
    let mut keep = KeepRows::default();
    let mut c = Cur::new(SliceSource::new(b), usize::MAX);
    let mut r = run_ready(scan_one(&mut c, hidden, want_text, &mut keep))?;
    if let Some(rows) = r.rows.as_mut() {
        rows.bits = keep.0;
    }
    Ok(r)
}

/// Scan a non-stream reply as its bytes arrive from `src`, handing kept rows to `sink`
/// ([`Rows::bits`] stays empty). A reply longer than `cap` bytes is refused, however its
/// bytes are split into reads; no read is made once `cap` bytes and a number's lookahead
/// (66 B) are buffered. Memory: the unread part of the last read plus the strings picked
/// out (`text`, rid) and the output ids; never the body.
///
/// # Errors
/// [`ScanError`] on malformed JSON, non-numeric hidden values, a reply over `cap`
/// ([`ScanError::TooLarge`]) or a failing source.
pub async fn scan_reply_from<S: ReplySource>(
    src: S,
    hidden: HiddenMode,
    want_text: bool,
    cap: usize,
    sink: &mut dyn RowSink,
) -> Result<Reply, ScanError> {
    let mut c = Cur::new(src, cap);
    let r = scan_one(&mut c, hidden, want_text, sink).await?;
    c.within_limit(c.pos())?;
    Ok(r)
}

async fn scan_one<S: ReplySource>(
    c: &mut Cur<S>,
    hidden: HiddenMode,
    want_text: bool,
    sink: &mut dyn RowSink,
) -> Result<Reply, ScanError> {
    let mut r = Reply::default();
    let mut object_error = false;
    let mut message: Option<String> = None;
    c.ws().await?;
    // Batch replies are a one-element array (§2.8): unwrap it.
    // (A batch's further items are not read: the miner never sends batches.)
    if c.peek().await? == Some(b'[') {
        c.i += 1;
        c.ws().await?;
    }
    c.expect(b'{', "an object").await?;
    c.ws().await?;
    if c.peek().await? == Some(b'}') {
        c.i += 1;
    } else {
        loop {
            let key = c.key().await?;
            match key.as_str() {
                "text" if want_text => r.text = c.opt_string().await?,
                "output_ids" => r.n_output_ids = c.count_array().await?,
                "meta_info" => {
                    if scan_meta(c, &mut r, hidden, sink).await? == Meta::Abandoned {
                        c.abandoned = true;
                        return Ok(r);
                    }
                }
                "error" => {
                    c.ws().await?;
                    match c.peek().await? {
                        Some(b'"') => r.error = Some(c.string().await?),
                        Some(b'{') => r.error = Some(scan_error_obj(c).await?),
                        _ => c.skip_value().await?,
                    }
                }
                "object" => {
                    c.ws().await?;
                    if c.peek().await? == Some(b'"') {
                        object_error = c.string().await? == "error";
                    } else {
                        c.skip_value().await?;
                    }
                }
                "message" => {
                    c.ws().await?;
                    if c.peek().await? == Some(b'"') {
                        message = Some(c.string().await?);
                    } else {
                        c.skip_value().await?;
                    }
                }
                _ => c.skip_value().await?,
            }
            if !c.comma_or(b'}').await? {
                break;
            }
        }
    }
    if object_error && r.error.is_none() {
        r.error = Some(message.unwrap_or_else(|| "error".into()));
    }
    Ok(r)
}

async fn scan_error_obj<S: ReplySource>(c: &mut Cur<S>) -> Result<String, ScanError> {
    let mut msg = String::from("error");
    c.expect(b'{', "an object").await?;
    c.ws().await?;
    if c.peek().await? == Some(b'}') {
        c.i += 1;
        return Ok(msg);
    }
    loop {
        let k = c.key().await?;
        c.ws().await?;
        if k == "message" && c.peek().await? == Some(b'"') {
            msg = c.string().await?;
        } else {
            c.skip_value().await?;
        }
        if !c.comma_or(b'}').await? {
            return Ok(msg);
        }
    }
}

/// How [`scan_meta`] left the event.
#[derive(Debug, PartialEq, Eq)]
enum Meta {
    Read,
    /// An SSE event that is not the final one: the rest of it is not read.
    Abandoned,
}

async fn scan_meta<S: ReplySource>(
    c: &mut Cur<S>,
    r: &mut Reply,
    hidden: HiddenMode,
    sink: &mut dyn RowSink,
) -> Result<Meta, ScanError> {
    c.ws().await?;
    if c.peek().await? == Some(b'n') {
        c.skip_value().await?;
        return Ok(Meta::Read);
    }
    c.expect(b'{', "meta_info object").await?;
    c.ws().await?;
    if c.peek().await? == Some(b'}') {
        c.i += 1;
        return Ok(Meta::Read);
    }
    loop {
        let key = c.key().await?;
        match key.as_str() {
            "id" => {
                c.ws().await?;
                r.rid = if c.peek().await? == Some(b'"') {
                    Some(c.string().await?)
                } else {
                    c.skip_value().await?;
                    None
                };
            }
            "finish_reason" => {
                r.finish = scan_finish(c).await?;
                // An intermediate SSE event (§2.7): everything after finish_reason
                // (cumulative logprobs, hidden states) is only needed from the final event,
                // so the rest of this one is skipped as a line, at memchr speed. Without
                // this, a streamed reply costs O(tokens²) parsing.
                if hidden == HiddenMode::IfFinished && r.finish.is_none() && c.line_mode {
                    return Ok(Meta::Abandoned);
                }
            }
            "routed_experts" | "indexer_topk"
                if hidden == HiddenMode::Always
                    || (hidden == HiddenMode::IfFinished && r.finish.is_some()) =>
            {
                c.ws().await?;
                let t = if c.peek().await? == Some(b'"') {
                    TraceText::Text(c.string().await?)
                } else {
                    c.skip_value().await?;
                    TraceText::NotText
                };
                if key == "routed_experts" {
                    r.routed_experts = Some(t);
                } else {
                    r.indexer_topk = Some(t);
                }
            }
            "prompt_tokens" => r.prompt_tokens = c.opt_u64().await?,
            "cached_tokens" => r.cached_tokens = c.opt_u64().await?.unwrap_or(0),
            "output_token_logprobs" => {
                r.has_logprobs = true;
                scan_logprobs(c, &mut r.output_token_ids).await?;
            }
            "hidden_states" => {
                let parse = match hidden {
                    HiddenMode::Always => true,
                    HiddenMode::IfFinished => r.finish.is_some(),
                    HiddenMode::Skip => false,
                };
                if parse {
                    // A second `hidden_states` (a repeated key, or a second `meta_info`)
                    // would hand the sink rows that `Rows` does not count: refuse it.
                    if r.rows.is_some() {
                        return Err(c.err("a single hidden_states (the key repeats)"));
                    }
                    r.rows = Some(scan_hidden(c, sink).await?);
                } else {
                    c.skip_value().await?;
                }
            }
            _ => c.skip_value().await?,
        }
        if !c.comma_or(b'}').await? {
            return Ok(Meta::Read);
        }
    }
}

async fn scan_finish<S: ReplySource>(c: &mut Cur<S>) -> Result<Option<Finish>, ScanError> {
    c.ws().await?;
    match c.peek().await? {
        Some(b'n') => {
            c.skip_value().await?;
            Ok(None)
        }
        Some(b'{') => {
            c.i += 1;
            let mut f = Finish::default();
            c.ws().await?;
            if c.peek().await? == Some(b'}') {
                c.i += 1;
                return Ok(Some(f));
            }
            loop {
                let k = c.key().await?;
                c.ws().await?;
                match (k.as_str(), c.peek().await?) {
                    ("type", Some(b'"')) => f.kind = c.string().await?,
                    ("message", Some(b'"')) => f.message = Some(c.string().await?),
                    ("status_code", _) => f.status_code = c.opt_u64().await?,
                    _ => c.skip_value().await?,
                }
                if !c.comma_or(b'}').await? {
                    return Ok(Some(f));
                }
            }
        }
        _ => {
            c.skip_value().await?;
            Ok(Some(Finish {
                kind: "unknown".into(),
                ..Finish::default()
            }))
        }
    }
}

async fn scan_logprobs<S: ReplySource>(
    c: &mut Cur<S>,
    out: &mut Vec<u32>,
) -> Result<(), ScanError> {
    out.clear();
    c.ws().await?;
    if c.peek().await? == Some(b'n') {
        return c.skip_value().await;
    }
    c.expect(b'[', "output_token_logprobs list").await?;
    c.ws().await?;
    if c.peek().await? == Some(b']') {
        c.i += 1;
        return Ok(());
    }
    loop {
        c.ws().await?;
        c.expect(b'[', "[logprob, token_id, text]").await?;
        c.skip_value().await?; // logprob
        c.ws().await?;
        c.expect(b',', "a token id").await?;
        let id = c.opt_u64().await?.ok_or(ScanError::Malformed {
            at: c.pos(),
            what: "a token id",
        })?;
        out.push(u32::try_from(id).map_err(|_| ScanError::Malformed {
            at: c.pos(),
            what: "a 32-bit token id",
        })?);
        while c.comma_or(b']').await? {
            c.skip_value().await?;
        }
        if !c.comma_or(b']').await? {
            return Ok(());
        }
    }
}

/// Parse `hidden_states` (§2.6.4): `[ [[row]…] | [] | [v…] , … ]`, handing each kept row
/// to `sink`. One reused row buffer; no allocation per row.
async fn scan_hidden<S: ReplySource>(
    c: &mut Cur<S>,
    sink: &mut dyn RowSink,
) -> Result<Rows, ScanError> {
    let mut rows = Rows::default();
    let mut scratch: Vec<u16> = Vec::new();
    c.ws().await?;
    if c.peek().await? == Some(b'n') {
        c.skip_value().await?;
        return Ok(rows);
    }
    c.expect(b'[', "hidden_states list").await?;
    c.ws().await?;
    if c.peek().await? == Some(b']') {
        c.i += 1;
        return Ok(rows);
    }
    loop {
        c.ws().await?;
        c.expect(b'[', "a hidden-state element").await?;
        let idx = rows.n_elements;
        rows.n_elements += 1;
        c.ws().await?;
        match c.peek().await? {
            Some(b']') => {
                c.i += 1;
                if rows.n_rows == 0 {
                    rows.offset += 1;
                } else {
                    rows.holes += 1;
                }
            }
            Some(b'[') => {
                // 2-D block: keep only its last row.
                let mut n_block = 0usize;
                loop {
                    c.ws().await?;
                    c.expect(b'[', "a hidden-state row").await?;
                    scratch.clear();
                    c.floats_into(&mut scratch).await?;
                    n_block += 1;
                    if !c.comma_or(b']').await? {
                        break;
                    }
                }
                if idx == 0 {
                    rows.first_block_rows = n_block;
                } else {
                    rows.late_blocks += 1;
                }
                push_row(&mut rows, sink, idx, &scratch);
            }
            _ => {
                scratch.clear();
                c.floats_into(&mut scratch).await?;
                push_row(&mut rows, sink, idx, &scratch);
            }
        }
        if !c.comma_or(b']').await? {
            return Ok(rows);
        }
    }
}

fn push_row(rows: &mut Rows, sink: &mut dyn RowSink, element: usize, row: &[u16]) {
    let w = row.len();
    if rows.n_rows == 0 && rows.width == 0 {
        rows.width = w;
    } else if w != rows.width && rows.ragged.is_none() {
        rows.ragged = Some((rows.n_rows, w));
    }
    sink.row(element, row);
    rows.n_rows += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use engy_core::toploc::f32_to_bf16_bits;

    const EXAMPLE: &str = r#"{"text":" blue sky","output_ids":[201,202],"meta_info":{"id":"engy-0a1b","finish_reason":{"type":"length","length":2},"prompt_tokens":3,"weight_version":"default","num_retractions":0,"input_token_logprobs":[],"output_token_logprobs":[[-0.012299999594688416,201,null],[-0.45669999718666077,202,null]],"output_token_logprobs_length":2,"reasoning_tokens":0,"completion_tokens":2,"cached_tokens":0,"cached_tokens_details":null,"hidden_states":[[[0.5,-1.25,0.0078125,2.0],[0.375,-0.75,1.5,0.046875],[-0.1640625,3.25,-2.5,0.8125]],[0.30078125,-0.0439453125,1.0,-0.5]],"dp_rank":null,"e2e_latency":0.0831,"response_sent_to_client_ts":1769990400.125}}"#;

    fn bits(v: &[f32]) -> Vec<u16> {
        v.iter().map(|x| f32_to_bf16_bits(*x)).collect()
    }

    #[test]
    fn the_spec_example() {
        let r = scan_reply(EXAMPLE.as_bytes(), HiddenMode::Always, true).unwrap();
        assert_eq!(r.text.as_deref(), Some(" blue sky"));
        assert_eq!(r.n_output_ids, 2);
        assert_eq!(r.output_token_ids, vec![201, 202]);
        assert_eq!(r.finish.as_ref().unwrap().kind, "length");
        assert_eq!(r.prompt_tokens, Some(3));
        let rows = r.rows.unwrap();
        assert_eq!(
            (rows.n_rows, rows.width, rows.offset, rows.first_block_rows),
            (2, 4, 0, 3)
        );
        let mut want = bits(&[-0.1640625, 3.25, -2.5, 0.8125]);
        want.extend(bits(&[0.30078125, -0.043_945_312, 1.0, -0.5]));
        assert_eq!(rows.bits, want);
    }

    #[test]
    fn empty_prefill_block_is_an_offset_and_skip_mode_skips() {
        let s = r#"{"text":"a\"b\u00e9","meta_info":{"finish_reason":null,"hidden_states":[[],[1.5,2e-3],[3,-4E1]],"cached_tokens":7}}"#;
        let r = scan_reply(s.as_bytes(), HiddenMode::Always, true).unwrap();
        assert_eq!(r.text.as_deref(), Some("a\"bé"));
        let rows = r.rows.unwrap();
        assert_eq!((rows.offset, rows.n_rows, rows.width), (1, 2, 2));
        assert_eq!(r.cached_tokens, 7);
        let r = scan_reply(s.as_bytes(), HiddenMode::IfFinished, false).unwrap();
        assert!(r.rows.is_none() && r.text.is_none());
    }

    #[test]
    fn errors_and_ragged_rows() {
        let r = scan_reply(
            br#"{"error":{"message":"Duplicate request ID detected: x"}}"#,
            HiddenMode::Always,
            false,
        )
        .unwrap();
        assert_eq!(r.error.as_deref(), Some("Duplicate request ID detected: x"));
        let r = scan_reply(
            br#"{"object":"error","message":"boom","type":"503","param":null,"code":503}"#,
            HiddenMode::Always,
            false,
        )
        .unwrap();
        assert_eq!(r.error.as_deref(), Some("boom"));
        let r = scan_reply(
            br#"{"meta_info":{"hidden_states":[[[1,2]],[1,2,3]]}}"#,
            HiddenMode::Always,
            false,
        )
        .unwrap();
        assert_eq!(r.rows.unwrap().ragged, Some((1, 3)));
        assert!(scan_reply(
            br#"{"meta_info":{"hidden_states":[[1,null]]}}"#,
            HiddenMode::Always,
            false
        )
        .is_err());
        assert!(scan_reply(
            br#"{"meta_info":{"hidden_states":[[1,2"#,
            HiddenMode::Always,
            false
        )
        .is_err());
        assert!(scan_reply(
            br#"{"text":"abc","output_ids":[1,"#,
            HiddenMode::Always,
            false
        )
        .is_err());
    }

    #[test]
    fn trace_fields_are_read_with_the_hidden_states() {
        let s = br#"{"meta_info":{"finish_reason":{"type":"length"},"hidden_states":[[1]],"routed_experts":"AQAAAA==","indexer_topk":7,"dp_rank":null}}"#;
        let r = scan_reply(s, HiddenMode::Always, false).unwrap();
        assert_eq!(r.routed_experts, Some(TraceText::Text("AQAAAA==".into())));
        assert_eq!(r.indexer_topk, Some(TraceText::NotText));
        let r = scan_reply(s, HiddenMode::Skip, false).unwrap();
        assert_eq!((r.routed_experts, r.indexer_topk), (None, None));
        let unfinished = br#"{"meta_info":{"finish_reason":null,"routed_experts":"AQAAAA=="}}"#;
        let r = scan_reply(unfinished, HiddenMode::IfFinished, false).unwrap();
        assert_eq!(r.routed_experts, None);
    }

    #[test]
    fn skip_value_handles_nesting_and_strings() {
        let s = br#"{"x":{"a":[1,{"b":"]}\"["}],"c":{}},"meta_info":{"hidden_states":[[1]]}}"#;
        let r = scan_reply(s, HiddenMode::Always, false).unwrap();
        assert_eq!(r.rows.unwrap().n_rows, 1);
    }

    /// Feeds `step` bytes per read, to cut the reply at every possible place.
    struct Drip<'a> {
        rest: &'a [u8],
        step: usize,
    }

    impl ReplySource for Drip<'_> {
        async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
            if self.rest.is_empty() {
                return Ok(false);
            }
            let (a, b) = self.rest.split_at(self.step.min(self.rest.len()));
            buf.extend_from_slice(a);
            self.rest = b;
            Ok(true)
        }
    }

    fn dripped(b: &[u8], step: usize, mode: HiddenMode) -> Result<Reply, ScanError> {
        let mut keep = KeepRows::default();
        let src = Drip { rest: b, step };
        let mut r = run_ready(scan_reply_from(src, mode, true, usize::MAX, &mut keep))?;
        if let Some(rows) = r.rows.as_mut() {
            rows.bits = keep.0;
        }
        Ok(r)
    }

    #[test]
    fn every_chunking_gives_the_same_reply_and_errors() {
        let long_number = format!(
            r#"{{"meta_info":{{"hidden_states":[[1.{}5]]}}}}"#,
            "0".repeat(80)
        );
        let cases: Vec<&[u8]> = vec![
            EXAMPLE.as_bytes(),
            br#"{"text":"a\"b\u00e9","meta_info":{"finish_reason":null,"hidden_states":[[],[1.5,2e-3],[3,-4E1]],"cached_tokens":7}}"#,
            br#"[{"text":"x","output_ids":[1],"meta_info":{"hidden_states":[[ 1 , 2 ],[3,4]]}}]"#,
            br#"{"meta_info":{"hidden_states":[[1,null]]}}"#,
            br#"{"meta_info":{"hidden_states":[[1,2"#,
            br#"{"text":"abc","output_ids":[1,"#,
            br#"{"x":{"a":[1,{"b":"]}\"["}],"c":{}},"meta_info":{"hidden_states":[[1]]}}"#,
            long_number.as_bytes(),
        ];
        for case in cases {
            let whole = scan_reply(case, HiddenMode::Always, true);
            for step in [1, 2, 3, 5, 8, 13, 64, 1000] {
                assert_eq!(
                    dripped(case, step, HiddenMode::Always),
                    whole,
                    "step {step}: {}",
                    String::from_utf8_lossy(case)
                );
            }
        }
        // A float longer than any orjson writes is refused, not parsed as a prefix.
        assert!(matches!(
            scan_reply(long_number.as_bytes(), HiddenMode::Always, false),
            Err(ScanError::BadHidden { .. })
        ));
    }

    #[test]
    fn the_cap_and_a_broken_source_are_errors() {
        let mut sink = DropRows;
        // However the bytes arrive: a body whose last read carries it past the cap (and
        // the whole body in one read) is refused as well as one that needs a read after.
        for step in [1, 7, 64, 99, 100, 101, EXAMPLE.len()] {
            let src = Drip {
                rest: EXAMPLE.as_bytes(),
                step,
            };
            let r = run_ready(scan_reply_from(
                src,
                HiddenMode::Always,
                false,
                100,
                &mut sink,
            ));
            assert_eq!(r, Err(ScanError::TooLarge { cap: 100 }), "step {step}");
        }
        // Exactly at the cap is not over it.
        let src = Drip {
            rest: EXAMPLE.as_bytes(),
            step: EXAMPLE.len(),
        };
        let r = run_ready(scan_reply_from(
            src,
            HiddenMode::Always,
            false,
            EXAMPLE.len(),
            &mut sink,
        ));
        assert!(r.is_ok(), "{r:?}");
        struct Broken;
        impl ReplySource for Broken {
            async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
                if buf.is_empty() {
                    buf.extend_from_slice(b"{\"meta_info\":{\"hidden_states\":[[1.5,");
                    return Ok(true);
                }
                Err(ScanError::Source("connection reset".into()))
            }
        }
        let r = run_ready(scan_reply_from(
            Broken,
            HiddenMode::Always,
            false,
            1 << 20,
            &mut sink,
        ));
        assert_eq!(r, Err(ScanError::Source("connection reset".into())));
    }

    #[test]
    fn sse_events_one_at_a_time_with_rows_only_from_the_final_event() {
        let stock = EXAMPLE.replace(
            r#""finish_reason":{"type":"length","length":2}"#,
            r#""finish_reason":null"#,
        );
        let stream =
            format!(": keep-alive\n\ndata: {stock}\n\ndata:{EXAMPLE}\r\n\ndata: [DONE]\n\n");
        for step in [1, 4, 9, 4096] {
            let mut rd = SseReader::new(
                Drip {
                    rest: stream.as_bytes(),
                    step,
                },
                1 << 20,
            );
            let mut keep = KeepRows::default();
            let first = run_ready(rd.next_event(HiddenMode::IfFinished, true, &mut keep))
                .unwrap()
                .unwrap();
            assert!(first.finish.is_none() && first.rows.is_none());
            assert_eq!(first.text.as_deref(), Some(" blue sky"));
            assert!(keep.0.is_empty(), "intermediate rows are skipped");
            let last = run_ready(rd.next_event(HiddenMode::IfFinished, true, &mut keep))
                .unwrap()
                .unwrap();
            assert_eq!(last.rows.as_ref().map(|r| r.n_rows), Some(2));
            let mut want = bits(&[-0.1640625, 3.25, -2.5, 0.8125]);
            want.extend(bits(&[0.30078125, -0.043_945_312, 1.0, -0.5]));
            assert_eq!(keep.0, want);
            assert_eq!(
                run_ready(rd.next_event(HiddenMode::IfFinished, true, &mut keep)),
                Ok(None)
            );
        }
        // An event cut short by a newline is malformed, never joined with the next line.
        let cut = "data: {\"text\":\"ab\ndata: [DONE]\n\n";
        let mut rd = SseReader::new(SliceSource::new(cut.as_bytes()), 1 << 20);
        assert!(matches!(
            run_ready(rd.next_event(HiddenMode::IfFinished, true, &mut DropRows)),
            Err(ScanError::Malformed { .. })
        ));
        // An event over the cap, however the bytes arrive (the whole stream in one read
        // included).
        for step in [1, 16, 64, stream.len()] {
            let src = Drip {
                rest: stream.as_bytes(),
                step,
            };
            let mut rd = SseReader::new(src, 64);
            assert_eq!(
                run_ready(rd.next_event(HiddenMode::IfFinished, true, &mut DropRows)),
                Err(ScanError::TooLarge { cap: 64 }),
                "step {step}"
            );
        }
        // Each event is held to the cap on its own: a cap that fits the longer event lets
        // both through, however many events one read carries.
        let longest = stream
            .lines()
            .filter(|l| l.starts_with("data:"))
            .map(str::len)
            .max()
            .unwrap_or(0);
        for step in [1, 16, stream.len()] {
            let src = Drip {
                rest: stream.as_bytes(),
                step,
            };
            let mut rd = SseReader::new(src, longest);
            for _ in 0..2 {
                let ev = run_ready(rd.next_event(HiddenMode::IfFinished, true, &mut DropRows));
                assert!(matches!(ev, Ok(Some(_))), "step {step}: {ev:?}");
            }
        }
    }

    #[test]
    fn every_bf16_value_as_orjson_prints_it_comes_back_bit_exact() {
        let mut want = Vec::new();
        let mut body = String::from(r#"{"meta_info":{"hidden_states":[["#);
        for b in 0..=u16::MAX {
            let v = f64::from(engy_core::toploc::bf16_bits_to_f32(b));
            if v.is_finite() {
                if !want.is_empty() {
                    body.push(',');
                }
                body.push_str(&serde_json::to_string(&v).unwrap());
                want.push(b);
            }
        }
        body.push_str("]]}}");
        let rows = scan_reply(body.as_bytes(), HiddenMode::Always, false)
            .unwrap()
            .rows
            .unwrap();
        assert_eq!(rows.bits, want);
    }
}
