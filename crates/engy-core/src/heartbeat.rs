//! The validator → provider heartbeat (PROTOCOL.md §6; `tests/vectors/heartbeat/README.md`).
//!
//! `POST {API}/api/subnet/v1/validator/heartbeat` with a compact JSON body and three signed
//! headers. The signature is by the validator's OWN wallet hotkey (not the master key) over
//! `engy-sn53:api:v1:<netuid>:<METHOD>:<path>:<ts>:<sha256(body) hex>`.

use sha2::{Digest, Sha256};

use crate::keys::{ss58_decode, verify_signature, Hotkey, SignatureError, Ss58Error};

/// Path of the heartbeat endpoint under the API base (§6).
pub const HEARTBEAT_PATH: &str = "/api/subnet/v1/validator/heartbeat";

/// Header carrying the validator's SS58 hotkey (prefix 42).
pub const HEADER_HOTKEY: &str = "X-Validator-Hotkey";
/// Header carrying the unix timestamp in seconds (decimal).
pub const HEADER_TS: &str = "X-Validator-Ts";
/// Header carrying the hex sr25519 signature (128 lowercase hex characters).
pub const HEADER_SIG: &str = "X-Validator-Sig";

/// The canonical message a signed API request covers:
/// `engy-sn53:api:v1:{netuid}:{METHOD}:{path}:{ts}:{sha256(body) lowercase hex}`.
///
/// `method` is upper-cased (Python's `str.upper()`); `path` is used as given, query string
/// included; `ts` is unix seconds; `body` is the exact request body bytes.
pub fn canonical_message(netuid: u16, method: &str, path: &str, ts: u64, body: &[u8]) -> String {
    let body_hash = hex::encode(Sha256::digest(body));
    format!(
        "engy-sn53:api:v1:{netuid}:{}:{path}:{ts}:{body_hash}",
        method.to_uppercase()
    )
}

/// Append `s` as a JSON string the way Python's `json.dumps` does with `ensure_ascii=True`:
/// `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other characters outside `' '..='~'` as
/// `\uXXXX` (lowercase hex; astral characters as a surrogate pair).
fn push_py_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            c => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}

/// The heartbeat body, byte-exact with the reference
/// `json.dumps(build_body(...), separators=(",", ":"))`:
/// `{"v":1,"version":"<version>","synced_epoch":E,"consensus":{"epoch_index":E,"digest":"D"}}`.
///
/// `synced_epoch` is omitted when `None` (0 is included); `consensus` appears only when
/// `synced_epoch` is known AND `digest` is a non-empty string. `version` is the whole
/// version string (e.g. `engy-lv 0.4.4`); non-ASCII is escaped as `\uXXXX`.
pub fn build_body(version: &str, synced_epoch: Option<u64>, digest: Option<&str>) -> String {
    let mut out = String::from("{\"v\":1,\"version\":");
    push_py_json_string(&mut out, version);
    if let Some(epoch) = synced_epoch {
        out.push_str(&format!(",\"synced_epoch\":{epoch}"));
        if let Some(d) = digest.filter(|d| !d.is_empty()) {
            out.push_str(&format!(
                ",\"consensus\":{{\"epoch_index\":{epoch},\"digest\":"
            ));
            push_py_json_string(&mut out, d);
            out.push('}');
        }
    }
    out.push('}');
    out
}

/// The headers of a signed `POST` to `path`: `X-Validator-Hotkey` (SS58, prefix 42),
/// `X-Validator-Ts` (decimal), `X-Validator-Sig` (128 lowercase hex) and
/// `Content-Type: application/json`, in that order.
pub fn signed_headers(
    hotkey: &Hotkey,
    netuid: u16,
    path: &str,
    ts: u64,
    body: &[u8],
) -> Vec<(&'static str, String)> {
    let message = canonical_message(netuid, "POST", path, ts, body);
    let sig = hotkey.sign(message.as_bytes());
    vec![
        (HEADER_HOTKEY, hotkey.ss58()),
        (HEADER_TS, ts.to_string()),
        (HEADER_SIG, hex::encode(sig)),
        ("Content-Type", "application/json".to_string()),
    ]
}

/// Why a signed API request did not verify (provider side / provider double).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignedRequestError {
    /// A required header is absent.
    #[error("missing header {0}")]
    MissingHeader(&'static str),
    /// The hotkey header is not an SS58 address.
    #[error("bad {HEADER_HOTKEY}: {0}")]
    BadHotkey(#[from] Ss58Error),
    /// The timestamp header is not a decimal integer.
    #[error("bad {HEADER_TS}: not a decimal unix timestamp")]
    BadTimestamp,
    /// The signature header is not 128 hex characters.
    #[error("bad {HEADER_SIG}: not 128 hex characters")]
    BadSignatureHex,
    /// The signature does not verify over the canonical message.
    #[error("signature does not verify: {0}")]
    Signature(#[from] SignatureError),
}

/// A verified signed request: who signed and when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedBy {
    /// The signer's public key.
    pub public_key: [u8; 32],
    /// The signer's address as sent.
    pub ss58: String,
    /// The timestamp as sent (freshness is the caller's policy).
    pub ts: u64,
}

/// Verify a signed request's headers (looked up case-insensitively via `header`) against the
/// canonical message for `method`, `path` and `body`. Freshness of `ts` is not checked here.
pub fn verify_signed_request<'a>(
    header: impl Fn(&str) -> Option<&'a str>,
    netuid: u16,
    method: &str,
    path: &str,
    body: &[u8],
) -> Result<SignedBy, SignedRequestError> {
    let hk = header(HEADER_HOTKEY).ok_or(SignedRequestError::MissingHeader(HEADER_HOTKEY))?;
    let ts = header(HEADER_TS).ok_or(SignedRequestError::MissingHeader(HEADER_TS))?;
    let sig = header(HEADER_SIG).ok_or(SignedRequestError::MissingHeader(HEADER_SIG))?;
    let (_, public_key) = ss58_decode(hk)?;
    if ts.is_empty() || !ts.bytes().all(|b| b.is_ascii_digit()) {
        return Err(SignedRequestError::BadTimestamp);
    }
    let ts_num: u64 = ts.parse().map_err(|_| SignedRequestError::BadTimestamp)?;
    // Only the canonical decimal (what a signer formatting an integer produces).
    if ts_num.to_string() != ts {
        return Err(SignedRequestError::BadTimestamp);
    }
    if sig.len() != 128 {
        return Err(SignedRequestError::BadSignatureHex);
    }
    let sig_bytes = hex::decode(sig).map_err(|_| SignedRequestError::BadSignatureHex)?;
    let message = canonical_message(netuid, method, path, ts_num, body);
    verify_signature(&public_key, message.as_bytes(), &sig_bytes)?;
    Ok(SignedBy {
        public_key,
        ss58: hk.to_string(),
        ts: ts_num,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_like_python() {
        let b = build_body("a\"\\\u{7f}\u{1F600}é", Some(1), Some("d"));
        assert_eq!(
            b,
            r#"{"v":1,"version":"a\"\\\u007f\ud83d\ude00\u00e9","synced_epoch":1,"consensus":{"epoch_index":1,"digest":"d"}}"#
        );
    }

    #[test]
    fn signed_headers_verify() {
        let hk = Hotkey::from_mini_secret(&[5u8; 32]).unwrap();
        let body = build_body("engy-lv 0.1.0", Some(3), Some("ab"));
        let hs = signed_headers(&hk, 53, HEARTBEAT_PATH, 1700, body.as_bytes());
        let get = |n: &str| {
            hs.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, v)| v.as_str())
        };
        let by = verify_signed_request(get, 53, "POST", HEARTBEAT_PATH, body.as_bytes()).unwrap();
        assert_eq!(by.public_key, hk.public_key());
        assert!(verify_signed_request(get, 53, "POST", HEARTBEAT_PATH, b"{}").is_err());
    }
}
