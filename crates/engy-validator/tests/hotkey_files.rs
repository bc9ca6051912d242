//! Hotkey files as PyPI bittensor-wallet 4.1.1 reads them (issue 21 item 8), through the
//! real binary: `engy-validator check` on every case of the fixture written by
//! bittensor-wallet (`tests/vectors/keys/choice/`, made by `tests/reverse/hotkey_choice.py`)
//! names the key bittensor-wallet loads, or fails where it fails; with `ENGY_PY_REVERSE=1`
//! the script makes the set afresh with the installed bittensor-wallet and the same holds.
//! The permission and symlink policy of docs/SECURITY.md "Hotkey files" is checked too.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value;

/// A node URL where nothing listens: `check` FAILs on the chain, after the wallet lines.
const DEAD_CHAIN: &str = "ws://127.0.0.1:9";
const DEAD_API: &str = "http://127.0.0.1:9";

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/keys/choice")
}

/// An environment whose wallet `vali` holds the case's file as hotkey `<case>` (a symlink
/// case links to a copy of its target), with the case's mode.
fn env_for(hotkeys: &Path, case: &Value) -> (Env, String) {
    let name = case["hotkey"].as_str().unwrap().to_owned();
    let env = Env::new(CHARLIE_SEED, DEAD_API, &key(ALICE_SEED).ss58(), DEAD_CHAIN);
    let dir = env.home.path().join(".bittensor/wallets/vali/hotkeys");
    let mode =
        u32::from_str_radix(case["mode"].as_str().unwrap().trim_start_matches("0o"), 8).unwrap();
    let place = |src: &str, dst: &str| {
        let to = dir.join(dst);
        std::fs::copy(hotkeys.join(src), &to).unwrap();
        std::fs::set_permissions(&to, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    match case.get("symlink_to").and_then(Value::as_str) {
        Some(target) => {
            place(target, "link-target");
            std::os::unix::fs::symlink("link-target", dir.join(&name)).unwrap();
        }
        None => place(&name, &name),
    }
    let mut env = env;
    env.set("ENGY_SN53_WALLET_HOTKEY", &name);
    (env, name)
}

fn lines_about<'a>(stdout: &'a str, needle: &str) -> Vec<&'a str> {
    stdout.lines().filter(|l| l.contains(needle)).collect()
}

/// Every case: engy's key is bittensor-wallet's (or both refuse), the one documented
/// exception aside; returns how many cases were compared.
async fn compare(hotkeys: &Path, expected: &Value) -> usize {
    let mut n = 0;
    for case in expected["cases"].as_array().unwrap() {
        let (env, name) = env_for(hotkeys, case);
        let out = env.run(&["check"]).await;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let wallet = lines_about(&stdout, &format!("wallet vali/{name}"));
        assert_eq!(wallet.len(), 1, "{name}: {stdout}");
        let wallet = wallet[0];
        match (case["bittensor_wallet"]["ss58"].as_str(), name.as_str()) {
            (Some(ss58), _) => {
                assert!(wallet.starts_with("ok"), "{name}: {wallet}");
                assert!(
                    wallet.contains(ss58),
                    "{name}: bittensor-wallet loads {ss58}: {wallet}"
                );
            }
            // bittensor-wallet cannot read the raw-byte secretSeed its own set_hotkey
            // wrote; engy loads the privateKey beside it, the key that was written.
            (None, "utf8seed") => {
                let written = case["written_ss58"].as_str().unwrap();
                assert!(
                    wallet.starts_with("ok") && wallet.contains(written),
                    "{wallet}"
                );
            }
            (None, _) => assert!(
                wallet.starts_with("FAIL"),
                "{name}: bittensor-wallet refuses it: {wallet}"
            ),
        }
        // Policy lines (docs/SECURITY.md "Hotkey files").
        let file_lines: Vec<&str> = lines_about(&stdout, "hotkey file")
            .into_iter()
            .filter(|l| !l.contains("wallet vali/"))
            .collect();
        match name.as_str() {
            "group_readable" => assert!(
                file_lines.iter().any(|l| l.starts_with("FAIL")
                    && l.contains("readable by others")
                    && l.contains("chmod 600")),
                "{stdout}"
            ),
            "symlink" => assert!(
                file_lines
                    .iter()
                    .any(|l| l.contains("is a symlink to") && l.contains("link-target")),
                "{stdout}"
            ),
            "phrase_other_pk" | "seed_other_pk" | "pk_other_public" => assert!(
                file_lines
                    .iter()
                    .any(|l| l.contains("(warning)") && l.contains("ss58Address names")),
                "{name}: {stdout}"
            ),
            _ => assert!(
                file_lines.iter().all(|l| !l.starts_with("FAIL")),
                "{name}: {stdout}"
            ),
        }
        n += 1;
    }
    n
}

#[tokio::test]
async fn check_names_the_key_bittensor_wallet_loads_from_every_fixture_case() {
    let dir = fixture_dir();
    let expected: Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    assert_eq!(expected["bittensor_wallet_version"], "4.1.1");
    let n = compare(&dir.join("wallets/choice/hotkeys"), &expected).await;
    assert_eq!(n, 9);
}

#[tokio::test]
async fn a_fresh_set_from_pypi_bittensor_wallet_agrees() {
    if std::env::var("ENGY_PY_REVERSE").as_deref() != Ok("1") {
        println!("SKIP a_fresh_set_from_pypi_bittensor_wallet_agrees: set ENGY_PY_REVERSE=1 (needs python3 with bittensor-wallet==4.1.1; .ci/run installs it)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("wallets");
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/reverse/hotkey_choice.py");
    let out = std::process::Command::new("python3")
        .arg(&script)
        .arg(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fresh: Value = serde_json::from_slice(&out.stdout).unwrap();
    // The keys are fixed, so the fresh set says what the committed one says.
    let committed: Value =
        serde_json::from_slice(&std::fs::read(fixture_dir().join("expected.json")).unwrap())
            .unwrap();
    assert_eq!(
        fresh, committed,
        "regenerate tests/vectors/keys/choice (its README)"
    );
    compare(&root.join("choice/hotkeys"), &fresh).await;
}

#[tokio::test]
async fn a_hotkey_others_can_write_is_refused_by_check_and_run() {
    let dir = fixture_dir();
    let expected: Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let mut case = expected["cases"][0].clone();
    assert_eq!(case["hotkey"], "mnemonic");
    for mode in ["0o620", "0o602", "0o666"] {
        case["mode"] = Value::String(mode.into());
        let (env, name) = env_for(&dir.join("wallets/choice/hotkeys"), &case);
        let out = env.run(&["check"]).await;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let wallet = lines_about(&stdout, &format!("wallet vali/{name}"));
        assert!(
            wallet.len() == 1
                && wallet[0].starts_with("FAIL")
                && wallet[0].contains("written by group or others"),
            "{mode}: {stdout}"
        );
        let out = env.run(&["run", "--ticks", "1"]).await;
        assert_eq!(out.status.code(), Some(1), "{mode}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("written by group or others"),
            "{mode}: {stderr}"
        );
    }
}
