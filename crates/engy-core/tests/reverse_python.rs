//! The reverse direction (issue 2, "Done when"): what the Rust side signs verifies with the
//! reference Python library py-sr25519-bindings.
//!
//! * `write_reverse_file` builds a `reverse_from_rust.json` (schema `engy-sn53/reverse/v1`,
//!   see `tests/vectors/keys/README.md`): signatures, master-signed epoch payloads and
//!   validator heartbeats, all made by engy-core. It checks them with the Rust verifiers and
//!   writes the file to `$ENGY_REVERSE_OUT` when set (that is how `tests/reverse/run.sh`
//!   generates it).
//! * `python_reference_checks_rust_output` runs `tests/reverse/run.sh` on a fresh file when
//!   `ENGY_PY_REVERSE=1` (CI sets it; it needs python3 and PyPI), and prints a visible SKIP
//!   otherwise.

use std::path::{Path, PathBuf};
use std::process::Command;

use engy_core::heartbeat::{build_body, signed_headers, verify_signed_request, HEARTBEAT_PATH};
use engy_core::keys::{verify_signature, Hotkey};
use engy_core::payload::{build_result_json, epoch_message, sha256_hex, sign_payload, verify};
use serde_json::{json, Value};

/// A deterministic test key: mini secret = sha256("engy-sn53 reverse: <name>").
fn key(name: &str) -> Hotkey {
    use sha2::Digest;
    let seed = sha2::Sha256::digest(format!("engy-sn53 reverse: {name}").as_bytes());
    Hotkey::from_mini_secret(&seed).unwrap()
}

/// Build the reverse file; every item is also checked with the Rust verifiers here.
fn build_reverse() -> Value {
    let master = key("master");
    let validator = key("validator_hotkey");
    let netuid = 53u16;

    // Signatures.
    let mut signatures = Vec::new();
    let all_bytes: Vec<u8> = (0u8..=255).collect();
    let epoch_msg = epoch_message(netuid, 12, &sha256_hex(b"{}"));
    let msgs: Vec<(&str, Vec<u8>)> = vec![
        ("hello", b"hello".to_vec()),
        ("empty", Vec::new()),
        ("epoch-message", epoch_msg.into_bytes()),
        ("bytes-0-255", all_bytes),
    ];
    for (id, msg) in &msgs {
        let sig = master.sign(msg);
        assert!(verify_signature(&master.public_key(), msg, &sig).is_ok());
        let mut item = json!({
            "id": format!("rust-master-{id}"),
            "signature_hex": hex::encode(sig),
            "expect_valid": true,
        });
        // Exercise both message encodings and both ways of naming the key.
        match std::str::from_utf8(msg) {
            Ok(text) => {
                item["message_utf8"] = json!(text);
                item["public_key_hex"] = json!(hex::encode(master.public_key()));
            }
            Err(_) => {
                item["message_hex"] = json!(hex::encode(msg));
                item["ss58_address"] = json!(master.ss58());
            }
        }
        signatures.push(item);
    }
    let sig = validator.sign(b"validator says hi");
    signatures.push(json!({
        "id": "rust-validator-ss58",
        "ss58_address": validator.ss58(),
        "message_utf8": "validator says hi",
        "signature_hex": hex::encode(sig),
        "expect_valid": true,
    }));
    // A control the checker must reject: a genuine signature over another message.
    signatures.push(json!({
        "id": "rust-control-wrong-message",
        "public_key_hex": hex::encode(master.public_key()),
        "message_utf8": "hellp",
        "signature_hex": hex::encode(master.sign(b"hello")),
        "expect_valid": false,
    }));

    // Payloads.
    let mut payloads = Vec::new();
    let hotkeys = [
        validator.ss58(),
        key("miner-a").ss58(),
        key("miner-b").ss58(),
    ];
    type Weights = Vec<(String, u16)>;
    let cases: Vec<(&str, u64, Weights)> = vec![
        (
            "typical",
            12,
            vec![
                (hotkeys[0].clone(), 40000),
                (hotkeys[1].clone(), 25535),
                (hotkeys[2].clone(), 0),
            ],
        ),
        ("empty-weights", 0, vec![]),
        ("u64-max-epoch", u64::MAX, vec![(hotkeys[1].clone(), 65535)]),
        (
            "escapes-and-unicode",
            7,
            vec![("quote\"back\\slash é ✓ 😀".to_string(), 1)],
        ),
    ];
    for (id, epoch, weights) in cases {
        let rj = build_result_json(netuid, epoch, &weights);
        let body = sign_payload(&master, netuid, epoch, &rj);
        let v = verify(body.as_bytes(), &master.ss58(), netuid).unwrap();
        assert_eq!(v.weights, weights);
        payloads.push(json!({
            "id": format!("rust-payload-{id}"),
            "body": body,
            "master_hotkey": master.ss58(),
            "netuid": netuid,
            "expect_ok": true,
            "expect_epoch_index": epoch,
            "expect_weights": weights.iter().map(|(h, w)| json!([h, w])).collect::<Vec<_>>(),
        }));
    }

    // Heartbeats.
    let mut heartbeats = Vec::new();
    let bodies = [
        ("version-only", build_body("engy-lv 0.1.0", None, None)),
        ("synced", build_body("engy-lv 0.1.0", Some(12), None)),
        (
            "consensus",
            build_body("engy-lv 0.1.0", Some(12), Some(&sha256_hex(b"x"))),
        ),
        (
            "non-ascii-version",
            build_body("engy-lv é✓😀", Some(u64::MAX), Some("abab")),
        ),
        (
            "control-and-escape-chars",
            build_body(
                "engy-lv \u{0}\u{8}\u{c}\n\r\t\u{1f}\u{7f}\"\\/\u{2028}\u{feff}\u{10ffff}",
                Some(0),
                Some("d\"q"),
            ),
        ),
    ];
    for (n, (id, body)) in bodies.iter().enumerate() {
        let ts = 1_784_506_210 + n as u64;
        let hs = signed_headers(&validator, netuid, HEARTBEAT_PATH, ts, body.as_bytes());
        let get = |name: &str| hs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str());
        verify_signed_request(get, netuid, "POST", HEARTBEAT_PATH, body.as_bytes()).unwrap();
        let headers: serde_json::Map<String, Value> = hs
            .iter()
            .filter(|(k, _)| k.starts_with("X-Validator-"))
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        heartbeats.push(json!({
            "id": format!("rust-heartbeat-{id}"),
            "headers": headers,
            "body": body,
            "netuid": netuid,
            "method": "POST",
            "path": HEARTBEAT_PATH,
            "expect_valid": true,
        }));
    }

    json!({
        "schema": "engy-sn53/reverse/v1",
        "produced_by": format!("engy-core {} (Rust, schnorrkel 0.11)", env!("CARGO_PKG_VERSION")),
        "signatures": signatures,
        "payloads": payloads,
        "heartbeats": heartbeats,
    })
}

#[test]
fn write_reverse_file() {
    let doc = build_reverse();
    let text = serde_json::to_string_pretty(&doc).unwrap();
    match std::env::var_os("ENGY_REVERSE_OUT") {
        Some(out) if !out.is_empty() => {
            std::fs::write(&out, &text).unwrap();
            println!("wrote {}", Path::new(&out).display());
        }
        _ => println!(
            "built reverse file in memory ({} bytes); set ENGY_REVERSE_OUT to write it",
            text.len()
        ),
    }
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn python_reference_checks_rust_output() {
    if std::env::var("ENGY_PY_REVERSE").as_deref() != Ok("1") {
        println!("SKIP python_reference_checks_rust_output: set ENGY_PY_REVERSE=1 to verify Rust output with py-sr25519-bindings (tests/reverse/run.sh)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("reverse_from_rust.json");
    std::fs::write(
        &file,
        serde_json::to_string_pretty(&build_reverse()).unwrap(),
    )
    .unwrap();
    let out = Command::new("bash")
        .arg(workspace_root().join("tests/reverse/run.sh"))
        .arg("--file")
        .arg(&file)
        .output()
        .expect("run bash tests/reverse/run.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "reverse check failed: {:?}",
        out.status
    );
    assert!(
        stdout.contains(", 0 failure(s)"),
        "unexpected checker output"
    );
}
