//! Conformance: `keys/*.json` vector files, dispatched on `schema`:
//! * `engy-sn53/keys/v1` (keypairs): seed → key, public key, SS58, secret bytes round trip,
//!   every reference signature verifies, our signatures verify, every rejection fails.
//! * `engy-sn53/ss58/...` (ss58.json has no schema field; recognised by `encode`/`decode`):
//!   encode cases byte for byte, decode cases accepted exactly when bittensor-wallet accepts
//!   them, with the matching error kind. Our policy is stricter in one place:
//!   [`ss58_decode_prefix_42`] (used for a validator's own hotkey) rejects other prefixes,
//!   which bittensor-wallet accepts; [`ss58_decode`] (used for the pinned master) does not.
//! * `engy-sn53/wallet/v1` + the real `wallets/` directory (copied to a temp root): every
//!   hotkey loads (including `utf8seed`, which bittensor-wallet itself cannot read back) from
//!   the field bittensor-wallet reads (phrase, then hex seed, then privateKey), its
//!   signatures verify, and public-only / encrypted / edited / world-readable files behave:
//!   an edited public field is reported, never used to pick the key.

mod common;

use std::path::{Path, PathBuf};

use common::{hex32, json_files, read_json};

use engy_core::keys::{
    load_hotkey, ss58_decode, ss58_decode_prefix_42, ss58_encode, ss58_encode_with_prefix,
    verify_signature, Disagreement, Hotkey, Ss58Error, WalletError,
};
use serde_json::Value;

fn docs() -> Vec<(PathBuf, Value)> {
    json_files("keys")
        .into_iter()
        .map(|p| {
            let v = read_json(&p);
            (p, v)
        })
        .collect()
}

fn schema(v: &Value) -> &str {
    v.get("schema").and_then(Value::as_str).unwrap_or("")
}

fn message_bytes(v: &Value) -> Vec<u8> {
    match v.get("message_hex").and_then(Value::as_str) {
        Some(h) => hex::decode(h).unwrap(),
        None => v["message_utf8"].as_str().unwrap().as_bytes().to_vec(),
    }
}

#[test]
fn keypair_vectors() {
    let (mut keys, mut sigs, mut rejections) = (0, 0, 0);
    for (path, doc) in docs()
        .into_iter()
        .filter(|(_, d)| schema(d) == "engy-sn53/keys/v1")
    {
        assert_eq!(
            doc["signing"]["signing_context"].as_str(),
            Some("substrate")
        );
        for k in doc["keys"].as_array().unwrap() {
            let name = k["name"].as_str().unwrap();
            let pk = hex32(k["public_key_hex"].as_str().unwrap());
            let ss58 = k["ss58_address"].as_str().unwrap();
            let secret = hex::decode(k["secret_key_hex"].as_str().unwrap()).unwrap();
            assert_eq!(ss58_encode(&pk), ss58, "{name}");
            assert_eq!(ss58_decode_prefix_42(ss58).unwrap(), pk, "{name}");

            let from_secret = Hotkey::from_secret_key_bytes(&secret).unwrap();
            assert_eq!(from_secret.public_key(), pk, "{name}: public from secret");
            assert_eq!(
                from_secret.secret_key_bytes().as_slice(),
                secret.as_slice(),
                "{name}"
            );
            if let Some(seed) = k["mini_secret_hex"].as_str() {
                let hk = Hotkey::from_mini_secret(&hex::decode(seed).unwrap()).unwrap();
                assert_eq!(hk.public_key(), pk, "{name}: public from seed");
                assert_eq!(hk.ss58(), ss58, "{name}");
                assert_eq!(
                    hk.secret_key_bytes().as_slice(),
                    secret.as_slice(),
                    "{name}: secret from seed"
                );
            }
            // The ed25519 ("expanded") form is NOT what we accept as the same key.
            if let Some(ed) = k["secret_key_ed25519_form_hex"].as_str() {
                let ed = hex::decode(ed).unwrap();
                if let Ok(other) = Hotkey::from_secret_key_bytes(&ed) {
                    assert_ne!(
                        other.public_key(),
                        pk,
                        "{name}: ed25519 form must not alias"
                    );
                }
            }
            for s in k["signatures"].as_array().unwrap() {
                let msg = message_bytes(s);
                let sig = hex::decode(s["signature_hex"].as_str().unwrap()).unwrap();
                let ok = verify_signature(&pk, &msg, &sig).is_ok();
                assert_eq!(
                    Some(ok),
                    s["verifies"].as_bool(),
                    "{}: {name}: {s}",
                    path.display()
                );
                // Our own signature over the same message verifies; a different message does not.
                let ours = from_secret.sign(&msg);
                assert!(verify_signature(&pk, &msg, &ours).is_ok());
                let mut other = msg.clone();
                other.push(b'!');
                assert!(verify_signature(&pk, &other, &ours).is_err());
                sigs += 1;
            }
            keys += 1;
        }
        for r in doc["rejections"].as_array().unwrap() {
            let pk = hex32(r["public_key_hex"].as_str().unwrap());
            let sig = hex::decode(r["signature_hex"].as_str().unwrap()).unwrap();
            let msg = message_bytes(r);
            assert!(
                verify_signature(&pk, &msg, &sig).is_err(),
                "{}: rejection verified: {}",
                path.display(),
                r["why"]
            );
            rejections += 1;
        }
    }
    println!("keypair vectors: {keys} keys, {sigs} signatures, {rejections} rejections");
    assert!(keys > 0 && sigs > 0 && rejections > 0);
}

fn expected_kind(bittensor_error: &str) -> fn(&Ss58Error) -> bool {
    if bittensor_error.contains("checksum") {
        |e| matches!(e, Ss58Error::BadChecksum)
    } else if bittensor_error.contains("Length") {
        |e| matches!(e, Ss58Error::WrongLength { .. })
    } else if bittensor_error.contains("Base 58") {
        |e| matches!(e, Ss58Error::BadBase58)
    } else if bittensor_error.contains("Disallowed") {
        |e| matches!(e, Ss58Error::ReservedPrefix { .. })
    } else {
        |_| true
    }
}

#[test]
fn ss58_vectors() {
    let (mut enc, mut dec, mut stricter) = (0, 0, 0);
    for (path, doc) in docs()
        .into_iter()
        .filter(|(_, d)| d.get("encode").is_some() && d.get("decode").is_some())
    {
        for e in doc["encode"].as_array().unwrap() {
            let pk = hex32(e["public_key_hex"].as_str().unwrap());
            let prefix = u16::try_from(e["prefix"].as_u64().unwrap()).unwrap();
            let addr = e["address"].as_str().unwrap();
            assert_eq!(
                ss58_encode_with_prefix(&pk, prefix).unwrap(),
                addr,
                "{}: {e}",
                path.display()
            );
            assert_eq!(ss58_decode(addr).unwrap(), (prefix, pk));
            enc += 1;
        }
        for d in doc["decode"].as_array().unwrap() {
            let addr = d["address"].as_str().unwrap();
            let accepted = d["accepted_by_bittensor_wallet"].as_bool().unwrap();
            let got = ss58_decode(addr);
            if accepted {
                let (prefix, pk) = got.unwrap_or_else(|e| panic!("{addr:?} ({}): {e}", d["note"]));
                assert_eq!(pk, hex32(d["public_key_hex"].as_str().unwrap()));
                // Our prefix-42 policy (own hotkey) is stricter than bittensor-wallet.
                if prefix != 42 {
                    assert!(matches!(
                        ss58_decode_prefix_42(addr),
                        Err(Ss58Error::UnexpectedPrefix { expected: 42, .. })
                    ));
                    stricter += 1;
                }
            } else {
                let err = got.expect_err(addr);
                let want = d["bittensor_error"].as_str().unwrap_or("");
                assert!(
                    expected_kind(want)(&err),
                    "{addr:?}: got {err:?}, bittensor said {want}"
                );
                assert!(ss58_decode_prefix_42(addr).is_err());
            }
            dec += 1;
        }
    }
    println!("ss58 vectors: {enc} encodes, {dec} decodes ({stricter} accepted by bittensor-wallet but not as an own hotkey: prefix != 42)");
    assert!(enc > 0 && dec > 0);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), &dst).unwrap();
        }
    }
}

#[cfg(unix)]
fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Every error message for a file must be free of that file's secrets.
fn assert_no_secret(err: &WalletError, secrets: &[String]) {
    let text = format!("{err} {err:?}");
    for s in secrets {
        if s.len() >= 16 {
            assert!(
                !text.contains(s.as_str()),
                "error text leaks a secret: {text}"
            );
        }
    }
}

#[test]
fn wallet_vectors() {
    let mut loaded = 0;
    for (path, doc) in docs()
        .into_iter()
        .filter(|(_, d)| schema(d) == "engy-sn53/wallet/v1")
    {
        let base = path.parent().unwrap();
        let wallet = doc["wallet_name"].as_str().unwrap();
        let src_root = base.join(doc["wallet_root_in_vectors"].as_str().unwrap());
        // A HOME-like root: <tmp>/.bittensor/wallets/<wallet>/...
        let home = tempfile::tempdir().unwrap();
        let root = home.path().join(".bittensor").join("wallets");
        copy_dir(&src_root, &root);

        for h in doc["hotkeys"].as_array().unwrap() {
            let file = h["file"].as_str().unwrap();
            let hotkey_name = Path::new(file).file_name().unwrap().to_str().unwrap();
            let hot_path = root.join(wallet).join("hotkeys").join(hotkey_name);
            #[cfg(unix)]
            chmod(&hot_path, 0o600);
            let lh =
                load_hotkey(&root, wallet, hotkey_name).unwrap_or_else(|e| panic!("{file}: {e}"));
            let pk = hex32(h["public_key_hex"].as_str().unwrap());
            assert_eq!(lh.hotkey.public_key(), pk, "{file}");
            assert_eq!(lh.hotkey.ss58(), h["ss58_address"].as_str().unwrap());
            let raw: Value = serde_json::from_slice(&std::fs::read(&hot_path).unwrap()).unwrap();
            // bittensor-wallet 4.1.1's order; a raw-byte secretSeed is skipped (utf8seed).
            let source = if raw.get("secretPhrase").is_some_and(Value::is_string) {
                "secretPhrase"
            } else if h["secretSeed_is_hex"] == true {
                "secretSeed"
            } else {
                "privateKey"
            };
            assert_eq!(lh.source_field, source, "{file}");
            assert!(lh.disagreeing.is_empty(), "{file}: {:?}", lh.disagreeing);
            assert!(!lh.insecure_permissions, "{file} is 0600");
            let dbg = format!("{lh:?}");
            let secrets: Vec<String> = ["privateKey", "secretSeed", "secretPhrase"]
                .iter()
                .filter_map(|f| raw.get(*f).and_then(Value::as_str))
                .map(|s| s.trim_start_matches("0x").to_string())
                .collect();
            for s in &secrets {
                if s.len() >= 16 {
                    assert!(!dbg.contains(s.as_str()), "Debug leaks a secret");
                }
            }
            for s in h
                .get("signatures")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let sig = hex::decode(s["signature_hex"].as_str().unwrap()).unwrap();
                assert!(
                    verify_signature(&pk, &message_bytes(s), &sig).is_ok(),
                    "{file}: {s}"
                );
                let ours = lh.hotkey.sign(&message_bytes(s));
                assert!(verify_signature(&pk, &message_bytes(s), &ours).is_ok());
            }

            // World-readable: still loads, with the warning flag.
            #[cfg(unix)]
            {
                chmod(&hot_path, 0o644);
                let lh = load_hotkey(&root, wallet, hotkey_name).unwrap();
                assert!(lh.insecure_permissions);
                assert_eq!(lh.mode, Some(0o644));
                chmod(&hot_path, 0o600);
            }

            // An edited public field: the key is still the one bittensor-wallet loads, and
            // the field is reported.
            let mut tampered = raw.clone();
            let mut other = pk;
            other[0] ^= 1;
            let tp = root.join(wallet).join("hotkeys").join("tampered");
            for field in ["publicKey", "ss58Address"] {
                let mut t = raw.clone();
                t[field] = Value::String(if field == "ss58Address" {
                    ss58_encode(&other)
                } else {
                    format!("0x{}", hex::encode(other))
                });
                std::fs::write(&tp, serde_json::to_vec(&t).unwrap()).unwrap();
                let lh = load_hotkey(&root, wallet, "tampered").unwrap();
                assert_eq!(lh.hotkey.public_key(), pk, "{file} {field}");
                // An invalid Ristretto point still names an address; it only must differ.
                assert_eq!(
                    lh.disagreeing,
                    vec![Disagreement {
                        field,
                        ss58: Some(ss58_encode(&other))
                    }],
                    "{file} {field}"
                );
            }
            // Corrupt privateKey hex: an error where privateKey is the key's field (not
            // echoing the value), a reported field where it is not.
            let bad_priv = format!("0x{}zz", &secrets[0][..secrets[0].len() - 2]);
            tampered["privateKey"] = Value::String(bad_priv);
            std::fs::write(&tp, serde_json::to_vec(&tampered).unwrap()).unwrap();
            match load_hotkey(&root, wallet, "tampered") {
                Err(err) => {
                    assert_eq!(source, "privateKey", "{file}: {err}");
                    assert!(
                        matches!(
                            err,
                            WalletError::BadField {
                                field: "privateKey",
                                ..
                            }
                        ),
                        "{err}"
                    );
                    assert_no_secret(&err, &secrets);
                }
                Ok(lh) => {
                    assert_ne!(source, "privateKey", "{file}");
                    assert_eq!(lh.hotkey.public_key(), pk);
                    assert_eq!(
                        lh.disagreeing,
                        vec![Disagreement {
                            field: "privateKey",
                            ss58: None
                        }]
                    );
                }
            }
            std::fs::remove_file(&tp).unwrap();
            loaded += 1;
        }

        // Public-only file: a clear error.
        if doc["hotkey_pub_file"]["exists"].as_bool() == Some(true) {
            let f = doc["hotkey_pub_file"]["file"].as_str().unwrap();
            let name = Path::new(f).file_name().unwrap().to_str().unwrap();
            let err = load_hotkey(&root, wallet, name).unwrap_err();
            assert!(
                matches!(
                    err,
                    WalletError::BadField {
                        field: "privateKey",
                        ..
                    }
                ),
                "{err}"
            );
        }

        // NaCl without a password: the error says a password is needed.
        std::fs::write(
            root.join(wallet).join("hotkeys").join("nacl"),
            b"$NACL\x01\x02\x03 ciphertext",
        )
        .unwrap();
        let err = load_hotkey(&root, wallet, "nacl").unwrap_err();
        assert!(
            matches!(err, WalletError::PasswordRequired { .. }),
            "nacl: {err}"
        );
        // Formats engy does not decrypt: refuse with the fix in the message.
        for (name, content) in [
            ("vault", b"$ANSIBLE_VAULT;1.1;AES256\n3133".to_vec()),
            ("fernet", b"gAAAAABk-legacy".to_vec()),
            ("btwl", b"$BTWL...".to_vec()),
        ] {
            std::fs::write(root.join(wallet).join("hotkeys").join(name), content).unwrap();
            let err = load_hotkey(&root, wallet, name).unwrap_err();
            assert!(
                matches!(err, WalletError::UnsupportedEncryption { .. }),
                "{name}: {err}"
            );
            assert!(err.to_string().contains("regen-hotkey"), "{err}");
        }
        std::fs::write(root.join(wallet).join("hotkeys").join("junk"), b"not json").unwrap();
        let err = load_hotkey(&root, wallet, "junk").unwrap_err();
        assert!(matches!(err, WalletError::NotKeyfile { .. }), "{err}");
        let big = vec![b' '; (engy_core::keys::MAX_KEYFILE_BYTES + 1) as usize];
        std::fs::write(root.join(wallet).join("hotkeys").join("big"), big).unwrap();
        let err = load_hotkey(&root, wallet, "big").unwrap_err();
        assert!(matches!(err, WalletError::NotKeyfile { .. }), "{err}");
        assert!(matches!(
            load_hotkey(&root, wallet, "missing").unwrap_err(),
            WalletError::NotFound { .. }
        ));
        for bad in ["", "..", "a/b"] {
            assert!(matches!(
                load_hotkey(&root, wallet, bad).unwrap_err(),
                WalletError::BadName { .. }
            ));
        }
    }
    println!("wallet vectors: {loaded} hotkey files loaded and checked");
    assert!(loaded > 0);
}
