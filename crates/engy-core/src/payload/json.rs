//! A small JSON reader that keeps what the epoch-payload checks need and serde_json drops.
//!
//! Why not `serde_json::Value`: the §6 checks (and the golden vectors' `strict_expected`)
//! need (a) duplicate object keys detected, not silently "last wins"; (b) integers kept as
//! written, so `2**64`, `-0` and `1.0` are told apart and the top-level `epoch_index` can be
//! formatted exactly as Python's `f"{x}"` would; (c) `\ud800` (an unpaired surrogate) kept as
//! a value instead of failing the whole parse; (d) Python's non-standard `NaN`, `Infinity`,
//! `-Infinity` tokens recognised (Python's `json` accepts them), so a body using them is a
//! `malformed` payload rather than a parse error. The grammar is RFC 8259 / Python's `json`
//! module with `strict=True` (no control characters inside strings).
//!
//! Nesting is capped at [`MAX_DEPTH`] so hostile input cannot exhaust the stack.

/// Deepest nesting of arrays/objects accepted: serde_json's default limit. (Python's
/// reader stops near its recursion limit, ~1000, with a `RecursionError`.) A real payload
/// nests 3 deep; the cap keeps the recursive reader and formatter well inside a 2 MiB stack
/// even in unoptimised builds.
pub(crate) const MAX_DEPTH: usize = 128;

/// A JSON string: valid Unicode text, or UTF-16 code units holding an unpaired surrogate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum JStr {
    Text(String),
    /// Contains at least one unpaired surrogate (from a `\uD800`-style escape).
    Wtf16(Vec<u16>),
}

impl JStr {
    pub(crate) fn as_text(&self) -> Option<&str> {
        match self {
            JStr::Text(s) => Some(s),
            JStr::Wtf16(_) => None,
        }
    }
}

/// A JSON integer as written: sign and decimal digits (no leading zeros, per the grammar).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JInt {
    pub(crate) negative: bool,
    pub(crate) digits: String,
}

impl JInt {
    fn is_zero(&self) -> bool {
        self.digits == "0"
    }
    /// The value as u64 when it is a non-negative integer (or `-0`) that fits.
    pub(crate) fn to_u64(&self) -> Option<u64> {
        if self.negative && !self.is_zero() {
            return None;
        }
        self.digits.parse::<u64>().ok()
    }
    /// Python's `str(int)`: `-0` prints as `0`.
    pub(crate) fn python_str(&self) -> String {
        if self.negative && !self.is_zero() {
            format!("-{}", self.digits)
        } else {
            self.digits.clone()
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    Int(JInt),
    /// A number with a fraction or exponent, or Python's NaN/Infinity tokens.
    Float(f64),
    Str(JStr),
    Array(Vec<Json>),
    /// Members in document order, duplicates kept (see [`Parsed::duplicate_key`]).
    Object(Vec<(JStr, Json)>),
}

impl Json {
    /// The LAST value for `key` (Python dict semantics), or None.
    pub(crate) fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members
                .iter()
                .rev()
                .find(|(k, _)| k.as_text() == Some(key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// A parse result with the leniencies Python accepts but this project does not.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) value: Json,
    /// Some object had the same key twice.
    pub(crate) duplicate_key: bool,
    /// `NaN`, `Infinity` or `-Infinity` appeared.
    pub(crate) non_finite: bool,
}

/// Why text is not JSON even for Python's lenient reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SyntaxError {
    At(usize),
    TooDeep,
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    duplicate_key: bool,
    non_finite: bool,
}

/// Parse `text` as one JSON document (surrounding JSON whitespace allowed).
pub(crate) fn parse(text: &str) -> Result<Parsed, SyntaxError> {
    let mut p = Parser {
        s: text.as_bytes(),
        i: 0,
        duplicate_key: false,
        non_finite: false,
    };
    p.ws();
    let value = p.value(0)?;
    p.ws();
    if p.i != p.s.len() {
        return Err(SyntaxError::At(p.i));
    }
    Ok(Parsed {
        value,
        duplicate_key: p.duplicate_key,
        non_finite: p.non_finite,
    })
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn err<T>(&self) -> Result<T, SyntaxError> {
        Err(SyntaxError::At(self.i))
    }
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }
    fn eat_lit(&mut self, lit: &[u8]) -> bool {
        if self.s.get(self.i..self.i + lit.len()) == Some(lit) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, SyntaxError> {
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b'n') if self.eat_lit(b"null") => Ok(Json::Null),
            Some(b't') if self.eat_lit(b"true") => Ok(Json::Bool(true)),
            Some(b'f') if self.eat_lit(b"false") => Ok(Json::Bool(false)),
            Some(b'N') if self.eat_lit(b"NaN") => {
                self.non_finite = true;
                Ok(Json::Float(f64::NAN))
            }
            Some(b'I') if self.eat_lit(b"Infinity") => {
                self.non_finite = true;
                Ok(Json::Float(f64::INFINITY))
            }
            Some(b'-') if self.eat_lit(b"-Infinity") => {
                self.non_finite = true;
                Ok(Json::Float(f64::NEG_INFINITY))
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            _ => self.err(),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Json, SyntaxError> {
        if depth > MAX_DEPTH {
            return Err(SyntaxError::TooDeep);
        }
        self.i += 1; // '{'
        let mut members: Vec<(JStr, Json)> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        self.ws();
        if self.peek() == Some(b'}') {
            self.i += 1;
            return Ok(Json::Object(members));
        }
        loop {
            self.ws();
            if self.peek() != Some(b'"') {
                return self.err();
            }
            let key = self.string()?;
            self.ws();
            if self.peek() != Some(b':') {
                return self.err();
            }
            self.i += 1;
            self.ws();
            let v = self.value(depth)?;
            if !seen.insert(key.clone()) {
                self.duplicate_key = true;
            }
            members.push((key, v));
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b'}') => {
                    self.i += 1;
                    return Ok(Json::Object(members));
                }
                _ => return self.err(),
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Json, SyntaxError> {
        if depth > MAX_DEPTH {
            return Err(SyntaxError::TooDeep);
        }
        self.i += 1; // '['
        let mut items = Vec::new();
        self.ws();
        if self.peek() == Some(b']') {
            self.i += 1;
            return Ok(Json::Array(items));
        }
        loop {
            self.ws();
            items.push(self.value(depth)?);
            self.ws();
            match self.peek() {
                Some(b',') => self.i += 1,
                Some(b']') => {
                    self.i += 1;
                    return Ok(Json::Array(items));
                }
                _ => return self.err(),
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.i += 1;
        }
        self.i - start
    }

    fn number(&mut self) -> Result<Json, SyntaxError> {
        let start = self.i;
        let negative = self.peek() == Some(b'-');
        if negative {
            self.i += 1;
        }
        let int_start = self.i;
        match self.peek() {
            Some(b'0') => self.i += 1,
            Some(b'1'..=b'9') => {
                self.digits();
            }
            _ => return self.err(),
        }
        let int_end = self.i;
        let mut is_float = false;
        // Python's number regex: the fraction/exponent only count when complete; otherwise
        // the number ends before them and the leftover is a syntax error further on.
        if self.peek() == Some(b'.') && matches!(self.s.get(self.i + 1), Some(b'0'..=b'9')) {
            self.i += 1;
            self.digits();
            is_float = true;
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            let save = self.i;
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if self.digits() == 0 {
                self.i = save;
            } else {
                is_float = true;
            }
        }
        let text = std::str::from_utf8(self.s.get(start..self.i).unwrap_or_default())
            .map_err(|_| SyntaxError::At(start))?;
        if is_float {
            let f: f64 = text.parse().map_err(|_| SyntaxError::At(start))?;
            Ok(Json::Float(f))
        } else {
            let digits = std::str::from_utf8(self.s.get(int_start..int_end).unwrap_or_default())
                .map_err(|_| SyntaxError::At(start))?
                .to_string();
            Ok(Json::Int(JInt { negative, digits }))
        }
    }

    fn hex4(&mut self) -> Result<u16, SyntaxError> {
        let h = self
            .s
            .get(self.i..self.i + 4)
            .ok_or(SyntaxError::At(self.i))?;
        let mut v: u16 = 0;
        for &c in h {
            let d = match c {
                b'0'..=b'9' => c - b'0',
                b'a'..=b'f' => c - b'a' + 10,
                b'A'..=b'F' => c - b'A' + 10,
                _ => return self.err(),
            };
            v = (v << 4) | u16::from(d);
        }
        self.i += 4;
        Ok(v)
    }

    fn string(&mut self) -> Result<JStr, SyntaxError> {
        self.i += 1; // opening quote
        let mut units: Vec<u16> = Vec::new();
        loop {
            // Copy a run of plain bytes at once.
            let run_start = self.i;
            while let Some(c) = self.peek() {
                if c == b'"' || c == b'\\' || c < 0x20 {
                    break;
                }
                self.i += 1;
            }
            if self.i > run_start {
                let run = std::str::from_utf8(self.s.get(run_start..self.i).unwrap_or_default())
                    .map_err(|_| SyntaxError::At(run_start))?;
                units.extend(run.encode_utf16());
            }
            match self.peek() {
                Some(b'"') => {
                    self.i += 1;
                    break;
                }
                Some(b'\\') => {
                    self.i += 1;
                    let c = self.peek().ok_or(SyntaxError::At(self.i))?;
                    self.i += 1;
                    match c {
                        b'"' => units.push(u16::from(b'"')),
                        b'\\' => units.push(u16::from(b'\\')),
                        b'/' => units.push(u16::from(b'/')),
                        b'b' => units.push(0x08),
                        b'f' => units.push(0x0c),
                        b'n' => units.push(u16::from(b'\n')),
                        b'r' => units.push(u16::from(b'\r')),
                        b't' => units.push(u16::from(b'\t')),
                        b'u' => {
                            let u = self.hex4()?;
                            units.push(u);
                        }
                        _ => return Err(SyntaxError::At(self.i - 1)),
                    }
                }
                // Control character inside a string, or end of input.
                _ => return self.err(),
            }
        }
        match String::from_utf16(&units) {
            Ok(s) => Ok(JStr::Text(s)),
            Err(_) => Ok(JStr::Wtf16(units)),
        }
    }
}

/// Python's `str(x)` for a parsed JSON value (what `f"{x}"` prints), or None when Python's
/// `.encode()` of the result would fail (an unpaired surrogate).
pub(crate) fn python_str(v: &Json) -> Option<String> {
    match v {
        Json::Str(JStr::Text(s)) => Some(s.clone()),
        Json::Str(JStr::Wtf16(_)) => None,
        other => python_repr(other),
    }
}

/// Python's `repr(x)` for a parsed JSON value (dicts use the last value of a duplicate key
/// at the first key's position, like `json.loads`).
pub(crate) fn python_repr(v: &Json) -> Option<String> {
    Some(match v {
        Json::Null => "None".to_string(),
        Json::Bool(true) => "True".to_string(),
        Json::Bool(false) => "False".to_string(),
        Json::Int(i) => i.python_str(),
        Json::Float(f) => python_float_repr(*f),
        Json::Str(JStr::Text(s)) => python_str_repr(s),
        Json::Str(JStr::Wtf16(_)) => return None,
        Json::Array(items) => {
            let parts: Option<Vec<String>> = items.iter().map(python_repr).collect();
            format!("[{}]", parts?.join(", "))
        }
        Json::Object(members) => {
            // Linear in the member count (hostile input may hold many members).
            let mut order: Vec<(&JStr, &Json)> = Vec::new();
            let mut index: std::collections::HashMap<&JStr, usize> =
                std::collections::HashMap::new();
            for (k, val) in members {
                match index.get(k) {
                    Some(&i) => {
                        if let Some(slot) = order.get_mut(i) {
                            slot.1 = val;
                        }
                    }
                    None => {
                        index.insert(k, order.len());
                        order.push((k, val));
                    }
                }
            }
            let mut parts = Vec::with_capacity(order.len());
            for (k, val) in order {
                let ks = python_repr(&Json::Str(k.clone()))?;
                parts.push(format!("{ks}: {}", python_repr(val)?));
            }
            format!("{{{}}}", parts.join(", "))
        }
    })
}

/// Python's `repr(float)`: shortest round-trip digits; fixed notation when the decimal
/// exponent is in [-4, 16), else `d.ddde+XX`.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mant) = match mant.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mant),
    };
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let sign = if neg { "-" } else { "" };
    // decpt: position of the decimal point relative to the digit string.
    let decpt = exp + 1;
    if (-4 < decpt) && (decpt <= 16) {
        let nd = digits.len() as i32;
        if decpt <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
        } else if decpt >= nd {
            format!("{sign}{digits}{}.0", "0".repeat((decpt - nd) as usize))
        } else {
            let (a, b) = digits.split_at(decpt as usize);
            format!("{sign}{a}.{b}")
        }
    } else {
        let (first, rest) = digits.split_at(1.min(digits.len()));
        let m = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

fn python_printable(c: char) -> bool {
    let u = c as u32;
    if u < 0x20 || u == 0x7f {
        return false;
    }
    if u < 0x7f {
        return true;
    }
    // Approximation of str.isprintable for non-ASCII: not Cc, Zs/Zl/Zp, common Cf, Co.
    !matches!(u,
        0x80..=0xa0 | 0xad | 0x1680 | 0x2000..=0x200f | 0x2028..=0x202f | 0x205f..=0x2064
        | 0x3000 | 0xfeff | 0xe000..=0xf8ff | 0xfff9..=0xfffb)
}

/// Python's `repr(str)`.
pub(crate) fn python_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if python_printable(c) => out.push(c),
            c => {
                let u = c as u32;
                if u <= 0xff {
                    out.push_str(&format!("\\x{u:02x}"));
                } else if u <= 0xffff {
                    out.push_str(&format!("\\u{u:04x}"));
                } else {
                    out.push_str(&format!("\\U{u:08x}"));
                }
            }
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        for (f, want) in [
            (12.0, "12.0"),
            (1e30, "1e+30"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-0.0, "-0.0"),
            (1.5, "1.5"),
            (123.456, "123.456"),
            (1.8446744073709552e19, "1.8446744073709552e+19"),
            (f64::NAN, "nan"),
        ] {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn duplicates_and_surrogates() {
        let p = parse(r#"{"a":1,"b":{"c":"\ud800"},"a":2}"#).unwrap();
        assert!(p.duplicate_key);
        assert_eq!(
            p.value.get("a"),
            Some(&Json::Int(JInt {
                negative: false,
                digits: "2".into()
            }))
        );
        let p = parse(r#""\ud83d\ude00""#).unwrap();
        assert_eq!(p.value, Json::Str(JStr::Text("😀".into())));
    }

    #[test]
    fn rejects_bad_syntax_and_deep_nesting() {
        for bad in [
            "",
            "01",
            "[1,]",
            "{\"a\" 1}",
            "\"\t\"",
            "1.",
            "tru",
            "[1] x",
            "\u{feff}{}",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        let deep = "[".repeat(100_000);
        assert_eq!(parse(&deep).unwrap_err(), SyntaxError::TooDeep);
        // The deepest accepted nesting parses and formats with a quarter of the 2 MiB
        // default thread stack, even unoptimised.
        let t = std::thread::Builder::new()
            .stack_size(512 * 1024)
            .spawn(|| {
                let ok = format!(
                    "{}1{}",
                    "[{\"a\":".repeat(MAX_DEPTH / 2),
                    "}]".repeat(MAX_DEPTH / 2)
                );
                let parsed = parse(&ok).unwrap();
                python_repr(&parsed.value).unwrap().len()
            })
            .unwrap();
        assert!(t.join().unwrap() > MAX_DEPTH);
    }

    #[test]
    fn python_repr_of_containers() {
        let p = parse(r#"[1, "a'b", null, true, {"k": 1.0}]"#).unwrap();
        assert_eq!(
            python_str(&p.value).unwrap(),
            r#"[1, "a'b", None, True, {'k': 1.0}]"#
        );
    }
}
