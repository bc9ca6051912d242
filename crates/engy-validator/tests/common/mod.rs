//! Shared helpers of the engy-validator integration tests: real wallet directories, the
//! real binary as a child process, dev keys of the subtensor harness.
#![allow(dead_code)]

pub mod chain;

use std::path::{Path, PathBuf};
use std::process::Output;

use engy_core::keys::Hotkey;

/// Secret seeds of the harness accounts (`../shared/chain/README.md`, public dev keys).
pub const ALICE_SEED: &str = "e5be9a5092b81bca64be81d212e7f2f9eba183bb7a90954f7b76361f6edb5c0a";
pub const BOB_SEED: &str = "398f0c28f98885e046333d4a41c19cee4c37368a9832c6502f6cfd182e2aef89";
pub const CHARLIE_SEED: &str = "bc1ede780f784bb6991a585e4f6e61522c14e1cae6ad0895fb57b9a205a8f938";
pub const DAVE_SEED: &str = "868020ae0687dda7d57565093a69090211449845a7e11453612800b663307246";
pub const EVE_SEED: &str = "786ad0e2df456fe43dd1f91ebca22e235bc162e0bb8d53c633e8c85b2af68b7a";
pub const FERDIE_SEED: &str = "42438b7883391c05512a938e36c2df0131e088b3756d6aa7a755fbff19d2f842";

/// A hotkey from a 32-byte hex seed.
pub fn key(seed_hex: &str) -> Hotkey {
    Hotkey::from_mini_secret(&hex::decode(seed_hex).unwrap()).unwrap()
}

/// A hotkey from a fixed label (a key nobody registered).
pub fn stranger(label: &str) -> Hotkey {
    use sha2::Digest;
    let seed = sha2::Sha256::digest(format!("engy-validator tests: {label}").as_bytes());
    Hotkey::from_mini_secret(&seed).unwrap()
}

/// Writes a bittensor-wallet style hotkey file `<home>/.bittensor/wallets/<wallet>/hotkeys/<name>`
/// (mode 0600) and returns the path.
pub fn write_wallet(home: &Path, wallet: &str, name: &str, seed: &[u8; 32]) -> PathBuf {
    let hk = Hotkey::from_mini_secret(seed).unwrap();
    let dir = home.join(".bittensor/wallets").join(wallet).join("hotkeys");
    std::fs::create_dir_all(&dir).unwrap();
    let public = format!("0x{}", hex::encode(hk.public_key()));
    let doc = serde_json::json!({
        "accountId": public,
        "publicKey": public,
        "privateKey": format!("0x{}", hex::encode(hk.secret_key_bytes().as_slice())),
        "secretSeed": format!("0x{}", hex::encode(seed)),
        "ss58Address": hk.ss58(),
        "cryptoType": 1,
    });
    let path = dir.join(name);
    std::fs::write(&path, doc.to_string()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// The seed bytes of a hex seed.
pub fn seed(seed_hex: &str) -> [u8; 32] {
    hex::decode(seed_hex).unwrap().try_into().unwrap()
}

/// The binary under test: `ENGY_VALIDATOR_BIN` when set (a copy that a shared target
/// directory cannot swap mid-run), else the one cargo built for this test.
pub fn bin() -> String {
    std::env::var("ENGY_VALIDATOR_BIN")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_engy-validator").to_owned())
}

/// One validator environment: a temp HOME with a wallet, and the settings passed by env.
pub struct Env {
    pub home: tempfile::TempDir,
    pub vars: Vec<(String, String)>,
}

impl Env {
    /// A HOME with wallet `vali`/`default` holding `seed`, pointed at `api` (with `master`)
    /// and `network`.
    pub fn new(seed_hex: &str, api: &str, master: &str, network: &str) -> Env {
        let home = tempfile::tempdir().unwrap();
        write_wallet(home.path(), "vali", "default", &seed(seed_hex));
        let vars = vec![
            ("HOME", home.path().to_str().unwrap()),
            ("ENGY_SN53_WALLET", "vali"),
            ("ENGY_SN53_WALLET_HOTKEY", "default"),
            ("ENGY_SN53_API", api),
            ("ENGY_SN53_MASTER_HOTKEY", master),
            ("ENGY_SN53_NETWORK", network),
            ("ENGY_SN53_POLL_S", "1"),
            ("ENGY_LOG", "info"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        Env { home, vars }
    }

    pub fn set(&mut self, k: &str, v: &str) {
        self.vars.retain(|(n, _)| n != k);
        self.vars.push((k.to_owned(), v.to_owned()));
    }

    pub fn state_file(&self) -> PathBuf {
        self.home.path().join(".engy-sn53/state.json")
    }

    pub fn heartbeat_file(&self) -> PathBuf {
        self.home.path().join(".engy-sn53/heartbeat.json")
    }

    pub fn state(&self) -> engy_validator::state::State {
        engy_validator::state::read(&self.state_file())
    }

    /// Runs the real binary with `args`, in this environment only (the parent's ENGY_*
    /// variables are not inherited).
    pub async fn run(&self, args: &[&str]) -> Output {
        let mut cmd = tokio::process::Command::new(bin());
        cmd.args(args).env_clear();
        if let Some(path) = std::env::var_os("PATH") {
            cmd.env("PATH", path);
        }
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
        cmd.kill_on_drop(true);
        let out = cmd.output().await.unwrap();
        eprintln!(
            "--- engy-validator {} → {}\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// One daemon tick (`run --ticks 1`); returns (exit ok, stdout).
    pub async fn tick(&self) -> (bool, String) {
        let out = self.run(&["run", "--ticks", "1"]).await;
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// Makes the last submit look old on the wall clock (so the pre-gate lets the tick
    /// reach the chain); the block anchors are untouched.
    pub fn age_state(&self, secs: u64) {
        let mut st = self.state();
        if let Some(ts) = st.last_submit_ts {
            st.last_submit_ts = Some(ts.saturating_sub(secs));
            engy_validator::state::write(&self.state_file(), &st).unwrap();
        }
    }
}

/// The runtime stores weights max-upscaled (largest → 65535) in I32F32 fixed point
/// (exact port of the harness's `lib.js:maxUpscale`).
pub fn max_upscale(ws: &[u16]) -> Vec<u16> {
    let max = ws.iter().copied().max().unwrap_or(0) as u128;
    if max == 0 {
        return ws.iter().map(|_| 0).collect();
    }
    let (one, half, u) = (1u128 << 32, 1u128 << 31, 65535u128);
    ws.iter()
        .map(|&e| {
            let e = e as u128;
            let fx = if max > 32768 {
                e * ((u << 32) / max)
            } else {
                ((e * u) << 32) / max
            };
            ((fx + half) / one) as u16
        })
        .collect()
}
