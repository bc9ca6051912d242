//! Conformance: every case of every `payloads/*.json` vector file (schema
//! `engy-sn53/payload-cases/v1`) against `engy_core::payload::verify`.
//!
//! The vector directory is `$ENGY_VECTORS_DIR/payloads`, else `<workspace>/tests/vectors/payloads`.
//! Each case is compared with `strict_expected` when present (the project's policy on
//! Python quirks), else `expected`: outcome, reason word, weights and epoch index.

mod common;

use base64::Engine;
use common::{json_files, vectors_dir};
use engy_core::payload::{verify, PayloadError};
use serde_json::Value;

const SCHEMA: &str = "engy-sn53/payload-cases/v1";

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

/// Differential check of the body reader against Python's `json.loads` (the reference's
/// reader): on thousands of deterministically mutated JSON fragments placed in an ignored
/// field, `verify` reports a parse error exactly when Python's reader raises. (Leniencies
/// Python accepts — NaN, duplicate keys — are `malformed` rejections here, not parse errors.)
/// Needs `python3` on PATH; prints a visible SKIP otherwise.
#[test]
fn body_reader_agrees_with_python_json_loads() {
    const SCRIPT: &str = r#"
import json, random, sys
random.seed(int(sys.argv[1]))
seeds = ['{"a":[1,2.5,-0,1e5,-1E-2,true,false,null,"s\\u00e9\\ud83d\\ude00\\n"],"b":{}}',
         '[]', '"x"', '0', '-0.0e+1', '{"k":"\\ud800"}', 'NaN', '[Infinity,-Infinity]',
         '{"a":1,"a":2}', '[1e400, 123456789012345678901234567890]']
alphabet = list('{}[]",:.-+eE0123456789 \t\n\rtruefalsnulNaIfiy\\u/abx') + ['\x00', '\x1f', '\x7f', 'é', '\u2028', '\ufeff']
out = []
for _ in range(int(sys.argv[2])):
    s = random.choice(seeds)
    for _ in range(random.randint(1, 3)):
        op, pos = random.random(), random.randint(0, len(s))
        if op < 0.4:
            s = s[:pos] + random.choice(alphabet) + s[pos:]
        elif op < 0.7:
            s = s[:pos] + s[pos + 1:]
        else:
            s = s[:pos] + random.choice(alphabet) + s[pos + 1:]
    try:
        json.loads(s)
        ok = True
    except ValueError:
        ok = False
    out.append([s, ok])
print(json.dumps(out))
"#;
    let out = match std::process::Command::new("python3")
        .args(["-c", SCRIPT, "53", "20000"])
        .output()
    {
        Ok(o) if o.status.success() => o,
        _ => {
            println!("SKIP body_reader_agrees_with_python_json_loads: python3 not available");
            return;
        }
    };
    let frags: Vec<(String, bool)> = serde_json::from_slice(&out.stdout).unwrap();
    let (mut accepted, mut diffs) = (0, Vec::new());
    for (frag, py_ok) in &frags {
        let body = format!("{{\"v\":1,\"display\":{frag}}}");
        let r = verify(
            body.as_bytes(),
            "5F7ConTMzXkLvP1fcV5CybakMmGa6967sohaqGdg9DxQkTzU",
            53,
        );
        let ours_ok = !matches!(r, Err(PayloadError::Parse(_)));
        accepted += usize::from(*py_ok);
        if ours_ok != *py_ok {
            diffs.push(format!("python ok={py_ok}, ours {r:?}: {frag:?}"));
        }
    }
    println!(
        "body reader vs python json.loads: {} fragments ({accepted} valid for Python), {} disagreement(s)",
        frags.len(),
        diffs.len()
    );
    assert!(
        accepted > 100 && accepted < frags.len(),
        "fragment mix is degenerate"
    );
    assert!(
        diffs.is_empty(),
        "{}",
        diffs
            .iter()
            .take(20)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}
