//! The byte cursor under the scanner: a window over the reply, refilled from its
//! [`ReplySource`] as it is used up, with JSON token readers and the float fast path.
use engy_core::toploc::f32_to_bf16_bits;

use super::decimal;
use super::{ReplySource, ScanError};

/// Where [`floats_fast`] stopped.
enum Fast {
    /// Consumed the row's `]`.
    RowEnd,
    /// Fewer than [`LOOKAHEAD`] bytes left in the window.
    NeedMore,
    /// After a number, at something other than `,` or `]` (e.g. whitespace).
    AfterNumber,
    /// At something other than a number's first byte.
    NotANumber,
    /// A bad value at this window offset.
    Bad(usize),
}

/// Parse the floats of a row from `b[*i..]` while a whole number surely fits in the window
/// (≥ [`LOOKAHEAD`] bytes left), appending bf16 bits to `out`; `*i` ends after the last
/// value or separator consumed. A plain function over a slice, so the hot loop keeps its
/// state in registers.
#[inline]
fn floats_fast(b: &[u8], i: &mut usize, out: &mut Vec<u16>) -> Fast {
    let mut j = *i;
    let stop = loop {
        let Some(rest) = b.get(j..).filter(|r| r.len() >= LOOKAHEAD) else {
            break Fast::NeedMore;
        };
        // JSON numbers only: fast-float2 would also accept "inf"/"nan".
        if !matches!(rest.first(), Some(b'-' | b'0'..=b'9')) {
            break Fast::NotANumber;
        }
        // Decimal → float64 → float32 → bf16, as the reference reads a row (see
        // floats_into): the SWAR fast path, else the exact parser on the same text.
        let (bits, n) = match decimal::parse_bf16(rest) {
            Some(r) => r,
            None => {
                let Ok((v, n)) = fast_float2::parse_partial::<f64, _>(rest) else {
                    break Fast::Bad(j);
                };
                let v = v as f32;
                if !v.is_finite() || n == 0 || n >= MAX_NUMBER {
                    break Fast::Bad(j);
                }
                (f32_to_bf16_bits(v), n)
            }
        };
        out.push(bits);
        j += n;
        match rest.get(n) {
            Some(b',') => j += 1,
            Some(b']') => {
                j += 1;
                break Fast::RowEnd;
            }
            _ => break Fast::AfterNumber,
        }
    };
    *i = j;
    stop
}

/// Longest number text accepted in `hidden_states` (orjson writes at most ~24 bytes).
const MAX_NUMBER: usize = 64;

/// Bytes buffered before a hidden value is parsed (unless the input ends sooner): the
/// longest accepted number plus an exponent marker and its sign, so that a number cut by
/// the window's end never parses as a shorter one (`…0e` | `5` would read as `…0` and
/// then fail differently from the whole reply). Found by the `hidden_rows` fuzz target.
const LOOKAHEAD: usize = MAX_NUMBER + 2;

/// A cursor over a window of the reply's bytes, refilled from the source as it is used up.
/// `b[i..]` is unread; everything before `i` may be dropped on the next refill.
pub(crate) struct Cur<S> {
    pub(crate) src: S,
    pub(crate) b: Vec<u8>,
    pub(crate) i: usize,
    /// Absolute offset of `b[0]` in the reply.
    pub(crate) base: usize,
    pub(crate) eof: bool,
    /// Absolute offset past which a scanned value is too long ([`ScanError::TooLarge`]);
    /// no input is read a [`LOOKAHEAD`] past it.
    pub(crate) limit: usize,
    pub(crate) cap: usize,
    /// SSE: `\n` ends the event, so it is not JSON whitespace here.
    pub(crate) line_mode: bool,
    /// The last value scanned was left before its end (an intermediate SSE event).
    pub(crate) abandoned: bool,
}

impl<S: ReplySource> Cur<S> {
    pub(crate) fn new(src: S, cap: usize) -> Self {
        Self {
            src,
            b: Vec::new(),
            i: 0,
            base: 0,
            eof: false,
            limit: cap,
            cap,
            line_mode: false,
            abandoned: false,
        }
    }

    pub(crate) fn pos(&self) -> usize {
        self.base + self.i
    }

    pub(crate) fn avail(&self) -> usize {
        self.b.len().saturating_sub(self.i)
    }

    pub(crate) fn rest(&self) -> &[u8] {
        self.b.get(self.i..).unwrap_or(&[])
    }

    pub(crate) fn err(&self, what: &'static str) -> ScanError {
        ScanError::Malformed {
            at: self.pos(),
            what,
        }
    }

    /// [`ScanError::TooLarge`] when a value scanned to the absolute offset `end` (exclusive)
    /// ends past the limit. [`Self::fill`] refuses to read once the buffer is past the
    /// limit, but the read that carries a reply past it may be its last (the tail of a body,
    /// or a whole body or several events in one read): the end of each scanned value is
    /// checked here as well, so whether a reply is refused never depends on how its bytes
    /// were split into reads.
    pub(crate) fn within_limit(&self, end: usize) -> Result<(), ScanError> {
        if end > self.limit {
            Err(ScanError::TooLarge { cap: self.cap })
        } else {
            Ok(())
        }
    }

    /// Drop the read bytes and append more from the source. False at the end of input.
    pub(crate) async fn fill(&mut self) -> Result<bool, ScanError> {
        if self.eof {
            return Ok(false);
        }
        if self.i > 0 {
            self.b.drain(..self.i);
            self.base += self.i;
            self.i = 0;
        }
        // Reading stops a lookahead past the limit (memory stays bounded by the cap), and
        // never sooner: a value that ends within the limit may need a lookahead past its
        // end (a number's, or the start of the next SSE event's line) to be scanned.
        if self.base + self.b.len() > self.limit.saturating_add(LOOKAHEAD) {
            return Err(ScanError::TooLarge { cap: self.cap });
        }
        let before = self.b.len();
        loop {
            if !self.src.read_into(&mut self.b).await? {
                self.eof = true;
                return Ok(self.b.len() > before);
            }
            if self.b.len() > before {
                return Ok(true);
            }
        }
    }

    /// Refill until at least `n` unread bytes are buffered or the input ended.
    pub(crate) async fn fill_to(&mut self, n: usize) -> Result<(), ScanError> {
        while self.avail() < n && self.fill().await? {}
        Ok(())
    }

    pub(crate) async fn peek(&mut self) -> Result<Option<u8>, ScanError> {
        if self.i >= self.b.len() {
            self.fill().await?;
        }
        Ok(self.b.get(self.i).copied())
    }

    pub(crate) async fn ws(&mut self) -> Result<(), ScanError> {
        loop {
            match self.peek().await? {
                Some(b' ' | b'\r' | b'\t') => self.i += 1,
                Some(b'\n') if !self.line_mode => self.i += 1,
                _ => return Ok(()),
            }
        }
    }

    pub(crate) async fn expect(&mut self, ch: u8, what: &'static str) -> Result<(), ScanError> {
        if self.peek().await? == Some(ch) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.err(what))
        }
    }

    /// After a value: `,` → true (another follows), `close` → false.
    pub(crate) async fn comma_or(&mut self, close: u8) -> Result<bool, ScanError> {
        self.ws().await?;
        match self.peek().await? {
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

    /// SSE: skip the rest of the line, through its `\n`.
    pub(crate) async fn skip_line(&mut self) -> Result<(), ScanError> {
        loop {
            if let Some(k) = memchr::memchr(b'\n', self.rest()) {
                self.i += k + 1;
                return Ok(());
            }
            self.i = self.b.len();
            if !self.fill().await? {
                return Ok(());
            }
        }
    }

    /// Skip to the end of the line, which must end (before blanks) with `}` or `]`, and
    /// that end must be within the limit ([`Self::within_limit`]).
    pub(crate) async fn skip_line_ending_in_close(&mut self) -> Result<(), ScanError> {
        let mut last: Option<u8> = None;
        let mut last_end = self.pos();
        loop {
            let (line, done) = match memchr::memchr(b'\n', self.rest()) {
                Some(k) => (self.rest().get(..k).unwrap_or(&[]), Some(k)),
                None => (self.rest(), None),
            };
            if let Some(j) = line
                .iter()
                .rposition(|b| !matches!(b, b' ' | b'\t' | b'\r'))
            {
                last = line.get(j).copied();
                last_end = self.pos() + j + 1;
            }
            match done {
                Some(k) => {
                    self.i += k + 1;
                    break;
                }
                None => {
                    self.i = self.b.len();
                    if !self.fill().await? {
                        break;
                    }
                }
            }
        }
        if matches!(last, Some(b'}' | b']')) {
            self.within_limit(last_end)
        } else {
            Err(self.err("the end of the event after its JSON value"))
        }
    }

    /// Consume blanks (space, tab, CR) through the end of the line; an error at anything
    /// else (trailing data after an SSE event's JSON value).
    pub(crate) async fn end_of_line(&mut self) -> Result<(), ScanError> {
        loop {
            match self
                .rest()
                .iter()
                .position(|b| !matches!(b, b' ' | b'\t' | b'\r'))
            {
                Some(k) => {
                    self.i += k;
                    if self.rest().first() == Some(&b'\n') {
                        self.i += 1;
                        return Ok(());
                    }
                    return Err(self.err("the end of the event after its JSON value"));
                }
                None => {
                    self.i = self.b.len();
                    if !self.fill().await? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// An object key and its colon.
    pub(crate) async fn key(&mut self) -> Result<String, ScanError> {
        self.ws().await?;
        let k = self.string().await?;
        self.ws().await?;
        self.expect(b':', "':'").await?;
        Ok(k)
    }

    /// Length (through the closing quote) of the string starting at `self.i` (which is
    /// `"`), refilling as needed, and whether it has escapes.
    pub(crate) async fn string_len(&mut self) -> Result<(usize, bool), ScanError> {
        let mut j = 1usize;
        let mut escaped = false;
        let stop = if self.line_mode { b'\n' } else { b'"' };
        loop {
            let found = self
                .b
                .get(self.i + j..)
                .and_then(|rest| memchr::memchr3(b'"', b'\\', stop, rest));
            match found {
                None => {
                    j = self.avail().max(1);
                    if !self.fill().await? {
                        return Err(self.err("a closing quote"));
                    }
                }
                Some(k) => {
                    j += k;
                    match self.b.get(self.i + j) {
                        Some(b'\\') => {
                            escaped = true;
                            j += 2;
                            if self.avail() < j {
                                self.fill_to(j).await?;
                            }
                        }
                        Some(b'"') => return Ok((j + 1, escaped)),
                        _ => return Err(self.err("a closing quote")),
                    }
                }
            }
        }
    }

    pub(crate) async fn string(&mut self) -> Result<String, ScanError> {
        if self.peek().await? != Some(b'"') {
            return Err(self.err("a string"));
        }
        let (len, escaped) = self.string_len().await?;
        let raw = self
            .b
            .get(self.i..self.i + len)
            .ok_or_else(|| self.err("a string"))?;
        let out = if escaped {
            serde_json::from_slice::<String>(raw).map_err(|_| self.err("a valid string"))?
        } else {
            let inner = raw.get(1..len - 1).ok_or_else(|| self.err("a string"))?;
            std::str::from_utf8(inner)
                .map_err(|_| self.err("UTF-8 text"))?
                .to_owned()
        };
        self.i += len;
        Ok(out)
    }

    pub(crate) async fn opt_string(&mut self) -> Result<Option<String>, ScanError> {
        self.ws().await?;
        if self.peek().await? == Some(b'"') {
            Ok(Some(self.string().await?))
        } else {
            self.skip_value().await?;
            Ok(None)
        }
    }

    pub(crate) async fn opt_u64(&mut self) -> Result<Option<u64>, ScanError> {
        self.ws().await?;
        self.fill_to(MAX_NUMBER).await?;
        let rest = self.rest();
        let digits = rest
            .iter()
            .take(MAX_NUMBER)
            .take_while(|d| d.is_ascii_digit())
            .count();
        // The window holds MAX_NUMBER bytes (or the rest of the input): a run of digits that
        // fills them is refused whatever follows, so the answer never depends on how the
        // bytes arrived (`hidden_rows`/`scan_reply` fuzz targets: zero-padded integers).
        if digits == MAX_NUMBER {
            return Err(self.err("an integer of fewer than 64 digits"));
        }
        if digits > 0 {
            let mut v: u64 = 0;
            for d in rest.iter().take(digits) {
                v = v
                    .checked_mul(10)
                    .and_then(|x| x.checked_add(u64::from(d - b'0')))
                    .ok_or_else(|| self.err("an integer"))?;
            }
            // An integer written as a float (e.g. 3.0) or a larger number: skip the rest.
            let float = matches!(rest.get(digits), Some(b'.' | b'e' | b'E'));
            if float {
                self.skip_value().await?;
            } else {
                self.i += digits;
            }
            return Ok(Some(v));
        }
        self.skip_value().await?;
        Ok(None)
    }

    /// Number of values in an array (skipping them).
    pub(crate) async fn count_array(&mut self) -> Result<usize, ScanError> {
        self.ws().await?;
        if self.peek().await? != Some(b'[') {
            self.skip_value().await?;
            return Ok(0);
        }
        self.i += 1;
        self.ws().await?;
        if self.peek().await? == Some(b']') {
            self.i += 1;
            return Ok(0);
        }
        let mut n = 0;
        loop {
            // Fast path for a compact list of integers (output_ids, as orjson writes
            // it): count the commas up to the closing bracket. Anything else (spaces,
            // floats, nesting, a bad list) takes the general path.
            if let Some(k) = memchr::memchr(b']', self.rest()) {
                let run = self.rest().get(..k).unwrap_or(&[]);
                let plain = run.first().is_some_and(u8::is_ascii_digit)
                    && run.last().is_some_and(u8::is_ascii_digit)
                    && run.iter().all(|x| x.is_ascii_digit() || *x == b',')
                    && memchr::memmem::find(run, b",,").is_none();
                if plain {
                    n += 1 + run.iter().filter(|&&x| x == b',').count();
                    self.i += k + 1;
                    return Ok(n);
                }
            }
            self.skip_value().await?;
            n += 1;
            if !self.comma_or(b']').await? {
                return Ok(n);
            }
        }
    }

    /// Floats of a 1-D list whose `[` was consumed, through its `]`, as bf16 bits.
    pub(crate) async fn floats_into(&mut self, out: &mut Vec<u16>) -> Result<(), ScanError> {
        self.ws().await?;
        if self.peek().await? == Some(b']') {
            self.i += 1;
            return Ok(());
        }
        loop {
            if self.avail() < LOOKAHEAD && !self.eof {
                self.fill_to(LOOKAHEAD).await?;
            }
            // Fast path: a plain loop over the buffered window, as orjson writes rows.
            match floats_fast(&self.b, &mut self.i, out) {
                Fast::RowEnd => return Ok(()),
                Fast::NeedMore if !self.eof => continue,
                Fast::Bad(at) => return Err(self.bad_number(at)),
                Fast::AfterNumber => {
                    if !self.comma_or(b']').await? {
                        return Ok(());
                    }
                    continue;
                }
                Fast::NeedMore | Fast::NotANumber => {}
            }
            // Careful path, one value: whitespace, or the last bytes of the input.
            let rest = self.rest();
            // JSON numbers only: fast-float2 would also accept "inf"/"nan".
            if !matches!(rest.first(), Some(b'-' | b'0'..=b'9')) {
                self.ws().await?;
                match self.peek().await? {
                    Some(b'-' | b'0'..=b'9') => continue,
                    // Cut short (the end of the input, or of an SSE event's line).
                    None | Some(b'\n') => return Err(self.err("a number; the reply ends here")),
                    Some(_) => return Err(ScanError::BadHidden { at: self.pos() }),
                }
            }
            // Decimal → float64 → float32, exactly as the reference reads a row (Python's
            // json gives float64, numpy casts to float32); every bf16/f32 value sglang
            // prints round-trips exactly. The float64 parse also takes fast-float's exact
            // fast path (Clinger) for most of the ≤ 17-digit decimals orjson writes.
            let (v, n) =
                fast_float2::parse_partial::<f64, _>(rest).map_err(|_| self.bad_number(self.i))?;
            let v = v as f32;
            // A number of MAX_NUMBER bytes or more is longer than any float orjson writes
            // (and may run past the window): refuse it rather than parse a prefix.
            if !v.is_finite() || n == 0 || n >= MAX_NUMBER {
                return Err(self.bad_number(self.i));
            }
            out.push(f32_to_bf16_bits(v));
            self.i += n;
            match self.b.get(self.i) {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(());
                }
                _ => {
                    if !self.comma_or(b']').await? {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// The error for a bad hidden value at window offset `at`: [`ScanError::Malformed`]
    /// when its text (shorter than [`MAX_NUMBER`]) runs into the end of the input or of an
    /// SSE line (a reply cut short), else [`ScanError::BadHidden`]. It looks at most
    /// [`LOOKAHEAD`] bytes, which the window holds (or the input ends), so the answer does
    /// not depend on how the bytes arrived.
    pub(crate) fn bad_number(&self, at: usize) -> ScanError {
        let run = self.b.get(at..).unwrap_or(&[]);
        let len = run
            .iter()
            .take(MAX_NUMBER)
            .take_while(|x| matches!(x, b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'))
            .count();
        if len < MAX_NUMBER && matches!(run.get(len), None | Some(b'\n')) {
            ScanError::Malformed {
                at: self.base + at,
                what: "a number; the reply ends here",
            }
        } else {
            ScanError::BadHidden { at: self.base + at }
        }
    }

    /// Skip one JSON value of any kind, in linear time.
    pub(crate) async fn skip_value(&mut self) -> Result<(), ScanError> {
        self.ws().await?;
        match self.peek().await? {
            Some(b'"') => {
                let (len, _) = self.string_len().await?;
                self.i += len;
                Ok(())
            }
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                loop {
                    match self.peek().await? {
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
                            let (len, _) = self.string_len().await?;
                            self.i += len;
                        }
                        Some(b'\n') if self.line_mode => return Err(self.err("a closing bracket")),
                        Some(_) => {
                            // Run over plain bytes up to the next structural one.
                            let run = self
                                .rest()
                                .iter()
                                .position(|x| matches!(x, b'{' | b'[' | b'}' | b']' | b'"' | b'\n'))
                                .unwrap_or(self.avail());
                            self.i += run.max(1);
                        }
                        None => return Err(self.err("a closing bracket")),
                    }
                }
            }
            Some(b't') => self.literal(b"true").await,
            Some(b'f') => self.literal(b"false").await,
            Some(b'n') => self.literal(b"null").await,
            Some(b'-' | b'0'..=b'9') => {
                while let Some(b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9') = self.peek().await?
                {
                    self.i += 1;
                }
                Ok(())
            }
            _ => Err(self.err("a value")),
        }
    }

    pub(crate) async fn literal(&mut self, lit: &'static [u8]) -> Result<(), ScanError> {
        self.fill_to(lit.len()).await?;
        if self.rest().starts_with(lit) {
            self.i += lit.len();
            Ok(())
        } else {
            Err(self.err("a literal"))
        }
    }
}
