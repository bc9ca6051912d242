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

    /// `engy-validator <args>` in this environment only (the parent's variables are not
    /// inherited, PATH is), stdout piped, killed when dropped: the one way the tests start
    /// the binary. A later `.env(k, v)` overrides a setting of the environment.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(bin());
        cmd.args(args)
            .env_clear()
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        if let Some(path) = std::env::var_os("PATH") {
            cmd.env("PATH", path);
        }
        for (k, v) in &self.vars {
            cmd.env(k, v);
        }
        cmd
    }

    /// Runs the real binary with `args` to its end, in this environment only
    /// ([`Env::command`]); stdout and stderr are captured and echoed.
    pub async fn run(&self, args: &[&str]) -> Output {
        let out = self.command(args).output().await.unwrap();
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

/// A long-running `engy-validator run` child whose stdout lines are read as they come.
pub struct Running {
    pub child: tokio::process::Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    /// Every line read so far.
    pub seen: Vec<String>,
}

/// Bound on waiting for one log line of a running daemon.
pub const LINE_LIMIT: std::time::Duration = std::time::Duration::from_secs(180);

impl Running {
    /// Starts `engy-validator <args>` in `env` (stdout piped and read line by line; stderr
    /// inherited).
    pub fn spawn(env: &Env, args: &[&str]) -> Running {
        use tokio::io::AsyncBufReadExt;
        let mut child = env.command(args).spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut r = tokio::io::BufReader::new(stdout).lines();
            while let Ok(Some(line)) = r.next_line().await {
                eprintln!("[validator] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// The next line matching `want` (within [`LINE_LIMIT`]); panics naming `what` when
    /// the daemon exits or the limit passes first.
    pub async fn wait_for(&mut self, what: &str, want: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + LINE_LIMIT;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    self.seen.push(line.clone());
                    if want(&line) {
                        return line;
                    }
                }
                Ok(None) => panic!(
                    "the validator exited before {what}:\n{}",
                    self.seen.join("\n")
                ),
                Err(_) => panic!("no {what} within {LINE_LIMIT:?}:\n{}", self.seen.join("\n")),
            }
        }
    }

    /// SIGTERM, then the exit status.
    pub async fn stop(mut self) -> std::process::ExitStatus {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        self.child.wait().await.unwrap()
    }
}

/// Sends `sig` (`-TERM`, `-KILL`, …) to a running child with kill(1); panics when it fails.
pub fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("the child has exited").to_string();
    assert!(std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

/// GETs `url` with `accept` (when given): `(content-type, body)`.
pub async fn scrape(url: &str, accept: Option<&str>) -> (String, String) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(a) = accept {
        req = req.header("accept", a);
    }
    let reply = req.send().await.unwrap();
    assert_eq!(reply.status(), 200, "{url}");
    let ct = reply
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    (ct, reply.text().await.unwrap())
}

/// Validates a scrape with tests/metrics/check_exposition.py (promtool for the 0.0.4 text
/// format, prometheus_client's strict OpenMetrics parser): panics with the parser's words
/// when it is invalid; prints the skip when a tool is missing and not required.
pub fn check_exposition(format: &str, text: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("scrape");
    std::fs::write(&file, text).unwrap();
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/metrics/check_exposition.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .arg(format)
        .arg(&file)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(77) => println!("{}", said.trim()),
        _ => panic!("{format} scrape is not valid: {said}\n{text}"),
    }
}

/// The value of the sample `line_start` (e.g. `engy_validator_ticks_total{outcome="x"}`)
/// in a scrape, `None` when absent.
pub fn sample(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' '))
        .and_then(|v| v.split(' ').next()?.parse().ok())
}

/// Every non-empty line of `text` parses as one JSON object (serde_json, and `jq -e .`
/// when jq is installed, as an operator's log pipeline reads it).
pub fn assert_json_lines(text: &str) {
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {line}\n--- all:\n{text}"));
        assert!(v.is_object(), "{line}");
    }
    if let Ok(mut jq) = std::process::Command::new("jq")
        .args(["-e", "."])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        use std::io::Write;
        jq.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let out = jq.wait_with_output().unwrap();
        assert!(
            out.status.success() || text.trim().is_empty(),
            "jq: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
