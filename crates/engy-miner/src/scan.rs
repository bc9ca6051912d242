//! Single-pass scanner for sglang `/generate` replies (a non-stream body or one SSE event
//! payload), sglang-native-api.md §2.2–§2.7.
//!
//! The reply can be hundreds of MB, almost all of it `meta_info.hidden_states`. The scanner
//! walks the bytes once, never builds a generic JSON value, and converts each hidden float
//! straight to a bfloat16 bit pattern (float32 first, then round-to-nearest-even, as numpy
//! float32 → `torch.bfloat16` does; PROTOCOL.md §3.8) into one flat row buffer. Of each 2-D
//! element (a prefill or re-prefill block) only the LAST row is kept: it is the hidden state
//! that sampled that element's token (§2.6.1).
//!
//! Everything else the miner needs is picked out on the way: `text`, the output ids
//! (`output_token_logprobs[*][1]`, §2.5), `output_ids` length, `finish_reason`,
//! `prompt_tokens`, `cached_tokens`, and sglang's error envelopes.
use std::borrow::Cow;

use engy_core::toploc::f32_to_bf16_bits;

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
    /// bf16 bit patterns, row-major, `n_rows × width`.
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
}

/// When to parse `hidden_states`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenMode {
    /// Always (non-stream bodies).
    Always,
    /// Only on the final event: when `finish_reason` was non-null before `hidden_states`
    /// (sglang's key order, §2.3). Intermediate SSE events are skipped at scan speed.
    IfFinished,
    /// Never.
    Skip,
}

/// Scan a reply. `want_text` decodes `text`.
///
/// # Errors
/// [`ScanError`] on malformed JSON or non-numeric hidden values.
pub fn scan_reply(b: &[u8], hidden: HiddenMode, want_text: bool) -> Result<Reply, ScanError> {
    let mut c = Cur { b, i: 0 };
    let mut r = Reply::default();
    let mut object_error = false;
    let mut message: Option<String> = None;
    c.ws();
    // Batch replies are a one-element array (§2.8): unwrap it.
    let batch = c.peek() == Some(b'[');
    if batch {
        c.i += 1;
        c.ws();
    }
    c.expect(b'{', "an object")?;
    c.ws();
    if c.peek() == Some(b'}') {
        c.i += 1;
    } else {
        loop {
            let key = c.key()?;
            match key.as_ref() {
                "text" if want_text => r.text = c.opt_string()?,
                "output_ids" => r.n_output_ids = c.count_array()?,
                "meta_info" => scan_meta(&mut c, &mut r, hidden)?,
                "error" => {
                    c.ws();
                    match c.peek() {
                        Some(b'"') => r.error = Some(c.string()?.into_owned()),
                        Some(b'{') => r.error = Some(scan_error_obj(&mut c)?),
                        _ => c.skip_value()?,
                    }
                }
                "object" => {
                    c.ws();
                    if c.peek() == Some(b'"') {
                        object_error = c.string()? == "error";
                    } else {
                        c.skip_value()?;
                    }
                }
                "message" => {
                    c.ws();
                    if c.peek() == Some(b'"') {
                        message = Some(c.string()?.into_owned());
                    } else {
                        c.skip_value()?;
                    }
                }
                _ => c.skip_value()?,
            }
            if !c.comma_or(b'}')? {
                break;
            }
        }
    }
    if object_error && r.error.is_none() {
        r.error = Some(message.unwrap_or_else(|| "error".into()));
    }
    if batch {
        // Ignore further items: the miner never sends batches.
        c.ws();
    }
    Ok(r)
}

fn scan_error_obj(c: &mut Cur<'_>) -> Result<String, ScanError> {
    let mut msg = String::from("error");
    c.expect(b'{', "an object")?;
    c.ws();
    if c.peek() == Some(b'}') {
        c.i += 1;
        return Ok(msg);
    }
    loop {
        let k = c.key()?;
        c.ws();
        if k == "message" && c.peek() == Some(b'"') {
            msg = c.string()?.into_owned();
        } else {
            c.skip_value()?;
        }
        if !c.comma_or(b'}')? {
            return Ok(msg);
        }
    }
}

fn scan_meta(c: &mut Cur<'_>, r: &mut Reply, hidden: HiddenMode) -> Result<(), ScanError> {
    c.ws();
    if c.peek() == Some(b'n') {
        return c.skip_value();
    }
    c.expect(b'{', "meta_info object")?;
    c.ws();
    if c.peek() == Some(b'}') {
        c.i += 1;
        return Ok(());
    }
    loop {
        let key = c.key()?;
        match key.as_ref() {
            "id" => {
                c.ws();
                r.rid = if c.peek() == Some(b'"') {
                    Some(c.string()?.into_owned())
                } else {
                    c.skip_value()?;
                    None
                };
            }
            "finish_reason" => r.finish = scan_finish(c)?,
            "prompt_tokens" => r.prompt_tokens = c.opt_u64()?,
            "cached_tokens" => r.cached_tokens = c.opt_u64()?.unwrap_or(0),
            "output_token_logprobs" => {
                r.has_logprobs = true;
                scan_logprobs(c, &mut r.output_token_ids)?;
            }
            "hidden_states" => {
                let parse = match hidden {
                    HiddenMode::Always => true,
                    HiddenMode::IfFinished => r.finish.is_some(),
                    HiddenMode::Skip => false,
                };
                if parse {
                    r.rows = Some(scan_hidden(c)?);
                } else {
                    c.skip_value()?;
                }
            }
            _ => c.skip_value()?,
        }
        if !c.comma_or(b'}')? {
            return Ok(());
        }
    }
}

fn scan_finish(c: &mut Cur<'_>) -> Result<Option<Finish>, ScanError> {
    c.ws();
    match c.peek() {
        Some(b'n') => {
            c.skip_value()?;
            Ok(None)
        }
        Some(b'{') => {
            c.i += 1;
            let mut f = Finish::default();
            c.ws();
            if c.peek() == Some(b'}') {
                c.i += 1;
                return Ok(Some(f));
            }
            loop {
                let k = c.key()?;
                c.ws();
                match (k.as_ref(), c.peek()) {
                    ("type", Some(b'"')) => f.kind = c.string()?.into_owned(),
                    ("message", Some(b'"')) => f.message = Some(c.string()?.into_owned()),
                    ("status_code", _) => f.status_code = c.opt_u64()?,
                    _ => c.skip_value()?,
                }
                if !c.comma_or(b'}')? {
                    return Ok(Some(f));
                }
            }
        }
        _ => {
            c.skip_value()?;
            Ok(Some(Finish {
                kind: "unknown".into(),
                ..Finish::default()
            }))
        }
    }
}

fn scan_logprobs(c: &mut Cur<'_>, out: &mut Vec<u32>) -> Result<(), ScanError> {
    out.clear();
    c.ws();
    if c.peek() == Some(b'n') {
        return c.skip_value();
    }
    c.expect(b'[', "output_token_logprobs list")?;
    c.ws();
    if c.peek() == Some(b']') {
        c.i += 1;
        return Ok(());
    }
    loop {
        c.ws();
        c.expect(b'[', "[logprob, token_id, text]")?;
        c.skip_value()?; // logprob
        c.ws();
        c.expect(b',', "a token id")?;
        let id = c.opt_u64()?.ok_or(ScanError::Malformed {
            at: c.i,
            what: "a token id",
        })?;
        out.push(u32::try_from(id).map_err(|_| ScanError::Malformed {
            at: c.i,
            what: "a 32-bit token id",
        })?);
        while c.comma_or(b']')? {
            c.skip_value()?;
        }
        if !c.comma_or(b']')? {
            return Ok(());
        }
    }
}

/// Parse `hidden_states` (§2.6.4): `[ [[row]…] | [] | [v…] , … ]`.
fn scan_hidden(c: &mut Cur<'_>) -> Result<Rows, ScanError> {
    let mut rows = Rows::default();
    let mut scratch: Vec<u16> = Vec::new();
    c.ws();
    if c.peek() == Some(b'n') {
        c.skip_value()?;
        return Ok(rows);
    }
    c.expect(b'[', "hidden_states list")?;
    c.ws();
    if c.peek() == Some(b']') {
        c.i += 1;
        return Ok(rows);
    }
    loop {
        c.ws();
        c.expect(b'[', "a hidden-state element")?;
        let idx = rows.n_elements;
        rows.n_elements += 1;
        c.ws();
        match c.peek() {
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
                    c.ws();
                    c.expect(b'[', "a hidden-state row")?;
                    scratch.clear();
                    c.floats_into(&mut scratch)?;
                    n_block += 1;
                    if !c.comma_or(b']')? {
                        break;
                    }
                }
                if idx == 0 {
                    rows.first_block_rows = n_block;
                } else {
                    rows.late_blocks += 1;
                }
                push_row(&mut rows, &scratch);
            }
            _ => {
                let start = rows.bits.len();
                c.floats_into(&mut rows.bits)?;
                let w = rows.bits.len() - start;
                note_width(&mut rows, w);
                rows.n_rows += 1;
            }
        }
        if !c.comma_or(b']')? {
            return Ok(rows);
        }
    }
}

fn note_width(rows: &mut Rows, w: usize) {
    if rows.n_rows == 0 && rows.width == 0 {
        rows.width = w;
    } else if w != rows.width && rows.ragged.is_none() {
        rows.ragged = Some((rows.n_rows, w));
    }
}

fn push_row(rows: &mut Rows, row: &[u16]) {
    note_width(rows, row.len());
    rows.bits.extend_from_slice(row);
    rows.n_rows += 1;
}

/// A cursor over JSON bytes.
struct Cur<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cur<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.peek() {
            self.i += 1;
        }
    }

    fn err(&self, what: &'static str) -> ScanError {
        ScanError::Malformed { at: self.i, what }
    }

    fn expect(&mut self, ch: u8, what: &'static str) -> Result<(), ScanError> {
        if self.peek() == Some(ch) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.err(what))
        }
    }

    /// After a value: `,` → true (another follows), `close` → false.
    fn comma_or(&mut self, close: u8) -> Result<bool, ScanError> {
        self.ws();
        match self.peek() {
            Some(b',') => {
                self.i += 1;
                Ok(true)
            }
            Some(x) if x == close => {
                self.i += 1;
                Ok(false)
            }
            _ => Err(self.err("',' or a closing bracket")),
        }
    }

    /// An object key and its colon.
    fn key(&mut self) -> Result<Cow<'a, str>, ScanError> {
        self.ws();
        let k = self.string()?;
        self.ws();
        self.expect(b':', "':'")?;
        Ok(k)
    }

    /// End index (exclusive) of the string starting at `self.i` (which is `"`), and
    /// whether it has escapes.
    fn string_end(&self) -> Result<(usize, bool), ScanError> {
        let mut j = self.i + 1;
        let mut escaped = false;
        loop {
            let rest = self.b.get(j..).ok_or_else(|| self.err("a closing quote"))?;
            let k =
                memchr::memchr2(b'"', b'\\', rest).ok_or_else(|| self.err("a closing quote"))?;
            j += k;
            if self.b.get(j) == Some(&b'\\') {
                escaped = true;
                j += 2;
            } else {
                return Ok((j + 1, escaped));
            }
        }
    }

    fn string(&mut self) -> Result<Cow<'a, str>, ScanError> {
        if self.peek() != Some(b'"') {
            return Err(self.err("a string"));
        }
        let (end, escaped) = self.string_end()?;
        let raw = self
            .b
            .get(self.i..end)
            .ok_or_else(|| self.err("a string"))?;
        let out = if escaped {
            Cow::Owned(
                serde_json::from_slice::<String>(raw).map_err(|_| self.err("a valid string"))?,
            )
        } else {
            let inner = raw
                .get(1..raw.len() - 1)
                .ok_or_else(|| self.err("a string"))?;
            Cow::Borrowed(std::str::from_utf8(inner).map_err(|_| self.err("UTF-8 text"))?)
        };
        self.i = end;
        Ok(out)
    }

    fn opt_string(&mut self) -> Result<Option<String>, ScanError> {
        self.ws();
        if self.peek() == Some(b'"') {
            Ok(Some(self.string()?.into_owned()))
        } else {
            self.skip_value()?;
            Ok(None)
        }
    }

    fn opt_u64(&mut self) -> Result<Option<u64>, ScanError> {
        self.ws();
        let start = self.i;
        let mut v: u64 = 0;
        let mut any = false;
        while let Some(d @ b'0'..=b'9') = self.peek() {
            v = v
                .checked_mul(10)
                .and_then(|x| x.checked_add(u64::from(d - b'0')))
                .ok_or_else(|| self.err("an integer"))?;
            self.i += 1;
            any = true;
        }
        if any {
            // An integer written as a float (e.g. 3.0) or a larger number: skip the rest.
            if matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
                self.i = start;
                self.skip_value()?;
            }
            return Ok(Some(v));
        }
        self.skip_value()?;
        Ok(None)
    }

    /// Number of values in an array (skipping them).
    fn count_array(&mut self) -> Result<usize, ScanError> {
        self.ws();
        if self.peek() != Some(b'[') {
            self.skip_value()?;
            return Ok(0);
        }
        self.i += 1;
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(0);
        }
        let mut n = 0;
        loop {
            self.skip_value()?;
            n += 1;
            if !self.comma_or(b']')? {
                return Ok(n);
            }
        }
    }

    /// Floats of a 1-D list whose `[` was consumed, through its `]`, as bf16 bits.
    fn floats_into(&mut self, out: &mut Vec<u16>) -> Result<(), ScanError> {
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(());
        }
        loop {
            self.ws();
            let rest = self.b.get(self.i..).unwrap_or(&[]);
            // JSON numbers only: fast-float2 would also accept "inf"/"nan".
            if !matches!(rest.first(), Some(b'-' | b'0'..=b'9')) {
                return Err(ScanError::BadHidden { at: self.i });
            }
            let (v, n) = fast_float2::parse_partial::<f32, _>(rest)
                .map_err(|_| ScanError::BadHidden { at: self.i })?;
            if !v.is_finite() || n == 0 {
                return Err(ScanError::BadHidden { at: self.i });
            }
            out.push(f32_to_bf16_bits(v));
            self.i += n;
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => {
                    self.ws();
                    if !self.comma_or(b']')? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Skip one JSON value of any kind, in linear time.
    fn skip_value(&mut self) -> Result<(), ScanError> {
        self.ws();
        match self.peek() {
            Some(b'"') => {
                let (end, _) = self.string_end()?;
                self.i = end;
                Ok(())
            }
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek() {
                        Some(b'{' | b'[') => {
                            depth += 1;
                            self.i += 1;
                        }
                        Some(b'}' | b']') => {
                            depth = depth.saturating_sub(1);
                            self.i += 1;
                            if depth == 0 {
                                return Ok(());
                            }
                        }
                        Some(b'"') => {
                            let (end, _) = self.string_end()?;
                            self.i = end;
                        }
                        Some(_) => self.i += 1,
                        None => return Err(self.err("a closing bracket")),
                    }
                }
            }
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => {
                while let Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') = self.peek() {
                    self.i += 1;
                }
                Ok(())
            }
            _ => Err(self.err("a value")),
        }
    }

    fn literal(&mut self, lit: &'static [u8]) -> Result<(), ScanError> {
        if self.b.get(self.i..self.i + lit.len()) == Some(lit) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(self.err("a literal"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn skip_value_handles_nesting_and_strings() {
        let s = br#"{"x":{"a":[1,{"b":"]}\"["}],"c":{}},"meta_info":{"hidden_states":[[1]]}}"#;
        let r = scan_reply(s, HiddenMode::Always, false).unwrap();
        assert_eq!(r.rows.unwrap().n_rows, 1);
    }
}
