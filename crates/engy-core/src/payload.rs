//! The master-signed epoch payload served at `GET {API}/api/subnet/v1/epoch/latest` and its
//! verification (PROTOCOL.md §6; order of checks from `tests/vectors/payloads/README.md`).
//!
//! ```text
//! { "v": 1, "netuid": 53, "epoch_index": <int>, "digest": "<hex sha256>",
//!   "result_json": "<string: the exact signed bytes>", "signature": "<hex, 64 bytes>",
//!   "weights": [...display only...], "signed_hotkey": "...display only..." }
//! ```
//!
//! [`verify`] is pure: no clock, no epoch input, no I/O. It takes the exact HTTP body bytes
//! and returns the weights from the verified `result_json` only, never the top-level
//! `weights`. Where the Python reference is lenient (bools/floats as integers, duplicate
//! keys, NaN, BOM/UTF-16 bodies, whitespace in the signature hex, unbounded ints) this
//! implementation follows the project's `strict_expected` policy and rejects; see
//! [`verify`] for the exact rules.

mod json;

use sha2::{Digest, Sha256};

use crate::keys::{ss58_decode, verify_signature, Hotkey};
use json::{JStr, Json};

/// The pinned master hotkey that signs epoch payloads (protocol constant, §6;
/// `DEFAULT_MASTER_HOTKEY` in the reference `validator/validator.py`). Overridable only
/// together with the API (`ENGY_SN53_API`, `ENGY_SN53_MASTER_HOTKEY`).
pub const DEFAULT_MASTER_HOTKEY: &str = "5DXSBCCKH5ENuyHFNaAvtaMfbhEEWpjSJB4rzc4mJfsc1uvJ";

/// The provider API base URL (protocol constant, §6).
pub const DEFAULT_API: &str = "https://provider.engy.ai";

/// Path of the latest epoch payload under the API base (§6).
pub const EPOCH_LATEST_PATH: &str = "/api/subnet/v1/epoch/latest";

/// The subnet this payload format belongs to (SN53).
pub const DEFAULT_NETUID: u16 = 53;

/// The only payload version (`"v": 1`).
pub const PAYLOAD_VERSION: u64 = 1;

/// Largest response body a fetcher may accept (1 MiB, by Content-Length and while streaming, §6).
/// Enforced by the fetcher, not by [`verify`].
pub const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

/// Largest weight value (u16, §6 step 4).
pub const MAX_WEIGHT: u64 = 65535;

/// The reason word of a rejected payload (§6). Logged and compared verbatim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// Not an object, bad `result_json`, mismatched epoch/netuid inside it, bad weights,
    /// non-integer epoch index, duplicate keys, NaN/Infinity, unpaired surrogates.
    Malformed,
    /// `v` is not the integer 1.
    Version,
    /// Top-level `netuid` is not the configured netuid (as an integer).
    Netuid,
    /// `sha256(result_json)` (lowercase hex) differs from `digest`.
    Digest,
    /// The signature is missing, not 128 hex characters, not a schnorrkel signature, or does
    /// not verify against the pinned master hotkey (or that hotkey does not decode).
    Signature,
}

impl RejectReason {
    /// The reason word: `malformed`, `version`, `netuid`, `digest` or `signature`.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::Malformed => "malformed",
            RejectReason::Version => "version",
            RejectReason::Netuid => "netuid",
            RejectReason::Digest => "digest",
            RejectReason::Signature => "signature",
        }
    }
}

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a body is not UTF-8 JSON (the vectors' `parse_error` outcome). The validator treats
/// this like a fetch failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not valid UTF-8 (this includes UTF-16 bodies with a BOM).
    #[error("body is not valid UTF-8 (at byte {valid_up_to})")]
    NotUtf8 {
        /// Length of the valid UTF-8 prefix.
        valid_up_to: usize,
    },
    /// Starts with a UTF-8 byte-order mark (Python accepts it; this project does not).
    #[error("body starts with a UTF-8 byte-order mark")]
    Bom,
    /// Not JSON (even for Python's lenient reader).
    #[error("body is not JSON (syntax error at byte {offset})")]
    Syntax {
        /// Byte offset of the error.
        offset: usize,
    },
    /// Nested deeper than the reader allows.
    #[error("body nests arrays/objects deeper than {max}")]
    TooDeep {
        /// The limit.
        max: usize,
    },
}

/// Why [`verify`] did not return a verified epoch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// The body is not UTF-8 JSON: a fetch failure, not a rejection.
    #[error("epoch payload is not UTF-8 JSON: {0}")]
    Parse(#[from] ParseError),
    /// The payload parsed but failed a §6 check.
    #[error("epoch payload rejected ({reason}): {detail}")]
    Rejected {
        /// The reason word.
        reason: RejectReason,
        /// What failed, in words (no secrets; payload data is public).
        detail: String,
    },
}

impl PayloadError {
    /// The reason word for a rejection, or None for a parse error.
    pub fn reason(&self) -> Option<RejectReason> {
        match self {
            PayloadError::Parse(_) => None,
            PayloadError::Rejected { reason, .. } => Some(*reason),
        }
    }

    /// The reason word for logs and metrics, one of the documented words
    /// (docs/VALIDATOR.md): the rejection's reason, or `malformed` for a body that is not
    /// UTF-8 JSON (the vectors call that outcome `parse_error`; to an operator it is a
    /// malformed payload like any other).
    pub fn reason_word(&self) -> &'static str {
        match self {
            PayloadError::Parse(_) => RejectReason::Malformed.as_str(),
            PayloadError::Rejected { reason, .. } => reason.as_str(),
        }
    }
}

fn reject(reason: RejectReason, detail: impl Into<String>) -> PayloadError {
    PayloadError::Rejected {
        reason,
        detail: detail.into(),
    }
}

/// A payload that passed every §6 check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedEpoch {
    /// The configured netuid (equal to the payload's and `result_json`'s).
    pub netuid: u16,
    /// The epoch index (equal at top level and in `result_json`).
    pub epoch_index: u64,
    /// The RECOMPUTED digest: lowercase hex sha256 of `result_json`'s UTF-8 bytes.
    pub digest: String,
    /// `(hotkey SS58 string, weight)` pairs from the verified `result_json`, in order. The
    /// hotkey strings are not validated as SS58 here (the reference does not either).
    pub weights: Vec<(String, u16)>,
    /// The signed `result_json` text, exactly as served.
    pub result_json: String,
}

/// The message the master hotkey signs: `engy-sn53:epoch:v1:<netuid>:<epoch_index>:<digest>` (§6).
pub fn epoch_message(netuid: u16, epoch_index: u64, digest: &str) -> String {
    format!("engy-sn53:epoch:v1:{netuid}:{epoch_index}:{digest}")
}

/// Lowercase hex sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn int_eq(v: Option<&Json>, want: u64) -> bool {
    matches!(v, Some(Json::Int(i)) if i.to_u64() == Some(want))
}

/// Verify an epoch payload body (PROTOCOL.md §6) against the pinned master hotkey and the
/// configured netuid. Checks, first failure wins:
///
/// 0. `body` is UTF-8 without a BOM and one JSON document, else [`PayloadError::Parse`].
/// 1. an object without duplicate keys (anywhere) and without `NaN`/`Infinity`, else `malformed`;
/// 2. `v` is the integer 1 (not `true`, not `1.0`), else `version`;
/// 3. `netuid` is the integer `netuid`, else `netuid`;
/// 4. `result_json` is a string (without unpaired surrogates), else `malformed`;
/// 5. lowercase hex `sha256(result_json UTF-8)` equals `digest` (exact string), else `digest`;
/// 6. `signature` is exactly 128 hex characters (either case, no whitespace) forming a
///    schnorrkel signature that verifies under the master key (SS58, any non-reserved
///    prefix) over `engy-sn53:epoch:v1:<netuid>:<epoch_index as Python prints it>:<recomputed digest>`,
///    else `signature`;
/// 7. `result_json` is a JSON object (no duplicate keys, no NaN); the top-level `epoch_index`
///    is an integer in `0..=u64::MAX` equal to `result_json.epoch_index`;
///    `result_json.netuid` is the integer `netuid`; `weights` is a list of
///    `[string, integer 0..=65535]` pairs (`-0` is 0; booleans and floats are not
///    integers), else `malformed`.
///
/// Step 6 formats a non-integer top-level `epoch_index` the way the Python reference does
/// (`True`, `12.0`, `None`, ...), so a payload signed that way gets past the signature and
/// is then rejected as `malformed` at step 7, as the reference would order it.
pub fn verify(
    body: &[u8],
    master_hotkey_ss58: &str,
    netuid: u16,
) -> Result<VerifiedEpoch, PayloadError> {
    use RejectReason::*;

    // 0. UTF-8 JSON.
    if body.starts_with(&[0xEF, 0xBB, 0xBF]) {
        return Err(ParseError::Bom.into());
    }
    let text = std::str::from_utf8(body).map_err(|e| ParseError::NotUtf8 {
        valid_up_to: e.valid_up_to(),
    })?;
    let parsed = json::parse(text).map_err(|e| match e {
        json::SyntaxError::At(offset) => ParseError::Syntax { offset },
        json::SyntaxError::TooDeep => ParseError::TooDeep {
            max: json::MAX_DEPTH,
        },
    })?;

    // 1. An object, strictly.
    let payload = &parsed.value;
    if !matches!(payload, Json::Object(_)) {
        return Err(reject(Malformed, "payload is not a JSON object"));
    }
    if parsed.duplicate_key {
        return Err(reject(Malformed, "payload has a duplicate object key"));
    }
    if parsed.non_finite {
        return Err(reject(Malformed, "payload uses NaN or Infinity"));
    }

    // 2. Version.
    if !int_eq(payload.get("v"), PAYLOAD_VERSION) {
        return Err(reject(Version, "v is not the integer 1"));
    }

    // 3. Netuid.
    if !int_eq(payload.get("netuid"), u64::from(netuid)) {
        return Err(reject(
            Netuid,
            format!("netuid is not the integer {netuid}"),
        ));
    }

    // 4. result_json is a string.
    let result_json = match payload.get("result_json") {
        Some(Json::Str(JStr::Text(s))) => s.as_str(),
        Some(Json::Str(JStr::Wtf16(_))) => {
            return Err(reject(
                Malformed,
                "result_json contains an unpaired surrogate (not encodable as UTF-8)",
            ))
        }
        _ => return Err(reject(Malformed, "result_json is missing or not a string")),
    };

    // 5. Digest.
    let digest = sha256_hex(result_json.as_bytes());
    match payload.get("digest") {
        Some(Json::Str(JStr::Text(d))) if *d == digest => {}
        _ => {
            return Err(reject(
                Digest,
                format!("digest does not equal sha256(result_json) = {digest}"),
            ))
        }
    }

    // 6. Signature.
    let master = ss58_decode(master_hotkey_ss58)
        .map_err(|e| {
            reject(
                Signature,
                format!("pinned master hotkey does not decode: {e}"),
            )
        })?
        .1;
    let sig_bytes = match payload.get("signature") {
        Some(Json::Str(JStr::Text(s))) if s.len() == 128 => {
            hex::decode(s).map_err(|_| reject(Signature, "signature is not 128 hex characters"))?
        }
        Some(Json::Str(_)) | None => {
            return Err(reject(Signature, "signature is not 128 hex characters"))
        }
        Some(_) => return Err(reject(Signature, "signature is not a string")),
    };
    let epoch_value = payload.get("epoch_index").unwrap_or(&Json::Null);
    let epoch_text = json::python_str(epoch_value).ok_or_else(|| {
        reject(
            Signature,
            "epoch_index cannot be formatted into the signed message",
        )
    })?;
    let message = format!("engy-sn53:epoch:v1:{netuid}:{epoch_text}:{digest}");
    verify_signature(&master, message.as_bytes(), &sig_bytes)
        .map_err(|e| reject(Signature, format!("master signature over {message:?}: {e}")))?;

    // 7. The signed result.
    let epoch_index = match epoch_value {
        Json::Int(i) => i.to_u64(),
        _ => None,
    }
    .ok_or_else(|| reject(Malformed, "epoch_index is not an integer in 0..=2^64-1"))?;
    let result =
        json::parse(result_json).map_err(|_| reject(Malformed, "result_json is not JSON"))?;
    if result.duplicate_key {
        return Err(reject(Malformed, "result_json has a duplicate object key"));
    }
    if result.non_finite {
        return Err(reject(Malformed, "result_json uses NaN or Infinity"));
    }
    let result = result.value;
    if !matches!(result, Json::Object(_)) {
        return Err(reject(Malformed, "result_json is not a JSON object"));
    }
    if !int_eq(result.get("epoch_index"), epoch_index) {
        return Err(reject(
            Malformed,
            format!("result_json.epoch_index is not the integer {epoch_index}"),
        ));
    }
    if !int_eq(result.get("netuid"), u64::from(netuid)) {
        return Err(reject(
            Malformed,
            format!("result_json.netuid is not the integer {netuid}"),
        ));
    }
    let Some(Json::Array(entries)) = result.get("weights") else {
        return Err(reject(
            Malformed,
            "result_json.weights is missing or not a list",
        ));
    };
    let mut weights = Vec::with_capacity(entries.len());
    for (n, entry) in entries.iter().enumerate() {
        let bad = || {
            reject(
                Malformed,
                format!(
                    "result_json.weights[{n}] is not a [hotkey string, integer 0..=65535] pair"
                ),
            )
        };
        let Json::Array(pair) = entry else {
            return Err(bad());
        };
        let [Json::Str(JStr::Text(hotkey)), Json::Int(w)] = pair.as_slice() else {
            return Err(bad());
        };
        let w = w
            .to_u64()
            .filter(|w| *w <= MAX_WEIGHT)
            .and_then(|w| u16::try_from(w).ok())
            .ok_or_else(bad)?;
        weights.push((hotkey.clone(), w));
    }

    Ok(VerifiedEpoch {
        netuid,
        epoch_index,
        digest,
        weights,
        result_json: result_json.to_string(),
    })
}

/// The canonical `result_json` text for a weight vector:
/// `{"epoch_index":E,"netuid":N,"weights":[["<hotkey>",w],...]}` (compact).
pub fn build_result_json(netuid: u16, epoch_index: u64, weights: &[(String, u16)]) -> String {
    let mut s = format!("{{\"epoch_index\":{epoch_index},\"netuid\":{netuid},\"weights\":[");
    for (n, (hk, w)) in weights.iter().enumerate() {
        if n > 0 {
            s.push(',');
        }
        s.push('[');
        s.push_str(&json_string(hk));
        s.push(',');
        s.push_str(&w.to_string());
        s.push(']');
    }
    s.push_str("]}");
    s
}

fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| String::from("\"\""))
}

/// Sign `result_json` as the master would and return the full HTTP body (§6 shape, compact).
///
/// `digest` is sha256(result_json), the signature covers
/// [`epoch_message`]`(netuid, epoch_index, digest)`, `weights` (display only) repeats the
/// weights of `result_json` when it parses as such (else `[]`), and `signed_hotkey` is the
/// signer's SS58. Used by the provider double and tests.
pub fn sign_payload(master: &Hotkey, netuid: u16, epoch_index: u64, result_json: &str) -> String {
    let digest = sha256_hex(result_json.as_bytes());
    let sig = master.sign(epoch_message(netuid, epoch_index, &digest).as_bytes());
    let display = display_weights(result_json);
    format!(
        "{{\"v\":{PAYLOAD_VERSION},\"netuid\":{netuid},\"epoch_index\":{epoch_index},\"digest\":\"{digest}\",\"result_json\":{},\"signature\":\"{}\",\"weights\":{display},\"signed_hotkey\":{}}}",
        json_string(result_json),
        hex::encode(sig),
        json_string(&master.ss58()),
    )
}

fn display_weights(result_json: &str) -> String {
    let Ok(parsed) = json::parse(result_json) else {
        return "[]".to_string();
    };
    let Some(Json::Array(entries)) = parsed.value.get("weights") else {
        return "[]".to_string();
    };
    let mut out = Vec::new();
    for e in entries {
        if let Json::Array(pair) = e {
            if let [Json::Str(JStr::Text(hk)), Json::Int(w)] = pair.as_slice() {
                out.push(format!("[{},{}]", json_string(hk), w.python_str()));
                continue;
            }
        }
        return "[]".to_string();
    }
    format!("[{}]", out.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_then_verify_round_trip() {
        let master = Hotkey::from_mini_secret(&[9u8; 32]).unwrap();
        let weights = vec![("5abc".to_string(), 65535u16), ("x\"y".to_string(), 0)];
        let rj = build_result_json(53, 77, &weights);
        let body = sign_payload(&master, 53, 77, &rj);
        let v = verify(body.as_bytes(), &master.ss58(), 53).unwrap();
        assert_eq!(v.epoch_index, 77);
        assert_eq!(v.weights, weights);
        assert_eq!(v.digest, sha256_hex(rj.as_bytes()));
        // Another key, another netuid.
        let other = Hotkey::from_mini_secret(&[8u8; 32]).unwrap();
        let e = verify(body.as_bytes(), &other.ss58(), 53).unwrap_err();
        assert_eq!(e.reason(), Some(RejectReason::Signature));
        let e = verify(body.as_bytes(), &master.ss58(), 54).unwrap_err();
        assert_eq!(e.reason(), Some(RejectReason::Netuid));
    }

    #[test]
    fn hostile_epoch_index_shapes_are_rejected_not_hung() {
        let master = Hotkey::from_mini_secret(&[9u8; 32]).unwrap();
        let rj = build_result_json(53, 1, &[]);
        let digest = sha256_hex(rj.as_bytes());
        let members: Vec<String> = (0..50_000).map(|i| format!("\"k{i}\":{i}")).collect();
        let nested = format!("{}1{}", "[".repeat(120), "]".repeat(120));
        for epoch in [format!("{{{}}}", members.join(",")), nested] {
            let body = format!(
                "{{\"v\":1,\"netuid\":53,\"epoch_index\":{epoch},\"digest\":\"{digest}\",\"result_json\":{},\"signature\":\"{}\"}}",
                serde_json::to_string(&rj).unwrap(),
                hex::encode(master.sign(b"x"))
            );
            let e = verify(body.as_bytes(), &master.ss58(), 53).unwrap_err();
            assert_eq!(e.reason(), Some(RejectReason::Signature));
        }
    }
}
