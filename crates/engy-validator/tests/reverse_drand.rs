//! Commit-reveal v4 against the PyPI reference bittensor-drand 2.0.0
//! (`tests/reverse/drand_reference.py`), gated like the other reverse tests:
//! `ENGY_PY_REVERSE=1` (CI sets it and installs the package); the interpreter is
//! `$ENGY_PYTHON` or `python3`. Checks, in both directions:
//!
//! * a Rust tlock ciphertext decrypts in bittensor-drand with the real round-1000 pulse to
//!   the Rust payload bytes;
//! * bittensor-drand's own `get_encrypted_commit_v2` commit (steered to round 1000)
//!   decrypts in Rust to exactly the SCALE bytes Rust builds for the same payload;
//! * for a table of chain states, bittensor-drand's reveal round lies within the rounds the
//!   Rust plan gives at the wall-clock instants just before and after its call.

use std::io::Write;
use std::process::{Command, Stdio};

use engy_validator::commit_reveal::{stateful_plan, EpochSchedule};
use engy_validator::timelock::{decrypt, encrypt, WeightsTlockPayload};
use serde_json::{json, Value};

const SIG_1000: &str = "b44679b9a59af2ec876b1a6b1ad52ea9b1615fc3982b19576350f93447cb1125e342b73a8dd2bacbe47e4b6b63ed5e39";

#[test]
fn commit_reveal_matches_bittensor_drand_2_0() {
    if std::env::var("ENGY_PY_REVERSE").as_deref() != Ok("1") {
        println!("SKIP commit_reveal_matches_bittensor_drand_2_0: set ENGY_PY_REVERSE=1 (needs python3 with bittensor-drand==2.0.0; .ci/run installs it)");
        return;
    }
    let python = std::env::var("ENGY_PYTHON").unwrap_or_else(|_| "python3".into());
    let payload = WeightsTlockPayload {
        hotkey: [0x5a; 32],
        uids: vec![0, 1, 7, 300],
        values: vec![65535, 12, 0, 4096],
        version_key: 843_000,
    };
    let plain = payload.encode();
    let rust_ct = encrypt(&plain, 1000, rand::rngs::OsRng).unwrap();
    // (last, pending, index, tempo, since, block, period, block_time s)
    type StateRow = (u64, u64, u64, u16, u64, u64, u64, f64);
    let states: &[StateRow] = &[
        (1000, 0, 50, 360, 10, 1010, 1, 12.0),
        (1000, 0, 50, 360, 10, 1359, 1, 12.0),
        (1000, 0, 50, 360, 10, 1361, 1, 12.0),
        (1000, 0, 50, 360, 10, 1010, 3, 12.0),
        (1000, 0, 50, 360, 10, 1010, 0, 12.0),
        (1000, 1200, 50, 360, 10, 1010, 1, 12.0),
        (1000, 1011, 50, 360, 10, 1010, 1, 12.0),
        (7_000_000, 0, 19_000, 99, 3, 7_000_050, 1, 12.0),
        (5000, 0, 12, 10, 2, 5005, 2, 0.25),
    ];
    let req = json!({
        "rust_ciphertext_hex": hex::encode(&rust_ct),
        "round": 1000,
        "signature_hex": SIG_1000,
        "payload": {
            "hotkey_hex": hex::encode(payload.hotkey),
            "uids": payload.uids,
            "values": payload.values,
            "version_key": payload.version_key,
        },
        "states": states.iter().map(|&(last, pending, index, tempo, since, block, period, bt)| json!({
            "last_epoch_block": last, "pending_epoch_at": pending, "subnet_epoch_index": index,
            "tempo": tempo, "blocks_since_last_step": since, "current_block": block,
            "reveal_period": period, "block_time": bt,
        })).collect::<Vec<_>>(),
    });
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/reverse/drand_reference.py"
    );
    let mut child = Command::new(&python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "drand_reference.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let res: Value = serde_json::from_slice(&out.stdout).unwrap();

    // Rust ciphertext → Python decrypt
    assert_eq!(
        res["rust_plaintext_hex"].as_str().unwrap(),
        hex::encode(&plain)
    );
    // Python commit → Rust decrypt → the same SCALE bytes
    assert_eq!(res["python_commit_round"].as_u64(), Some(1000));
    let py_ct = hex::decode(res["python_commit_hex"].as_str().unwrap()).unwrap();
    let py_plain = decrypt(&py_ct, &hex::decode(SIG_1000).unwrap()).unwrap();
    assert_eq!(py_plain, plain, "bittensor-drand's payload bytes differ");

    // reveal rounds
    let rounds = res["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), states.len());
    for (&(last, pending, index, tempo, since, block, period, bt), r) in states.iter().zip(rounds) {
        let plan = stateful_plan(
            &EpochSchedule {
                last_epoch_block: last,
                pending_epoch_at: pending,
                subnet_epoch_index: index,
                blocks_since_last_step: since,
            },
            tempo,
            period,
            block,
        )
        .unwrap();
        let bt_ms = (bt * 1000.0) as u64;
        let lo = plan.reveal_round(r["t0_ms"].as_u64().unwrap(), bt_ms);
        let hi = plan.reveal_round(r["t1_ms"].as_u64().unwrap(), bt_ms);
        let py = r["round"].as_u64().unwrap();
        assert!(
            (lo..=hi).contains(&py),
            "state (last {last}, pending {pending}, block {block}, period {period}): bittensor-drand round {py}, Rust {lo}..={hi}"
        );
    }
    println!(
        "bittensor-drand 2.0.0 agrees: payload bytes, both decrypt directions, {} reveal rounds",
        states.len()
    );
}
