//! The byte ranges of a JSON object's top-level members, so that the service digests the
//! commitment exactly as the report carried it (specs/CELLS.md §5: `commitment_digest` is
//! the SHA-256 of the value's bytes, not of a re-serialisation).
//!
//! Run only on bytes `serde_json` already parsed: the scan trusts the text to be valid JSON
//! and only finds where each member's value starts and ends.
use std::ops::Range;

/// Why the members could not be listed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RawError {
    /// The text is not a JSON object.
    #[error("the report is not a JSON object")]
    NotAnObject,
    /// A member name appears twice (which value counts would depend on the reader).
    #[error("the member {0:?} appears twice")]
    Duplicate(String),
}

/// Each top-level member's (decoded name, byte range of its value) in `text`, a valid JSON
/// object.
///
/// # Errors
/// [`RawError`].
pub fn members(text: &[u8]) -> Result<Vec<(String, Range<usize>)>, RawError> {
    let mut i = skip_ws(text, 0);
    if text.get(i) != Some(&b'{') {
        return Err(RawError::NotAnObject);
    }
    i += 1;
    let mut out: Vec<(String, Range<usize>)> = Vec::new();
    loop {
        i = skip_ws(text, i);
        match text.get(i) {
            Some(b'}') | None => break,
            Some(b',') => {
                i += 1;
                continue;
            }
            _ => {}
        }
        let key_start = i;
        i = skip_string(text, i);
        let name: String =
            serde_json::from_slice(&text[key_start..i]).map_err(|_| RawError::NotAnObject)?;
        i = skip_ws(text, i);
        if text.get(i) != Some(&b':') {
            return Err(RawError::NotAnObject);
        }
        i = skip_ws(text, i + 1);
        let start = i;
        i = skip_value(text, i);
        if out.iter().any(|(n, _)| *n == name) {
            return Err(RawError::Duplicate(name));
        }
        out.push((name, start..i));
    }
    Ok(out)
}

fn skip_ws(t: &[u8], mut i: usize) -> usize {
    while matches!(t.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `t[i]` is `"`; returns the index after the closing quote.
fn skip_string(t: &[u8], mut i: usize) -> usize {
    i += 1;
    while let Some(&c) = t.get(i) {
        match c {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// Returns the index after the value starting at `t[i]`.
fn skip_value(t: &[u8], mut i: usize) -> usize {
    match t.get(i) {
        Some(b'"') => skip_string(t, i),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            while let Some(&c) = t.get(i) {
                match c {
                    b'"' => {
                        i = skip_string(t, i);
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return i + 1;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            i
        }
        _ => {
            while let Some(&c) = t.get(i) {
                if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                i += 1;
            }
            i
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_each_value_as_written() {
        let t = br#" { "a" : [1, "x]}", {"b": "\"}"}] , "commit\u006dent":{"k": 1.5e3 },"z":null}"#;
        let m = members(t).unwrap();
        let get = |n: &str| {
            let r = m.iter().find(|(k, _)| k == n).unwrap().1.clone();
            std::str::from_utf8(&t[r]).unwrap().to_owned()
        };
        assert_eq!(get("a"), r#"[1, "x]}", {"b": "\"}"}]"#);
        assert_eq!(get("commitment"), r#"{"k": 1.5e3 }"#);
        assert_eq!(get("z"), "null");
    }

    #[test]
    fn a_member_given_twice_is_refused() {
        assert_eq!(
            members(br#"{"commitment": {}, "commitment": {"x": 1}}"#),
            Err(RawError::Duplicate("commitment".into()))
        );
        assert_eq!(members(b"[1]"), Err(RawError::NotAnObject));
    }
}
