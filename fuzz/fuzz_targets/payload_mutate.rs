//! Structure-aware fuzzing of epoch payload verification (PROTOCOL.md §6).
//!
//! A fixed master key signs a valid payload; the fuzzer then either
//! * edits the signed body (byte overwrites, insertions, deletions, field replacement,
//!   top-level `weights` forgery) without re-signing: whatever verifies must carry the
//!   ORIGINAL epoch, digest and weights (the signature admits nothing else), or
//! * signs an arbitrary `result_json` genuinely: whatever verifies must agree with an
//!   independent JSON reader (serde_json) on epoch, netuid and every weight.
#![no_main]
use std::sync::OnceLock;

use engy_core::keys::Hotkey;
use engy_core::payload::{build_result_json, sign_payload, verify, VerifiedEpoch};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const NETUID: u16 = 53;
const EPOCH: u64 = 4242;

struct Base {
    master: Hotkey,
    ss58: String,
    body: String,
    ok: VerifiedEpoch,
}

fn base() -> &'static Base {
    static B: OnceLock<Base> = OnceLock::new();
    B.get_or_init(|| {
        let master = Hotkey::from_mini_secret(&[7u8; 32]).unwrap();
        let ss58 = master.ss58();
        let weights = vec![
            (
                "5H8i93MnMEs9KyLA1kgXTNSjTVqaiQqYg2CivRE87DzKygK9".to_owned(),
                40000,
            ),
            (
                "5DSQnz2Ywqp7dfTEuwp1fidL3gAnKJxgkcvTjAitqpc19dHb".to_owned(),
                25535,
            ),
        ];
        let rj = build_result_json(NETUID, EPOCH, &weights);
        let body = sign_payload(&master, NETUID, EPOCH, &rj);
        let ok = verify(body.as_bytes(), &ss58, NETUID).unwrap();
        Base {
            master,
            ss58,
            body,
            ok,
        }
    })
}

/// Whatever verifies from an edited body must be the signed content.
fn same_content(b: &Base, v: &VerifiedEpoch) {
    assert_eq!(v.epoch_index, b.ok.epoch_index, "forged epoch verified");
    assert_eq!(v.digest, b.ok.digest, "forged digest verified");
    assert_eq!(v.weights, b.ok.weights, "forged weights verified");
    assert_eq!(v.result_json, b.ok.result_json);
}

/// An integer as serde_json sees it, with `-0` as 0 (the verifier's rule).
fn as_int(v: &Value) -> Option<u64> {
    let n = v.as_number()?;
    if n.is_f64() {
        return None;
    }
    n.as_u64().or_else(|| (n.as_i64() == Some(0)).then_some(0))
}

fuzz_target!(|data: &[u8]| {
    let b = base();
    let Some((mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 4 {
        // byte edits: (op, position, byte) triples
        0 => {
            let mut body = b.body.as_bytes().to_vec();
            for t in rest.chunks_exact(4) {
                let pos = usize::from(u16::from_le_bytes([t[1], t[2]])) % (body.len() + 1);
                match t[0] % 3 {
                    0 if pos < body.len() => body[pos] = t[3],
                    1 => body.insert(pos, t[3]),
                    _ if pos < body.len() => {
                        body.remove(pos);
                    }
                    _ => {}
                }
            }
            if let Ok(v) = verify(&body, &b.ss58, NETUID) {
                same_content(b, &v);
            }
        }
        // replace (or add) one top-level field with an arbitrary JSON value or string
        1 => {
            let Some((which, text)) = rest.split_first() else {
                return;
            };
            let fields = [
                "v",
                "netuid",
                "epoch_index",
                "digest",
                "result_json",
                "signature",
                "weights",
                "signed_hotkey",
            ];
            let field = fields[usize::from(*which) % fields.len()];
            let text = String::from_utf8_lossy(text);
            let value = serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text.into()));
            let mut obj: serde_json::Map<String, Value> = serde_json::from_str(&b.body).unwrap();
            obj.insert(field.to_owned(), value);
            let body = serde_json::to_vec(&obj).unwrap();
            if let Ok(v) = verify(&body, &b.ss58, NETUID) {
                same_content(b, &v);
            }
        }
        // a genuinely signed arbitrary result_json: agree with serde_json
        2 => {
            let [e0, e1, e2, e3, text @ ..] = rest else {
                return;
            };
            let epoch = u64::from(u32::from_le_bytes([*e0, *e1, *e2, *e3]));
            let rj = String::from_utf8_lossy(text);
            let body = sign_payload(&b.master, NETUID, epoch, &rj);
            if let Ok(v) = verify(body.as_bytes(), &b.ss58, NETUID) {
                assert_eq!(v.epoch_index, epoch);
                // Python's json (the reference) accepts lone surrogates like "\ud800" in
                // strings; the verifier does too where they are not used (a hotkey with one
                // is `malformed`). serde_json refuses them: no comparison for those.
                let doc: Value = match serde_json::from_str(&rj) {
                    Ok(doc) => doc,
                    Err(e) if e.to_string().contains("escape") => return,
                    Err(e) => panic!("verified result_json is not JSON for serde_json: {e}"),
                };
                assert_eq!(doc.get("epoch_index").and_then(as_int), Some(epoch));
                assert_eq!(doc.get("netuid").and_then(as_int), Some(u64::from(NETUID)));
                let ws = doc
                    .get("weights")
                    .and_then(Value::as_array)
                    .expect("weights list");
                assert_eq!(ws.len(), v.weights.len());
                for (w, (hk, x)) in ws.iter().zip(&v.weights) {
                    let pair = w.as_array().expect("pair");
                    assert_eq!(pair.len(), 2);
                    assert_eq!(pair[0].as_str(), Some(hk.as_str()));
                    assert_eq!(as_int(&pair[1]), Some(u64::from(*x)));
                }
            }
        }
        // top-level weights forged to anything: the verified weights never change
        _ => {
            let text = String::from_utf8_lossy(rest);
            let forged = serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text.into()));
            let mut obj: serde_json::Map<String, Value> = serde_json::from_str(&b.body).unwrap();
            obj.insert("weights".to_owned(), forged);
            let body = serde_json::to_vec(&obj).unwrap();
            match verify(&body, &b.ss58, NETUID) {
                Ok(v) => same_content(b, &v),
                // only the reader's nesting cap may refuse a display field
                Err(e) => assert_eq!(e.reason_word(), "parse_error", "{e}"),
            }
        }
    }
});
