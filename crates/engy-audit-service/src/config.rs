//! `engy-audit serve`'s settings: every flag has its `ENGY_AUDIT_*` variable (a usage error
//! names the variable the operator set, `engy_telemetry::cli::usage_error`, printed by the
//! binary). [`ServeArgs::check`] turns them into a [`Config`], naming the setting at fault.
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;

use engy_model::DeviceSpec;

/// Arguments of `engy-audit serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address of the HTTP API (`POST /v1/requests`, `GET /v1/miners/{hotkey}`,
    /// `GET /v1/verdicts`, `/metrics`, `/health`).
    #[arg(
        long,
        env = "ENGY_AUDIT_LISTEN",
        value_name = "ADDR",
        default_value = "127.0.0.1:8090"
    )]
    pub listen: SocketAddr,
    /// The database: `sqlite://PATH` (embedded, created when missing) or
    /// `postgres://USER[:PASSWORD]@HOST[:PORT]/DB` (shared by workers on several machines).
    #[arg(
        long,
        env = "ENGY_AUDIT_DB",
        value_name = "URL",
        default_value = "sqlite://engy-audit.db"
    )]
    pub db: String,
    /// A model the service audits, `NAME=CHECKPOINT_DIR` (NAME as reports name it, e.g.
    /// qwen3.6-35b-a3b); repeat the flag, or separate with commas in the variable. Reports of
    /// other models are refused (422).
    #[arg(
        long = "model",
        env = "ENGY_AUDIT_MODELS",
        value_name = "NAME=DIR",
        value_delimiter = ',',
        required = true
    )]
    pub models: Vec<String>,
    /// Fraction of each miner's requests audited (0..=1), decided per request by the
    /// production seed (docs/PROTOCOL.md §11).
    #[arg(
        long,
        env = "ENGY_AUDIT_SAMPLE_RATE",
        value_name = "FRACTION",
        default_value_t = 0.05
    )]
    pub sample_rate: f64,
    /// The floor: each (model, miner) with requests in a window is audited at least this
    /// many times in it (fewer only when it sent fewer requests), so docs/PROTOCOL.md §8's
    /// minimum sample is reached; also the gate's minimum sample.
    #[arg(long, env = "ENGY_AUDIT_FLOOR", value_name = "K", default_value_t = 20)]
    pub floor: u64,
    /// Length of a sampling window in seconds.
    #[arg(
        long,
        env = "ENGY_AUDIT_WINDOW_S",
        value_name = "SECONDS",
        default_value_t = 3600
    )]
    pub window_s: u64,
    /// The worker devices: one worker per device (`cpu`, `cuda`, `cuda:N`), each keeping
    /// every model's weights resident; repeat the flag or separate with commas. `none`: no
    /// worker in this process (intake only).
    #[arg(
        long = "device",
        env = "ENGY_AUDIT_DEVICES",
        value_name = "DEVICE",
        value_delimiter = ',',
        default_value = "cpu"
    )]
    pub devices: Vec<String>,
    /// Seconds a claimed job is leased; the worker renews it every third of that while it
    /// audits. A worker that dies loses the job after at most this long.
    #[arg(
        long,
        env = "ENGY_AUDIT_LEASE_S",
        value_name = "SECONDS",
        default_value_t = 120
    )]
    pub lease_s: u64,
    /// On SIGTERM, seconds a worker may take to finish the audit in hand before it gives the
    /// job back to the queue and exits.
    #[arg(
        long,
        env = "ENGY_AUDIT_DRAIN_S",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub drain_s: u64,
    /// Jobs of one model a worker claims at once and audits in one pass over the weights
    /// (`engy_model::audit::audit_many`; each job leased and given its own verdict): 1 to 64
    /// (`MAX_BATCH`).
    #[arg(
        long,
        env = "ENGY_AUDIT_BATCH",
        value_name = "JOBS",
        default_value_t = 1
    )]
    pub batch: usize,
    /// Largest report body accepted, in bytes (413 above).
    #[arg(
        long,
        env = "ENGY_AUDIT_MAX_REPORT_BYTES",
        value_name = "BYTES",
        default_value_t = 16 << 20
    )]
    pub max_report_bytes: usize,
    /// The subtensor node whose block hashes are the sampling beacon (ws:// or wss://).
    #[arg(long, env = "ENGY_AUDIT_CHAIN", value_name = "URL")]
    pub chain: Option<String>,
    /// A fixed beacon (64 hex digits) instead of the chain's block hashes: tests and the
    /// devnet only; a miner who knows it predicts every sampling decision.
    #[arg(long, env = "ENGY_AUDIT_FIXED_BEACON", value_name = "HEX")]
    pub fixed_beacon: Option<String>,
    /// Proof top-k commitments must use (model spec `toploc_k`).
    #[arg(long, env = "ENGY_AUDIT_TOPLOC_K", default_value_t = 128)]
    pub toploc_k: usize,
    /// Largest exponent-mismatch count of a passing batch (model spec `toploc_v`).
    #[arg(long, env = "ENGY_AUDIT_TOPLOC_V", default_value_t = 40)]
    pub toploc_v: u64,
    /// Smallest fraction of passing batches (model spec `toploc_p`).
    #[arg(long, env = "ENGY_AUDIT_TOPLOC_P", default_value_t = 0.99)]
    pub toploc_p: f64,
    /// The gateway the cell challenge goes through (`http://HOST:PORT`; docs/PROTOCOL.md
    /// §11.3: `POST {gateway}/v1/open_cells`). Without it, commitments' cells are not judged
    /// (TOPLOC only, the report says so).
    #[arg(long, env = "ENGY_AUDIT_GATEWAY", value_name = "URL")]
    pub gateway: Option<String>,
    /// Seconds the miner has to answer `open_cells` (the gateway's `deadline_ms`); no answer
    /// by then is the verdict `unanswered`.
    #[arg(
        long,
        env = "ENGY_AUDIT_CHALLENGE_DEADLINE_S",
        value_name = "SECONDS",
        default_value_t = 30
    )]
    pub challenge_deadline_s: u64,
    /// Cells challenged per request (the policy's `n`: at least 32, at most 256; fewer only
    /// when the request has fewer cells).
    #[arg(
        long,
        env = "ENGY_AUDIT_CELLS_N",
        value_name = "N",
        default_value_t = engy_core::cells::DEFAULT_CHALLENGE_CELLS
    )]
    pub cells_n: u64,
    /// The trusted spec of a model, `NAME=SPEC` (`model_spec.json.gz` or the directory `spec
    /// build` wrote): its `model_root` is the root the cell check verifies touched weights
    /// against. A model without one gets no cell check. Repeat, or commas in the variable.
    #[arg(
        long = "spec",
        env = "ENGY_AUDIT_SPECS",
        value_name = "NAME=SPEC",
        value_delimiter = ','
    )]
    pub specs: Vec<String>,
    /// Log format: text or json.
    #[arg(
        long,
        env = "ENGY_AUDIT_LOG_FORMAT",
        value_enum,
        default_value_t = engy_telemetry::log::LogFormat::Text
    )]
    pub log_format: engy_telemetry::log::LogFormat,
}

/// The largest `--batch`: jobs of one model audited in one pass over the weights.
pub const MAX_BATCH: usize = 64;

/// Where the sampling beacon comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeaconConfig {
    /// A subtensor node's block hashes.
    Chain(String),
    /// A fixed value (tests, devnet).
    Fixed([u8; 32]),
}

/// The checked settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// HTTP address.
    pub listen: SocketAddr,
    /// Database URL.
    pub db: String,
    /// Model name → checkpoint directory.
    pub models: BTreeMap<String, PathBuf>,
    /// Sampling rate, 0..=1.
    pub sample_rate: f64,
    /// The floor K.
    pub floor: u64,
    /// Window length, ms.
    pub window_ms: i64,
    /// One worker per device.
    pub devices: Vec<DeviceSpec>,
    /// Lease, ms.
    pub lease_ms: i64,
    /// Drain time on SIGTERM.
    pub drain: std::time::Duration,
    /// Jobs of one model audited in one pass (`--batch`), 1..=[`MAX_BATCH`].
    pub batch: usize,
    /// Largest report body.
    pub max_report_bytes: usize,
    /// The beacon.
    pub beacon: BeaconConfig,
    /// The audit thresholds.
    pub params: engy_model::audit::AuditParams,
    /// The gateway of the cell challenge (docs/PROTOCOL.md §11.3).
    pub gateway: Option<String>,
    /// How long the miner has to answer `open_cells`.
    pub challenge_deadline: std::time::Duration,
    /// Cells challenged per request (the policy's `n`).
    pub cells_n: u64,
    /// Model name → its trusted spec file (or directory).
    pub specs: BTreeMap<String, PathBuf>,
}

/// A setting that is not usable; the message names the flag and its variable.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ServeArgs {
    /// The checked settings.
    ///
    /// # Errors
    /// [`ConfigError`] naming the flag and variable at fault.
    pub fn check(&self) -> Result<Config, ConfigError> {
        let bad = |m: String| Err(ConfigError(m));
        let mut models = BTreeMap::new();
        for m in &self.models {
            let Some((name, dir)) = m.split_once('=') else {
                return bad(format!(
                    "--model / ENGY_AUDIT_MODELS: {m:?} is not NAME=CHECKPOINT_DIR"
                ));
            };
            let name = name.trim();
            if name.is_empty() || dir.trim().is_empty() {
                return bad(format!(
                    "--model / ENGY_AUDIT_MODELS: {m:?} is not NAME=CHECKPOINT_DIR"
                ));
            }
            if models
                .insert(name.to_owned(), PathBuf::from(dir.trim()))
                .is_some()
            {
                return bad(format!(
                    "--model / ENGY_AUDIT_MODELS: the model {name:?} is given twice"
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.sample_rate) {
            return bad(format!(
                "--sample-rate / ENGY_AUDIT_SAMPLE_RATE must be within 0..=1, got {}",
                self.sample_rate
            ));
        }
        if self.window_s == 0 {
            return bad("--window-s / ENGY_AUDIT_WINDOW_S must be at least 1".into());
        }
        if self.lease_s == 0 {
            return bad("--lease-s / ENGY_AUDIT_LEASE_S must be at least 1".into());
        }
        let mut devices = Vec::new();
        for d in &self.devices {
            if d.trim() == "none" {
                continue;
            }
            match d.trim().parse::<DeviceSpec>() {
                Ok(spec) => devices.push(spec),
                Err(e) => {
                    return bad(format!("--device / ENGY_AUDIT_DEVICES: {d:?}: {e}"));
                }
            }
        }
        let beacon = match (&self.chain, &self.fixed_beacon) {
            (Some(_), Some(_)) => {
                return bad("--chain (ENGY_AUDIT_CHAIN) and --fixed-beacon \
                     (ENGY_AUDIT_FIXED_BEACON) exclude each other"
                    .into())
            }
            (Some(url), None) => BeaconConfig::Chain(url.clone()),
            (None, Some(hex)) => match engy_core::commit::parse_digest(hex) {
                Ok(b) => BeaconConfig::Fixed(b),
                Err(e) => {
                    return bad(format!(
                        "--fixed-beacon / ENGY_AUDIT_FIXED_BEACON must be 64 hex digits: {e}"
                    ))
                }
            },
            (None, None) => {
                return bad(
                    "set --chain / ENGY_AUDIT_CHAIN (the subtensor node whose block \
                     hashes decide which requests are audited), or --fixed-beacon / \
                     ENGY_AUDIT_FIXED_BEACON for a devnet"
                        .into(),
                )
            }
        };
        if !(self.toploc_p > 0.0 && self.toploc_p <= 1.0) {
            return bad(format!(
                "--toploc-p / ENGY_AUDIT_TOPLOC_P must be above 0 and at most 1, got {}",
                self.toploc_p
            ));
        }
        let mut specs = BTreeMap::new();
        for m in &self.specs {
            let Some((name, path)) = m.split_once('=') else {
                return bad(format!("--spec / ENGY_AUDIT_SPECS: {m:?} is not NAME=SPEC"));
            };
            let name = name.trim();
            if !models.contains_key(name) {
                return bad(format!(
                    "--spec / ENGY_AUDIT_SPECS: {name:?} is not a model of --model / \
                     ENGY_AUDIT_MODELS"
                ));
            }
            if path.trim().is_empty()
                || specs
                    .insert(name.to_owned(), PathBuf::from(path.trim()))
                    .is_some()
            {
                return bad(format!(
                    "--spec / ENGY_AUDIT_SPECS: {m:?} is empty or names its model twice"
                ));
            }
        }
        if !(engy_core::cells::MIN_CHALLENGE_CELLS..=engy_core::wire::MAX_OPEN_CELLS)
            .contains(&self.cells_n)
        {
            return bad(format!(
                "--cells-n / ENGY_AUDIT_CELLS_N must be within {}..={} (specs/CELLS.md §5), got {}",
                engy_core::cells::MIN_CHALLENGE_CELLS,
                engy_core::wire::MAX_OPEN_CELLS,
                self.cells_n
            ));
        }
        if !(1..=MAX_BATCH).contains(&self.batch) {
            return bad(format!(
                "--batch / ENGY_AUDIT_BATCH must be within 1..={MAX_BATCH}, got {}",
                self.batch
            ));
        }
        if self.challenge_deadline_s == 0 {
            return bad(
                "--challenge-deadline-s / ENGY_AUDIT_CHALLENGE_DEADLINE_S must be at least 1"
                    .into(),
            );
        }
        if let Some(g) = &self.gateway {
            if !(g.starts_with("http://") || g.starts_with("https://")) {
                return bad(format!(
                    "--gateway / ENGY_AUDIT_GATEWAY must be an http:// or https:// URL, got {g:?}"
                ));
            }
        }
        Ok(Config {
            gateway: self.gateway.clone(),
            challenge_deadline: std::time::Duration::from_secs(self.challenge_deadline_s),
            cells_n: self.cells_n,
            specs,
            listen: self.listen,
            db: self.db.clone(),
            models,
            sample_rate: self.sample_rate,
            floor: self.floor,
            window_ms: i64::try_from(self.window_s.saturating_mul(1000)).unwrap_or(i64::MAX),
            devices,
            lease_ms: i64::try_from(self.lease_s.saturating_mul(1000)).unwrap_or(i64::MAX),
            drain: std::time::Duration::from_secs(self.drain_s),
            batch: self.batch,
            max_report_bytes: self.max_report_bytes,
            beacon,
            params: engy_model::audit::AuditParams {
                toploc_k: self.toploc_k,
                toploc_v: self.toploc_v,
                toploc_p: self.toploc_p,
                ..Default::default()
            },
        })
    }
}
