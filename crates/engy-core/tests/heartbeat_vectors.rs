//! Conformance: every `heartbeat/*.json` vector file (schema `engy-sn53/heartbeat/v1`):
//! canonical messages and bodies byte for byte, reference-signed requests verify (and verify
//! through `verify_signed_request`), our own signed headers verify, rejections do not.

mod common;

use std::path::PathBuf;

use common::{hex32, json_files, read_json};

use engy_core::heartbeat::{
    build_body, canonical_message, signed_headers, verify_signed_request, HEADER_HOTKEY,
    HEADER_SIG, HEADER_TS,
};
use engy_core::keys::{ss58_decode, verify_signature, Hotkey};
use serde_json::Value;

const SCHEMA: &str = "engy-sn53/heartbeat/v1";

fn docs() -> Vec<(PathBuf, Value)> {
    json_files("heartbeat")
        .into_iter()
        .filter_map(|p| {
            let v = read_json(&p);
            (v.get("schema").and_then(Value::as_str) == Some(SCHEMA)).then_some((p, v))
        })
        .collect()
}

fn u16_of(v: &Value) -> u16 {
    u16::try_from(v.as_u64().expect("integer")).expect("fits u16")
}

#[test]
fn heartbeat_vectors() {
    let mut counts = [0usize; 5];
    for (path, doc) in docs() {
        let signer = &doc["signer"];
        let signer_pk = hex32(signer["public_key_hex"].as_str().unwrap());

        for c in doc["canonical_messages"].as_array().unwrap() {
            let body = hex::decode(c["body_hex"].as_str().unwrap()).unwrap();
            let got = canonical_message(
                u16_of(&c["netuid"]),
                c["method"].as_str().unwrap(),
                c["path"].as_str().unwrap(),
                c["ts"].as_u64().unwrap(),
                &body,
            );
            assert_eq!(
                got,
                c["message"].as_str().unwrap(),
                "{}: {c}",
                path.display()
            );
            counts[0] += 1;
        }

        for b in doc["bodies"].as_array().unwrap() {
            let got = build_body(
                b["version"].as_str().unwrap(),
                b["synced_epoch"].as_u64(),
                b["digest"].as_str(),
            );
            assert_eq!(got, b["body"].as_str().unwrap(), "{}: {b}", path.display());
            counts[1] += 1;
        }

        for r in doc["signed_requests"].as_array().unwrap() {
            let netuid = u16_of(&r["netuid"]);
            let method = r["method"].as_str().unwrap();
            let rpath = r["path"].as_str().unwrap();
            let body = r["body"].as_str().unwrap().as_bytes();
            let ts = r["ts"].as_u64().unwrap();
            let message = canonical_message(netuid, method, rpath, ts, body);
            assert_eq!(message, r["message"].as_str().unwrap());
            let headers = &r["headers"];
            let sig = hex::decode(headers[HEADER_SIG].as_str().unwrap()).unwrap();
            assert_eq!(
                r["verifies"].as_bool(),
                Some(verify_signature(&signer_pk, message.as_bytes(), &sig).is_ok()),
                "{}: {r}",
                path.display()
            );
            let (_, hk_pk) = ss58_decode(headers[HEADER_HOTKEY].as_str().unwrap()).unwrap();
            assert_eq!(hk_pk, signer_pk);
            assert_eq!(headers[HEADER_TS].as_str().unwrap(), ts.to_string());
            // The provider-side check over the same headers.
            let get = |name: &str| {
                headers
                    .as_object()
                    .unwrap()
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(name))
                    .and_then(|(_, v)| v.as_str())
            };
            let by = verify_signed_request(get, netuid, method, rpath, body).unwrap();
            assert_eq!(by.public_key, signer_pk);
            assert!(verify_signed_request(get, netuid, method, rpath, b"tampered").is_err());
            counts[2] += 1;
        }

        // Our own signing with the same key: same header names/values, signature verifies.
        if let Some(seed) = signer["mini_secret_hex"].as_str() {
            let hk = Hotkey::from_mini_secret(&hex::decode(seed).unwrap()).unwrap();
            assert_eq!(hk.public_key(), signer_pk);
            for r in doc["signed_requests"].as_array().unwrap() {
                let netuid = u16_of(&r["netuid"]);
                let body = r["body"].as_str().unwrap().as_bytes();
                let ts = r["ts"].as_u64().unwrap();
                let rpath = r["path"].as_str().unwrap();
                let hs = signed_headers(&hk, netuid, rpath, ts, body);
                let ours: Vec<&str> = hs.iter().map(|(k, _)| *k).collect();
                for name in r["headers"].as_object().unwrap().keys() {
                    assert!(ours.contains(&name.as_str()), "missing header {name}");
                }
                let get = |n: &str| hs.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
                assert_eq!(get(HEADER_HOTKEY), r["headers"][HEADER_HOTKEY].as_str());
                assert_eq!(get(HEADER_TS), r["headers"][HEADER_TS].as_str());
                let sig = get(HEADER_SIG).unwrap();
                assert_eq!(sig.len(), 128);
                assert!(sig
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
                let sig = hex::decode(sig).unwrap();
                let msg = r["message"].as_str().unwrap().as_bytes();
                assert!(verify_signature(&signer_pk, msg, &sig).is_ok());
                counts[3] += 1;
            }
        }

        for r in doc["rejections"].as_array().unwrap() {
            let pk = hex32(r["public_key_hex"].as_str().unwrap());
            let sig = hex::decode(r["signature_hex"].as_str().unwrap()).unwrap();
            let ok = verify_signature(&pk, r["message"].as_str().unwrap().as_bytes(), &sig).is_ok();
            assert_eq!(
                Some(ok),
                r["verifies"].as_bool(),
                "{}: {}",
                path.display(),
                r["why"]
            );
            assert!(!ok);
            counts[4] += 1;
        }
    }
    println!(
        "heartbeat vectors: {} canonical messages, {} bodies, {} reference-signed requests, {} own-signed, {} rejections",
        counts[0], counts[1], counts[2], counts[3], counts[4]
    );
    assert!(
        counts.iter().take(3).all(|c| *c > 0),
        "some heartbeat vector kind never ran: {counts:?}"
    );
}
