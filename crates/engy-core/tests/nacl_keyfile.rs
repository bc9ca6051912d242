//! NaCl-encrypted (`$NACL`) bittensor hotkey files, decrypted as bittensor-wallet does
//! (`engy_core::keys::nacl`).
//!
//! * `bittensor_wallet_fixture_decrypts_to_the_plain_keypair`: the committed fixture
//!   `tests/vectors/keys/nacl/` (written by PyPI bittensor-wallet 4.1.1; no Python needed).
//! * `bittensor_wallet_encrypts_engy_decrypts`: a fresh key and password, encrypted by PyPI
//!   bittensor-wallet through `tests/reverse/nacl_hotkey.py` when `ENGY_PY_REVERSE=1` (CI
//!   sets it and installs bittensor-wallet); a visible SKIP otherwise.
//!
//! Each checks: the right password gives the same keypair as the unencrypted file, a wrong
//! password is `WalletError::WrongPassword`, a file cut short is
//! `WalletError::CorruptEncrypted`, and no error text carries the password. Every decryption
//! is one Argon2i derivation (512 MiB, seconds), so each test derives twice and no more.

mod common;

use std::path::Path;
use std::process::Command;

use common::hex32;

use engy_core::keys::{
    load_hotkey, load_hotkey_file_with_password, load_hotkey_with_password, Hotkey, LoadedHotkey,
    WalletError, WalletPassword,
};
use serde_json::Value;

fn password(s: &str) -> WalletPassword {
    WalletPassword::from(s.to_string())
}

/// Right password, wrong password, a cut-short copy and no password, against the
/// unencrypted `plain` file of the same wallet.
fn check_encrypted_pair(root: &Path, wallet: &str, right: &str, wrong: &str, public: [u8; 32]) {
    let plain = load_hotkey(root, wallet, "plain").unwrap();
    assert_eq!(plain.hotkey.public_key(), public);
    assert!(!plain.decrypted);

    let enc = load_hotkey_with_password(root, wallet, "encrypted", Some(&password(right)))
        .unwrap_or_else(|e| panic!("right password: {e}"));
    assert!(enc.decrypted);
    assert_same_key(&enc, &plain);

    let err =
        load_hotkey_with_password(root, wallet, "encrypted", Some(&password(wrong))).unwrap_err();
    assert!(matches!(err, WalletError::WrongPassword { .. }), "{err}");
    assert!(err.to_string().contains("wrong password"), "{err}");
    assert_no_password(&err, &[right, wrong]);

    let err = load_hotkey(root, wallet, "encrypted").unwrap_err();
    assert!(matches!(err, WalletError::PasswordRequired { .. }), "{err}");

    // Cut short inside the nonce and just before the tag ends: refused before any derivation.
    let data = std::fs::read(root.join(wallet).join("hotkeys/encrypted")).unwrap();
    let cut = root.join(wallet).join("hotkeys/cut");
    for len in [20, engy_core::keys::nacl::MIN_NACL_LEN - 1] {
        std::fs::write(&cut, &data[..len]).unwrap();
        let err = load_hotkey_file_with_password(&cut, Some(&password(right))).unwrap_err();
        assert!(
            matches!(err, WalletError::CorruptEncrypted { .. }),
            "{len} bytes: {err}"
        );
        assert!(err.to_string().contains("truncated"), "{err}");
        assert_no_password(&err, &[right]);
    }
}

fn assert_same_key(a: &LoadedHotkey, b: &LoadedHotkey) {
    assert_eq!(a.hotkey.public_key(), b.hotkey.public_key());
    assert_eq!(
        a.hotkey.secret_key_bytes().as_slice(),
        b.hotkey.secret_key_bytes().as_slice()
    );
    assert_eq!(a.hotkey.ss58(), b.hotkey.ss58());
}

fn assert_no_password(err: &WalletError, passwords: &[&str]) {
    let text = format!("{err} {err:?}");
    for p in passwords {
        assert!(!text.contains(p), "error text leaks the password: {text}");
    }
}

#[test]
fn bittensor_wallet_fixture_decrypts_to_the_plain_keypair() {
    let dir = common::workspace().join("tests/vectors/keys/nacl");
    let doc: Value =
        serde_json::from_slice(&std::fs::read(dir.join("fixture.json")).unwrap()).unwrap();
    assert_eq!(doc["schema"], "engy-sn53/nacl-keyfile/v1");
    let root = dir.join(doc["wallet_root"].as_str().unwrap());
    let wallet = doc["wallet_name"].as_str().unwrap();
    let public = hex32(doc["public_key_hex"].as_str().unwrap());
    let from_seed = Hotkey::from_mini_secret(&hex32(doc["seed_hex"].as_str().unwrap())).unwrap();
    assert_eq!(from_seed.public_key(), public);
    assert_eq!(from_seed.ss58(), doc["ss58_address"].as_str().unwrap());
    // Work on a copy: the test writes a cut-short file beside the originals.
    let tmp = tempfile::tempdir().unwrap();
    let hotkeys = tmp.path().join(wallet).join("hotkeys");
    std::fs::create_dir_all(&hotkeys).unwrap();
    for f in ["plain", "encrypted"] {
        std::fs::copy(root.join(wallet).join("hotkeys").join(f), hotkeys.join(f)).unwrap();
    }
    check_encrypted_pair(
        tmp.path(),
        wallet,
        doc["password"].as_str().unwrap(),
        doc["wrong_password"].as_str().unwrap(),
        public,
    );
}

/// 32 bytes that differ per run (time and pid through SHA-256; not a secret of any value).
fn fresh_bytes(label: &str) -> [u8; 32] {
    use sha2::Digest;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    sha2::Sha256::digest(format!("{label} {nanos} {}", std::process::id()).as_bytes()).into()
}

#[test]
fn bittensor_wallet_encrypts_engy_decrypts() {
    if std::env::var("ENGY_PY_REVERSE").as_deref() != Ok("1") {
        println!("SKIP bittensor_wallet_encrypts_engy_decrypts: set ENGY_PY_REVERSE=1 (needs python3 with bittensor-wallet: pip install 'bittensor-wallet==4.1.1')");
        return;
    }
    let seed = fresh_bytes("seed");
    let right = format!("engy ✓ {}", hex::encode(&fresh_bytes("password")[..8]));
    let wrong = format!("{right}x");
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg(common::workspace().join("tests/reverse/nacl_hotkey.py"))
        .arg(tmp.path())
        .arg("engy-nacl-reverse")
        .arg(hex::encode(seed))
        .env("ENGY_NACL_PASSWORD", &right)
        .output()
        .expect("run python3 tests/reverse/nacl_hotkey.py");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "nacl_hotkey.py: {:?}", out.status);
    let meta: Value = serde_json::from_slice(&out.stdout).unwrap();
    println!("{meta}");
    let public = hex32(meta["public_key_hex"].as_str().unwrap());
    let from_seed = Hotkey::from_mini_secret(&seed).unwrap();
    assert_eq!(from_seed.public_key(), public);
    assert_eq!(from_seed.ss58(), meta["ss58_address"].as_str().unwrap());
    let data = std::fs::read(tmp.path().join("engy-nacl-reverse/hotkeys/encrypted")).unwrap();
    assert!(
        data.starts_with(b"$NACL"),
        "bittensor-wallet wrote no $NACL file"
    );
    check_encrypted_pair(tmp.path(), "engy-nacl-reverse", &right, &wrong, public);
}
