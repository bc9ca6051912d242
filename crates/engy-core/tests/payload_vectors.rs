//! Conformance: every case of every `payloads/*.json` vector file (schema
//! `engy-sn53/payload-cases/v1`) against `engy_core::payload::verify`.
//!
//! The vector directory is `$ENGY_VECTORS_DIR/payloads`, else `<workspace>/tests/vectors/payloads`.
//! Each case is compared with `strict_expected` when present (the project's policy on
//! Python quirks), else `expected`: outcome, reason word, weights and epoch index.

use std::path::PathBuf;

use base64::Engine;
use engy_core::payload::{verify, PayloadError};
use serde_json::Value;

const SCHEMA: &str = "engy-sn53/payload-cases/v1";

fn vectors_dir() -> PathBuf {
    match std::env::var_os("ENGY_VECTORS_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors"),
    }
}

fn json_files(sub: &str) -> Vec<PathBuf> {
    let dir = vectors_dir().join(sub);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read vector dir {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

fn body_bytes(case: &Value) -> Vec<u8> {
    if let Some(b64) = case.get("body_b64").and_then(Value::as_str) {
        return base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("body_b64 is base64");
    }
    case["body"]
        .as_str()
        .expect("case has body or body_b64")
        .as_bytes()
        .to_vec()
}

/// Compare one verdict; `Err(description)` on mismatch.
fn check(
    result: &Result<engy_core::payload::VerifiedEpoch, PayloadError>,
    want: &Value,
) -> Result<(), String> {
    let outcome = want["outcome"].as_str().ok_or("expected.outcome missing")?;
    match (outcome, result) {
        ("verified", Ok(v)) => {
            let want_epoch = want["epoch_index"].as_u64().ok_or_else(|| {
                format!(
                    "verified with a non-u64 epoch_index {}",
                    want["epoch_index"]
                )
            })?;
            if v.epoch_index != want_epoch {
                return Err(format!("epoch_index {} != {want_epoch}", v.epoch_index));
            }
            let want_w: Vec<(String, u16)> = want["weights"]
                .as_array()
                .ok_or("expected.weights missing")?
                .iter()
                .map(|p| {
                    (
                        p[0].as_str().unwrap().to_string(),
                        u16::try_from(p[1].as_u64().unwrap()).unwrap(),
                    )
                })
                .collect();
            if v.weights != want_w {
                return Err(format!("weights {:?} != {want_w:?}", v.weights));
            }
            Ok(())
        }
        ("rejected", Err(PayloadError::Rejected { reason, detail })) => {
            let want_reason = want["reason"].as_str().ok_or("expected.reason missing")?;
            if reason.as_str() == want_reason {
                Ok(())
            } else {
                Err(format!(
                    "rejected {reason} ({detail}), expected {want_reason}"
                ))
            }
        }
        ("parse_error", Err(PayloadError::Parse(_))) => Ok(()),
        // The reference raised an exception (no strict verdict given): any error, never a
        // panic and never a verified epoch.
        ("raised", Err(_)) => Ok(()),
        (o, r) => Err(format!("expected {o}, got {r:?}")),
    }
}

#[test]
fn payload_vectors_match_strict_expectations() {
    let mut files = 0;
    let mut ran = 0;
    let mut strict = 0;
    let mut by_outcome = std::collections::BTreeMap::<String, usize>::new();
    let mut failures = Vec::new();
    for path in json_files("payloads") {
        let doc: Value = serde_json::from_slice(&std::fs::read(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if doc.get("schema").and_then(Value::as_str) != Some(SCHEMA) {
            eprintln!("skip {} (schema {:?})", path.display(), doc.get("schema"));
            continue;
        }
        files += 1;
        for case in doc["cases"].as_array().expect("cases") {
            let id = case["id"].as_str().unwrap_or("?");
            let args = &case["verify_args"];
            let master = args["master_hotkey"]
                .as_str()
                .expect("verify_args.master_hotkey");
            let netuid = u16::try_from(args["netuid"].as_u64().expect("verify_args.netuid"))
                .expect("netuid fits u16");
            let want = case
                .get("strict_expected")
                .filter(|v| !v.is_null())
                .inspect(|_| strict += 1)
                .unwrap_or(&case["expected"]);
            let result = verify(&body_bytes(case), master, netuid);
            ran += 1;
            *by_outcome
                .entry(want["outcome"].as_str().unwrap_or("?").to_string())
                .or_default() += 1;
            if let Err(e) = check(&result, want) {
                failures.push(format!("{}: {id}: {e}", path.display()));
            }
            // A verified epoch must always carry the recomputed digest of its result_json.
            if let Ok(v) = &result {
                assert_eq!(
                    v.digest,
                    engy_core::payload::sha256_hex(v.result_json.as_bytes())
                );
            }
        }
    }
    println!(
        "payload vectors: {files} file(s), {ran} case(s) ({strict} with strict_expected), outcomes {by_outcome:?}, {} failure(s)",
        failures.len()
    );
    assert!(
        ran > 0,
        "no payload vector case ran (dir {})",
        vectors_dir().display()
    );
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
}
