//! Configuration from env and flags (PROTOCOL.md §7 "Config"). Every flag has an
//! `ENGY_SN53_*` environment variable; flags win over the environment.

use std::path::PathBuf;

use clap::Args;

/// Node URL of `ENGY_SN53_NETWORK=finney` (the opentensor public entrypoint).
pub const FINNEY_URL: &str = "wss://entrypoint-finney.opentensor.ai:443";
/// Node URL of `ENGY_SN53_NETWORK=test` (the opentensor testnet).
pub const TEST_URL: &str = "wss://test.finney.opentensor.ai:443";
/// Node URL of `ENGY_SN53_NETWORK=local` (a subtensor node on this machine).
pub const LOCAL_URL: &str = "ws://127.0.0.1:9944";

/// The state/heartbeat file settings shared by `run`, `check` and `health`.
#[derive(Args, Debug, Clone)]
pub struct FileArgs {
    /// Seconds between ticks (fetch, verify, maybe submit). Also sets the watchdog's stall
    /// limit, max(3 × POLL_S, 900 s).
    #[arg(long, env = "ENGY_SN53_POLL_S", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    pub poll_s: u64,
    /// State file (last applied epoch, last submit block/time, cached vector).
    /// [default: ~/.engy-sn53/state.json]
    #[arg(long, env = "ENGY_SN53_STATE_FILE")]
    pub state_file: Option<PathBuf>,
    /// Heartbeat file stamped every tick (read by `health` and the watchdog).
    /// [default: heartbeat.json beside the state file]
    #[arg(long, env = "ENGY_SN53_HEARTBEAT_FILE")]
    pub heartbeat_file: Option<PathBuf>,
}

/// Everything `run` and `check` need.
#[derive(Args, Debug, Clone)]
pub struct NodeArgs {
    /// Wallet name: the hotkey is read from <WALLET_PATH>/<WALLET>/hotkeys/<WALLET_HOTKEY>.
    /// Required, no default.
    #[arg(long, env = "ENGY_SN53_WALLET")]
    pub wallet: String,
    /// Hotkey name inside the wallet. Required, no default.
    #[arg(long, env = "ENGY_SN53_WALLET_HOTKEY")]
    pub wallet_hotkey: String,
    /// Root of the bittensor wallets directory.
    #[arg(
        long,
        env = "ENGY_SN53_WALLET_PATH",
        default_value = "~/.bittensor/wallets"
    )]
    pub wallet_path: PathBuf,
    /// Provider API base URL (protocol constant; override only together with
    /// ENGY_SN53_MASTER_HOTKEY). [default: https://provider.engy.ai]
    #[arg(long, env = "ENGY_SN53_API")]
    pub api: Option<String>,
    /// SS58 master hotkey that signs epoch payloads, also the subnet owner hotkey for burn
    /// checks (protocol constant; override only together with ENGY_SN53_API).
    /// [default: 5DXSBCCKH5ENuyHFNaAvtaMfbhEEWpjSJB4rzc4mJfsc1uvJ]
    #[arg(long, env = "ENGY_SN53_MASTER_HOTKEY")]
    pub master_hotkey: Option<String>,
    /// Subnet netuid.
    #[arg(long, env = "ENGY_SN53_NETUID", default_value_t = engy_core::payload::DEFAULT_NETUID, value_parser = clap::value_parser!(u16).range(1..))]
    pub netuid: u16,
    /// Chain: `finney`, `test`, `local` (ws://127.0.0.1:9944) or a ws:// / wss:// node URL.
    #[arg(long, env = "ENGY_SN53_NETWORK", default_value = "finney")]
    pub network: String,
    /// Resubmit the same epoch's vector every this many blocks (must clear the subnet's
    /// weights_rate_limit, 100 on SN53, with room for inclusion lag).
    #[arg(long, env = "ENGY_SN53_RESUBMIT_BLOCKS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..))]
    pub resubmit_blocks: u64,
    /// State, heartbeat and poll settings.
    #[command(flatten)]
    pub files: FileArgs,
}

/// Configuration errors (each names the variable to fix).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Only one of the API / master hotkey pair was overridden.
    #[error("ENGY_SN53_API and ENGY_SN53_MASTER_HOTKEY are protocol constants and can only be overridden together (got only {0}); unset it to use the defaults, or set both")]
    LoneOverride(&'static str),
    /// The master hotkey is not an SS58 address.
    #[error("ENGY_SN53_MASTER_HOTKEY is not a valid SS58 address: {0}")]
    BadMaster(String),
    /// The API URL is not http(s).
    #[error("ENGY_SN53_API must be an http:// or https:// URL, got {0:?}")]
    BadApi(String),
    /// The network is not one of the accepted forms.
    #[error("ENGY_SN53_NETWORK must be finney, test, local or a ws:// / wss:// URL, got {0:?}")]
    BadNetwork(String),
    /// A wallet name is empty.
    #[error("{0} must not be empty")]
    EmptyWallet(&'static str),
    /// No home directory for the default paths.
    #[error("HOME is not set; set ENGY_SN53_STATE_FILE (and ENGY_SN53_WALLET_PATH) explicitly")]
    NoHome,
}

/// Resolved settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Wallet name.
    pub wallet: String,
    /// Hotkey name.
    pub wallet_hotkey: String,
    /// Wallets root (`~` expanded).
    pub wallet_path: PathBuf,
    /// Provider API base URL (no trailing slash).
    pub api: String,
    /// Master hotkey SS58 (also the expected subnet owner hotkey).
    pub master_hotkey: String,
    /// Netuid.
    pub netuid: u16,
    /// Network name as given.
    pub network: String,
    /// Resolved node URL.
    pub chain_url: String,
    /// Poll interval in seconds.
    pub poll_s: u64,
    /// Resubmit interval in blocks.
    pub resubmit_blocks: u64,
    /// State file path.
    pub state_file: PathBuf,
    /// Heartbeat file path.
    pub heartbeat_file: PathBuf,
}

/// Resolves `ENGY_SN53_NETWORK` to a node URL.
pub fn network_url(network: &str) -> Result<String, ConfigError> {
    let n = network.trim();
    match n {
        "finney" => Ok(FINNEY_URL.into()),
        "test" => Ok(TEST_URL.into()),
        "local" => Ok(LOCAL_URL.into()),
        url if (url.starts_with("ws://") || url.starts_with("wss://")) && url.len() > 6 => {
            Ok(url.to_owned())
        }
        _ => Err(ConfigError::BadNetwork(network.to_owned())),
    }
}

fn home() -> Result<PathBuf, ConfigError> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .ok_or(ConfigError::NoHome)
}

fn expand(p: &std::path::Path) -> Result<PathBuf, ConfigError> {
    let s = p.to_string_lossy();
    if s == "~" {
        return home();
    }
    match s.strip_prefix("~/") {
        Some(rest) => Ok(home()?.join(rest)),
        None => Ok(p.to_path_buf()),
    }
}

impl ConfigError {
    /// The process exit code for this error (docs/VALIDATOR.md "Exit codes"): 2 for a
    /// required setting that is missing, a value that does not parse or settings that cannot
    /// work together (a lone override of the API / master hotkey pair): usage errors, like
    /// clap's own; 1 for the rest (no HOME).
    pub fn exit_code(&self) -> u8 {
        match self {
            ConfigError::EmptyWallet(_)
            | ConfigError::BadNetwork(_)
            | ConfigError::BadApi(_)
            | ConfigError::BadMaster(_)
            | ConfigError::LoneOverride(_) => 2,
            ConfigError::NoHome => 1,
        }
    }
}

/// Clap usage errors that name the variable the operator set (shared with engy-miner).
pub use engy_telemetry::cli::usage_error;

impl FileArgs {
    /// `(state_file, heartbeat_file)` with the defaults applied.
    pub fn paths(&self) -> Result<(PathBuf, PathBuf), ConfigError> {
        let state = match &self.state_file {
            Some(p) => expand(p)?,
            None => home()?.join(".engy-sn53").join("state.json"),
        };
        let heartbeat = match &self.heartbeat_file {
            Some(p) => expand(p)?,
            None => state
                .parent()
                .map(|d| d.join("heartbeat.json"))
                .unwrap_or_else(|| PathBuf::from("heartbeat.json")),
        };
        Ok((state, heartbeat))
    }
}

impl NodeArgs {
    /// Validates and resolves the settings.
    pub fn settings(&self) -> Result<Settings, ConfigError> {
        if self.wallet.trim().is_empty() {
            return Err(ConfigError::EmptyWallet("ENGY_SN53_WALLET"));
        }
        if self.wallet_hotkey.trim().is_empty() {
            return Err(ConfigError::EmptyWallet("ENGY_SN53_WALLET_HOTKEY"));
        }
        let nonempty = |o: &Option<String>| o.as_ref().filter(|s| !s.trim().is_empty()).cloned();
        let (api, master) = match (nonempty(&self.api), nonempty(&self.master_hotkey)) {
            (None, None) => (
                engy_core::payload::DEFAULT_API.to_owned(),
                engy_core::payload::DEFAULT_MASTER_HOTKEY.to_owned(),
            ),
            (Some(a), Some(m)) => (a.trim().to_owned(), m.trim().to_owned()),
            (Some(_), None) => return Err(ConfigError::LoneOverride("ENGY_SN53_API")),
            (None, Some(_)) => return Err(ConfigError::LoneOverride("ENGY_SN53_MASTER_HOTKEY")),
        };
        if !(api.starts_with("http://") || api.starts_with("https://")) {
            return Err(ConfigError::BadApi(api));
        }
        engy_core::keys::ss58_decode(&master).map_err(|e| ConfigError::BadMaster(e.to_string()))?;
        let (state_file, heartbeat_file) = self.files.paths()?;
        Ok(Settings {
            wallet: self.wallet.clone(),
            wallet_hotkey: self.wallet_hotkey.clone(),
            wallet_path: expand(&self.wallet_path)?,
            api: api.trim_end_matches('/').to_owned(),
            master_hotkey: master,
            netuid: self.netuid,
            network: self.network.clone(),
            chain_url: network_url(&self.network)?,
            poll_s: self.files.poll_s,
            resubmit_blocks: self.resubmit_blocks,
            state_file,
            heartbeat_file,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser, Debug)]
    struct T {
        #[command(flatten)]
        n: NodeArgs,
    }

    fn parse(args: &[&str]) -> Result<Settings, String> {
        let mut v = vec!["t"];
        v.extend_from_slice(args);
        let t = T::try_parse_from(v).map_err(|e| e.kind().to_string())?;
        t.n.settings().map_err(|e| e.to_string())
    }

    const MASTER: &str = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty";

    #[test]
    fn networks() {
        assert_eq!(network_url("finney").unwrap(), FINNEY_URL);
        assert_eq!(network_url("test").unwrap(), TEST_URL);
        assert_eq!(network_url("local").unwrap(), LOCAL_URL);
        assert_eq!(
            network_url("ws://1.2.3.4:9944").unwrap(),
            "ws://1.2.3.4:9944"
        );
        assert_eq!(network_url("wss://x").unwrap(), "wss://x");
        for bad in ["", "mainnet", "http://x", "ws://"] {
            assert!(network_url(bad).is_err(), "{bad}");
        }
    }

    // These use flags only (flags win over env), so the process env does not matter as
    // long as the ENGY_SN53_* variables of the pair are unset in the test environment.
    #[test]
    fn defaults_and_pair_rule() {
        if std::env::var_os("ENGY_SN53_API").is_some()
            || std::env::var_os("ENGY_SN53_MASTER_HOTKEY").is_some()
            || std::env::var_os("ENGY_SN53_WALLET").is_some()
        {
            eprintln!("skip: ENGY_SN53_* set in the test environment");
            return;
        }
        let s = parse(&[
            "--wallet",
            "w",
            "--wallet-hotkey",
            "h",
            "--state-file",
            "/x/s.json",
        ])
        .unwrap();
        assert_eq!(s.api, engy_core::payload::DEFAULT_API);
        assert_eq!(s.master_hotkey, engy_core::payload::DEFAULT_MASTER_HOTKEY);
        assert_eq!((s.netuid, s.poll_s, s.resubmit_blocks), (53, 300, 120));
        assert_eq!(s.chain_url, FINNEY_URL);
        assert_eq!(s.heartbeat_file, PathBuf::from("/x/heartbeat.json"));
        let e = parse(&[
            "--wallet",
            "w",
            "--wallet-hotkey",
            "h",
            "--api",
            "http://127.0.0.1:1",
        ])
        .unwrap_err();
        assert!(e.contains("only be overridden together"), "{e}");
        let e = parse(&[
            "--wallet",
            "w",
            "--wallet-hotkey",
            "h",
            "--master-hotkey",
            MASTER,
        ])
        .unwrap_err();
        assert!(e.contains("only be overridden together"), "{e}");
        let s = parse(&[
            "--wallet",
            "w",
            "--wallet-hotkey",
            "h",
            "--api",
            "http://127.0.0.1:1/",
            "--master-hotkey",
            MASTER,
            "--network",
            "ws://127.0.0.1:9",
            "--state-file",
            "/x/s.json",
        ])
        .unwrap();
        assert_eq!(
            (s.api.as_str(), s.master_hotkey.as_str()),
            ("http://127.0.0.1:1", MASTER)
        );
        let e = parse(&[
            "--wallet",
            "w",
            "--wallet-hotkey",
            "h",
            "--api",
            "http://a",
            "--master-hotkey",
            "nope",
        ])
        .unwrap_err();
        assert!(e.contains("SS58"), "{e}");
        // both wallet names are required
        assert!(parse(&["--wallet", "w"]).is_err());
        assert!(parse(&["--wallet-hotkey", "h"]).is_err());
        assert!(parse(&["--wallet", " ", "--wallet-hotkey", "h"]).is_err());
    }
}
