//! Secrets stay secret (issue 8): the wallet hotkey's `privateKey`, `secretSeed` and
//! `secretPhrase` never appear in any log line of the real binary (stdout and stderr, at
//! `trace` level, across start-up, rejected payloads, provider and chain outages, `check`
//! and refused wallets), nor in any error message or `Debug` output of the key types. A
//! world-readable wallet file loads with a warning line that says how to fix it.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use engy_core::keys::{load_hotkey_file, Hotkey};
use engy_devnet::provider::{Fault, ProviderDouble};
use serde_json::json;

const DEAD_CHAIN: &str = "ws://127.0.0.1:9";
/// A fake mnemonic (the loader never reads it; it must never be echoed either).
/// substrate's public dev phrase and its mini secret (tests/vectors/keys/keypairs.json
/// `dev_root`): a file bittensor-wallet 4.1.1 loads, from `secretPhrase`.
const PHRASE: &str = "bottom drive obey lake curtain smoke basket hold race lonely fit walk";
const SEED: [u8; 32] = [
    0xfa, 0xc7, 0x95, 0x9d, 0xbf, 0xe7, 0x2f, 0x05, 0x2e, 0x5a, 0x0c, 0x3c, 0x8d, 0x65, 0x30, 0xf2,
    0x02, 0xb0, 0x2f, 0xd8, 0xf9, 0xf5, 0xca, 0x35, 0x80, 0xec, 0x8d, 0xeb, 0x77, 0x97, 0x47, 0x9e,
];

struct Secrets {
    /// Every spelling that must never be printed.
    needles: Vec<String>,
}

impl Secrets {
    fn of(hk: &Hotkey) -> Secrets {
        let private = hex::encode(hk.secret_key_bytes().as_slice());
        let seed = hex::encode(SEED);
        let mut needles = vec![PHRASE.to_owned()];
        for h in [&private, &seed] {
            // any 16-hex-character window of a secret is a leak; check both halves in both cases
            for chunk in [
                &h[..16],
                &h[h.len() / 2..h.len() / 2 + 16],
                &h[h.len() - 16..],
            ] {
                needles.push(chunk.to_owned());
                needles.push(chunk.to_uppercase());
            }
        }
        // distinctive phrase words
        needles.extend(["quartz umbra", "kumquat", "saffron vortex"].map(str::to_owned));
        Secrets { needles }
    }

    fn assert_absent(&self, what: &str, text: &str) {
        for n in &self.needles {
            assert!(
                !text.contains(n.as_str()),
                "{what} leaks secret material {n:?}:\n{text}"
            );
        }
    }
}

/// A bittensor-wallet style hotkey file with all three secret fields.
fn write_full_wallet(home: &Path, mode: u32) -> (PathBuf, Hotkey) {
    let hk = Hotkey::from_mini_secret(&SEED).unwrap();
    let dir = home.join(".bittensor/wallets/vali/hotkeys");
    std::fs::create_dir_all(&dir).unwrap();
    let public = format!("0x{}", hex::encode(hk.public_key()));
    let doc = json!({
        "accountId": public,
        "publicKey": public,
        "privateKey": format!("0x{}", hex::encode(hk.secret_key_bytes().as_slice())),
        "secretPhrase": PHRASE,
        "secretSeed": format!("0x{}", hex::encode(SEED)),
        "ss58Address": hk.ss58(),
        "cryptoType": 1,
    });
    let path = dir.join("default");
    std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    (path, hk)
}

fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_never_logs_the_hotkey_secret() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let (_path, hk) = write_full_wallet(env.home.path(), 0o600);
    let secrets = Secrets::of(&hk);
    env.set("ENGY_LOG", "trace");

    let mut all = String::new();
    // provider outage, no cache
    p.set_fault(Fault::Status500);
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(out.status.success());
    all.push_str(&output_text(&out));
    // a payload signed by another key (rejected), then a genuine one with the chain down
    p.set_fault(Fault::Raw(
        engy_core::payload::sign_payload(
            &key(ALICE_SEED),
            53,
            5,
            &engy_core::payload::build_result_json(53, 5, &[]),
        )
        .into_bytes(),
    ));
    let out = env.run(&["run", "--ticks", "1"]).await;
    all.push_str(&output_text(&out));
    assert!(all.contains("payload rejected: signature"), "{all}");
    p.set_fault(Fault::None);
    p.publish(6, &[(key(DAVE_SEED).ss58(), 65535)]);
    let out = env.run(&["run", "--ticks", "1"]).await;
    all.push_str(&output_text(&out));
    assert!(all.contains("chain unreachable"), "{all}");
    // the operator preflight
    let out = env.run(&["check"]).await;
    all.push_str(&output_text(&out));
    // the hotkey is named by its public SS58 (so the test looks at the real log)
    assert!(all.contains(&hk.ss58()), "{all}");
    secrets.assert_absent("engy-validator output", &all);

    // edited or damaged wallets: a public field or the unused privateKey edited loads the
    // phrase's key with a warning; a cut file is refused. Either way the output names the
    // problem, never the content.
    let path = env
        .home
        .path()
        .join(".bittensor/wallets/vali/hotkeys/default");
    let good = std::fs::read_to_string(&path).unwrap();
    let other_pub = format!("0x{}", hex::encode(key(EVE_SEED).public_key()));
    for broken in [
        good.replace(&format!("0x{}", hex::encode(hk.public_key())), &other_pub),
        good.replace("\"privateKey\": \"0x", "\"privateKey\": \"0xzz"),
        good.replace(&hk.ss58(), &key(EVE_SEED).ss58()),
        good[..good.len() / 2].to_owned(),
    ]
    .into_iter()
    .enumerate()
    {
        let (i, broken) = broken;
        std::fs::write(&path, &broken).unwrap();
        let out = env.run(&["run", "--ticks", "1"]).await;
        let text = output_text(&out);
        if i == 3 {
            assert!(!out.status.success(), "a cut wallet loaded");
        } else {
            assert!(text.contains(&hk.ss58()), "{i}: {text}");
            assert!(text.contains("re-create it with btcli"), "{i}: {text}");
        }
        assert!(text.contains("hotkey file"), "{text}");
        secrets.assert_absent("refused wallet output", &text);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_readable_wallet_loads_with_a_warning_line() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    p.set_fault(Fault::Status500);
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    let (path, hk) = write_full_wallet(env.home.path(), 0o644);
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(out.status.success());
    let text = output_text(&out);
    let warning = text
        .lines()
        .find(|l| l.contains("readable by others"))
        .unwrap_or_else(|| panic!("no warning line:\n{text}"));
    assert!(warning.contains("WARN"), "{warning}");
    assert!(
        warning.contains("644") && warning.contains("chmod 600"),
        "{warning}"
    );
    assert!(warning.contains(path.to_str().unwrap()), "{warning}");
    Secrets::of(&hk).assert_absent("output", &text);
    // 0600 gives no warning
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(!output_text(&out).contains("readable by others"));
    // group-readable (0640) also warns
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let out = env.run(&["run", "--ticks", "1"]).await;
    assert!(output_text(&out).contains("readable by others"));
}

#[test]
fn debug_and_error_output_never_carry_the_secret() {
    let home = tempfile::tempdir().unwrap();
    let (path, hk) = write_full_wallet(home.path(), 0o600);
    let secrets = Secrets::of(&hk);
    let loaded = load_hotkey_file(&path).unwrap();
    assert_eq!(loaded.hotkey.ss58(), hk.ss58());
    secrets.assert_absent("LoadedHotkey Debug", &format!("{loaded:?} {loaded:#?}"));
    secrets.assert_absent("Hotkey Debug", &format!("{hk:?} {:?}", loaded.hotkey));
    assert!(format!("{hk:?}").contains("redacted"));

    // every way a keyfile can be wrong: the error (Display, Debug, anyhow chain) stays clean
    let good = std::fs::read_to_string(&path).unwrap();
    let private = hex::encode(hk.secret_key_bytes().as_slice());
    let seed = hex::encode(SEED);
    let variants = [
        good.replace(&hex::encode(hk.public_key()), &"11".repeat(32)),
        good.replace(&private, &format!("{private}00")),
        good.replace(&private, &private[..100]),
        good.replace(&format!("0x{private}"), &private.to_uppercase()),
        good.replace(&seed, &format!("{}zz", &seed[..62])),
        good.replace("\"privateKey\"", "\"privateKeyX\"")
            .replace("\"secretSeed\"", "\"secretSeedX\""),
        good.replace(&hk.ss58(), &key(EVE_SEED).ss58()),
        good.replace('{', "["),
        good[..good.len() - 3].to_owned(),
        format!("$NACL{good}"),
        good.replace(&format!("\"0x{private}\""), &format!("[\"0x{private}\"]")),
    ];
    for (i, text) in variants.iter().enumerate() {
        std::fs::write(&path, text).unwrap();
        match load_hotkey_file(&path) {
            Ok(l) => secrets.assert_absent(&format!("variant {i} Debug"), &format!("{l:?}")),
            Err(e) => {
                let shown = format!("{e} | {e:?}");
                let shown = format!("{shown} | {:?}", anyhow::Error::from(e));
                secrets.assert_absent(&format!("variant {i} error"), &shown);
            }
        }
    }
}
