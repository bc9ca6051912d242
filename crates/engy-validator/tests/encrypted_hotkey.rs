//! An encrypted (`$NACL`) hotkey through the real binary: the committed fixture written by
//! PyPI bittensor-wallet 4.1.1 (`tests/vectors/keys/nacl/`), its password supplied as a
//! docker-secret style file (`ENGY_SN53_WALLET_PASSWORD_FILE`) or not at all.
//! docs/VALIDATOR.md ("Encrypted hotkeys") gives the messages and exit codes checked here.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::Value;

/// A node URL where nothing listens: `check` FAILs on the chain, after the wallet line.
const DEAD_CHAIN: &str = "ws://127.0.0.1:9";
/// A provider URL where nothing listens (the provider line FAILs; not what is tested).
const DEAD_API: &str = "http://127.0.0.1:9";

fn fixture() -> (PathBuf, Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/keys/nacl");
    let doc = serde_json::from_slice(&std::fs::read(dir.join("fixture.json")).unwrap()).unwrap();
    (dir, doc)
}

/// An environment whose `vali/default` hotkey is the fixture's encrypted file, and the
/// password file `<home>/secret` holding `password` with a trailing newline.
fn encrypted_env(password: Option<&str>) -> (Env, String) {
    let (dir, doc) = fixture();
    let ss58 = doc["ss58_address"].as_str().unwrap().to_owned();
    let mut env = Env::new(CHARLIE_SEED, DEAD_API, &ss58, DEAD_CHAIN);
    let src = dir
        .join(doc["wallet_root"].as_str().unwrap())
        .join(doc["wallet_name"].as_str().unwrap())
        .join("hotkeys/encrypted");
    let dst = env
        .home
        .path()
        .join(".bittensor/wallets/vali/hotkeys/default");
    std::fs::copy(src, &dst).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dst, std::fs::Permissions::from_mode(0o600)).unwrap();
    if let Some(pw) = password {
        let secret = env.home.path().join("secret");
        std::fs::write(&secret, format!("{pw}\n")).unwrap();
        env.set("ENGY_SN53_WALLET_PASSWORD_FILE", secret.to_str().unwrap());
    }
    (env, ss58)
}

fn wallet_line(stdout: &str) -> &str {
    stdout
        .lines()
        .find(|l| l.contains("wallet vali/default"))
        .unwrap_or_else(|| panic!("no wallet line: {stdout}"))
}

#[tokio::test]
async fn an_encrypted_hotkey_with_its_password_file_passes_the_wallet_check() {
    let (_, doc) = fixture();
    let (env, ss58) = encrypted_env(Some(doc["password"].as_str().unwrap()));
    let out = env.run(&["check"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = wallet_line(&stdout);
    assert!(line.starts_with("ok"), "{line}");
    assert!(line.contains(&ss58), "{line}");
    // The dead chain and provider FAIL later lines, so check still exits 1 here.
    assert_eq!(out.status.code(), Some(1), "{stdout}");
}

#[tokio::test]
async fn a_wrong_or_missing_password_is_named_by_check_and_run() {
    let (_, doc) = fixture();
    let password = doc["wrong_password"].as_str().unwrap();
    let (env, _) = encrypted_env(Some(password));
    let out = env.run(&["check"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = wallet_line(&stdout);
    assert!(line.starts_with("FAIL"), "{line}");
    assert!(line.contains("wrong password"), "{line}");
    assert!(line.contains("ENGY_SN53_WALLET_PASSWORD_FILE="), "{line}");
    assert!(
        !stdout.contains(password),
        "the password is printed: {stdout}"
    );
    assert_eq!(out.status.code(), Some(1));

    // `run` refuses to start with exit 1 and the same cause, before any chain contact.
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("wrong password"), "{stderr}");
    assert!(
        !stderr.contains(password),
        "the password is printed: {stderr}"
    );

    // No password at all: both variables are named (no key derivation runs).
    let (env, _) = encrypted_env(None);
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is encrypted"), "{stderr}");
    assert!(stderr.contains("ENGY_SN53_WALLET_PASSWORD "), "{stderr}");
    assert!(
        stderr.contains("ENGY_SN53_WALLET_PASSWORD_FILE"),
        "{stderr}"
    );

    // Both variables set: refused, naming both.
    let (mut env, _) = encrypted_env(Some(password));
    env.set("ENGY_SN53_WALLET_PASSWORD", password);
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("both ENGY_SN53_WALLET_PASSWORD and ENGY_SN53_WALLET_PASSWORD_FILE"),
        "{stderr}"
    );
}
