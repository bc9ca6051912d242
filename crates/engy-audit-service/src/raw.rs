//! The byte ranges of a JSON object's top-level members, so that the service digests the
//! commitment exactly as the report carried it (specs/CELLS.md §5: `commitment_digest` is
//! the SHA-256 of the value's bytes, not of a re-serialisation).
//!
//! serde_json's parser finds the values: each is read as a borrowed
//! [`RawValue`](serde_json::value::RawValue), a slice of the input itself (`raw_value` feature),
//! so its range is where that slice lies in the text.
use std::ops::Range;

use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

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

/// A JSON object's members in the order written, names decoded, values as the text's slices.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Each;
        impl<'de> Visitor<'de> for Each {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut out = Vec::new();
                while let Some(member) = map.next_entry::<String, &'de RawValue>()? {
                    out.push(member);
                }
                Ok(Members(out))
            }
        }
        d.deserialize_map(Each)
    }
}

/// Each top-level member's (decoded name, byte range of its value, without the whitespace
/// around it) in `text`, a JSON object.
///
/// # Errors
/// [`RawError`].
pub fn members(text: &[u8]) -> Result<Vec<(String, Range<usize>)>, RawError> {
    let Members(read) = serde_json::from_slice(text).map_err(|_| RawError::NotAnObject)?;
    let base = text.as_ptr() as usize;
    let mut out: Vec<(String, Range<usize>)> = Vec::with_capacity(read.len());
    for (name, value) in read {
        if out.iter().any(|(n, _)| *n == name) {
            return Err(RawError::Duplicate(name));
        }
        // The value borrows from `text`, so its start lies inside it.
        let start = (value.get().as_ptr() as usize)
            .checked_sub(base)
            .filter(|s| s + value.get().len() <= text.len())
            .ok_or(RawError::NotAnObject)?;
        out.push((name, start..start + value.get().len()));
    }
    Ok(out)
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

    /// The digest is over the commitment's bytes as sent (number spelling, escapes, spacing
    /// and member order kept), which a re-serialisation of the parsed value would change.
    #[test]
    fn the_commitment_digest_is_over_the_bytes_as_sent() {
        use sha2::{Digest, Sha256};
        let sent = r#"{"b": 2,  "a":1.50E3,"s":"\u0041\/", "v": [ 1 ,2 ]}"#;
        let body = format!("{{\n  \"request_id\": \"r\",\n  \"commitment\" :  {sent}  \n}}");
        let m = members(body.as_bytes()).unwrap();
        let r = m.iter().find(|(k, _)| k == "commitment").unwrap().1.clone();
        assert_eq!(&body.as_bytes()[r.clone()], sent.as_bytes());
        let reserialised =
            serde_json::to_vec(&serde_json::from_str::<serde_json::Value>(sent).unwrap()).unwrap();
        assert_ne!(reserialised, sent.as_bytes());
        assert_eq!(
            Sha256::digest(&body.as_bytes()[r]),
            Sha256::digest(sent.as_bytes())
        );
        assert_ne!(
            Sha256::digest(&reserialised),
            Sha256::digest(sent.as_bytes())
        );
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
