//! Command line and environment (docs/PROTOCOL.md §3 "Environment of the reference miner", §2.3).
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

/// A secret that never prints (`Debug`/`Display` show `<redacted>`).
#[derive(Clone, Default)]
pub struct Secret(String);

impl Secret {
    /// The secret value, for the HELLO frame only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self(s.to_string()))
    }
}

/// engy SN53 miner: dials the engy gateway, serves routed chat requests on local sglang
/// serves (started with `--enable-return-hidden-states`) and attaches a TOPLOC proof to
/// every completion.
///
/// Exit codes: 0 = stopped cleanly (SIGTERM/SIGINT) or another instance already runs on this
/// node; 1 = runtime failure (or a FAIL in `check`); 2 = bad configuration.
#[derive(Parser, Debug)]
#[command(name = "engy-miner", version = engy_telemetry::build_info::LONG_VERSION, about, long_about = None)]
pub struct Cli {
    /// What to do (default: run the miner).
    #[command(subcommand)]
    pub cmd: Option<Cmd>,
    /// Miner settings.
    #[command(flatten)]
    pub opts: Opts,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run the miner (the default).
    Run,
    /// Preflight before going live: checkpoint tokenizer/template, model_root, every serve
    /// (`/get_model_info`, a 4-token `/generate` with hidden states, a proof that builds and
    /// verifies), gateway `/meta`. Prints ok/FAIL lines with the fix; exits 1 on any FAIL.
    Check,
    /// Container health check: exits 0 when at least one gateway leg is connected, read from
    /// this miner's own metrics endpoint (`--metrics-addr` / ENGY_METRICS_ADDR must be set,
    /// to the address the running miner uses); 1 otherwise, with the reason.
    Health,
}

/// Settings shared by `run` and `check`.
#[derive(Args, Debug, Clone)]
pub struct Opts {
    /// Gateway websocket URL, e.g. `wss://<gateway-host>/gw` (required to run).
    #[arg(long = "gw", env = "GW", global = true)]
    pub gw: Option<String>,
    /// Miner key sent in HELLO (required to run; never logged).
    #[arg(
        long = "miner-key",
        env = "MINER_KEY",
        hide_env_values = true,
        global = true
    )]
    pub miner_key: Option<Secret>,
    /// Gateway model id announced in HELLO.
    #[arg(long, env = "MODEL", default_value = "qwen3.6-35b-a3b", global = true)]
    pub model: String,
    /// Checkpoint folder: tokenizer.json, tokenizer_config.json / chat_template.jinja,
    /// config.json and *.safetensors (for model_root).
    #[arg(long, env = "CHECKPOINT", global = true)]
    pub checkpoint: Option<PathBuf>,
    /// sglang serve URL(s), comma-separated; requests go to the least-in-flight one.
    #[arg(
        long = "serve-url",
        env = "SERVE_URL",
        default_value = "http://127.0.0.1:8000",
        global = true
    )]
    pub serve_url: String,
    /// This machine's worker name under MINER_KEY (also ENGY_INSTANCE_ID); default
    /// `ins-` + 12 hex of sha256(hostname|MODEL|serve URLs).
    #[arg(
        long = "worker-name",
        alias = "instance-id",
        env = "ENGY_WORKER_NAME",
        global = true
    )]
    pub worker_name: Option<String>,
    /// Total concurrency of this miner, split across the gateway legs.
    #[arg(
        long = "max-inflight",
        env = "MAX_INFLIGHT",
        default_value_t = 64,
        global = true
    )]
    pub max_inflight: u64,
    /// TOPLOC top-k per proof batch.
    #[arg(long, env = "TOPLOC_TOPK", default_value_t = 128, global = true)]
    pub toploc_topk: usize,
    /// TOPLOC decode batching size (rows per proof).
    #[arg(long, env = "TOPLOC_DBS", default_value_t = 32, global = true)]
    pub toploc_dbs: usize,
    /// Default max_tokens when the request has none.
    #[arg(long, env = "MAX_TOKENS", default_value_t = 512, global = true)]
    pub max_tokens: u64,
    /// Output-token cap advertised and applied.
    #[arg(
        long,
        env = "MAX_OUTPUT_TOKENS",
        default_value_t = 32768,
        global = true
    )]
    pub max_output_tokens: u64,
    /// Input-token cap advertised to the gateway.
    #[arg(
        long,
        env = "MAX_INPUT_TOKENS",
        default_value_t = 229_376,
        global = true
    )]
    pub max_input_tokens: u64,
    /// Seconds the gateway waits for one request (advertised).
    #[arg(long, env = "MAX_REQUEST_S", default_value_t = 1800.0, global = true)]
    pub max_request_s: f64,
    /// HTTP timeout of one serve call in seconds (default: MAX_REQUEST_S).
    #[arg(long, env = "SERVE_HTTP_S", global = true)]
    pub serve_http_s: Option<f64>,
    /// Output tokens per /generate call (the serve buffers every hidden state of a call).
    #[arg(long, env = "TOPLOC_GEN_CHUNK", default_value_t = 4096, global = true)]
    pub gen_chunk: usize,
    /// Coalescing window of streamed deltas, seconds.
    #[arg(long, env = "STREAM_FLUSH_S", default_value_t = 0.05, global = true)]
    pub stream_flush_s: f64,
    /// Override the gateway worker count (skips `/meta`).
    #[arg(long, env = "ENGY_GW_WORKERS", global = true)]
    pub gw_workers: Option<usize>,
    /// Heartbeat period in seconds (must stay under the gateway's 90 s staleness).
    #[arg(long, env = "ENGY_HEARTBEAT_S", default_value_t = 30.0, global = true)]
    pub heartbeat_s: f64,
    /// Largest serve reply (non-stream body or one SSE line) in MiB before the request is
    /// failed. Default: sized from TOPLOC_GEN_CHUNK × hidden_size (config.json), see
    /// docs/MINER.md.
    #[arg(long, env = "ENGY_MAX_RESPONSE_MB", global = true)]
    pub max_response_mb: Option<u64>,
    /// Seconds to let in-flight requests finish after SIGTERM before aborting them.
    #[arg(long, env = "ENGY_DRAIN_S", default_value_t = 30.0, global = true)]
    pub drain_s: f64,
    /// Single-instance lock file (one miner per node).
    #[arg(
        long = "lock-file",
        env = "ENGY_MINER_LOCK",
        default_value = "/tmp/engy_miner.singleton",
        global = true
    )]
    pub lock_file: PathBuf,
    /// HELLO `hw.parallelism`: how the serve splits the model over its GPUs (`tp`, `dp`,
    /// `tp4-dp2`, …; informational, docs/PROTOCOL.md §2.1).
    #[arg(long = "hw-par", env = "HW_PAR", default_value = "tp", global = true)]
    pub hw_par: String,
    /// HELLO `hw.gpus`, e.g. `4x NVIDIA GeForce RTX 4090`. Default: read from `nvidia-smi`;
    /// set it where there is none (the miner image has none: HELLO then says `?x GPU`).
    #[arg(long = "hw-gpus", env = "HW_GPUS", global = true)]
    pub hw_gpus: Option<String>,
    /// Serve Prometheus metrics at `http://<ADDR>/metrics`, e.g. `127.0.0.1:9464` (off when
    /// unset). No authentication: bind it to 127.0.0.1 or a private interface.
    #[arg(long = "metrics-addr", env = "ENGY_METRICS_ADDR", global = true)]
    pub metrics_addr: Option<String>,
    /// MoE routing trace on every commitment (docs/PROTOCOL.md §3.10): `on` asks the
    /// serve for `routed_experts` when its server info says it was started with
    /// `--enable-return-routed-experts` and config.json names an MoE model; `off` never
    /// asks. A serve without the flag, or a broken field, never fails a request: the
    /// commitment then carries no trace.
    #[arg(
        long = "routing-trace",
        env = "ENGY_ROUTING_TRACE",
        value_enum,
        default_value_t = TraceSetting::On,
        global = true
    )]
    pub routing_trace: TraceSetting,
    /// DSA indexer top-k trace (`--enable-return-indexer-topk`, GLM-5): off by default,
    /// because it is `num_hidden_layers × index_topk` ids per token (78 × 2048 for GLM-5:
    /// about 624 KiB per token as sglang sends it, 312–624 KiB in the commitment) and sglang
    /// re-sends it from position 0 on every generation chunk (docs/PROTOCOL.md §3.10).
    #[arg(
        long = "indexer-trace",
        env = "ENGY_INDEXER_TRACE",
        value_enum,
        default_value_t = TraceSetting::Off,
        global = true
    )]
    pub indexer_trace: TraceSetting,
    /// Activation cells of the sampled MoE audit (docs/PROTOCOL.md §10, docs/MINER.md
    /// "Cells"): `on` runs a teacher-forced commit pass after each generation on a serve
    /// started with the engy_cells `--forward-hooks` (integrations/sglang), reads the cells
    /// the hooks spooled (ENGY_CELLS_SPOOL), commits their root and keeps them for
    /// `open_cells`. Any failure leaves the commitment without cells, never fails a request.
    #[arg(
        long = "cells",
        env = "ENGY_CELLS",
        value_enum,
        default_value_t = TraceSetting::Off,
        global = true
    )]
    pub cells: TraceSetting,
    /// The spool directory the serve's engy_cells hooks write (the hooks' `spool`, or their
    /// `$ENGY_CELLS_SPOOL`); required with ENGY_CELLS=on.
    #[arg(long = "cells-spool", env = "ENGY_CELLS_SPOOL", global = true)]
    pub cells_spool: Option<PathBuf>,
    /// Seconds a request's committed cells are kept for a challenge (`open_cells`).
    #[arg(
        long = "cells-retain-s",
        env = "ENGY_CELLS_RETAIN_S",
        default_value_t = 900.0,
        global = true
    )]
    pub cells_retain_s: f64,
    /// Most MiB of cells kept over all requests (in memory); the oldest requests are
    /// evicted first, and a request larger than this commits no cells.
    #[arg(
        long = "cells-retain-mb",
        env = "ENGY_CELLS_RETAIN_MB",
        default_value_t = 2048,
        global = true
    )]
    pub cells_retain_mb: u64,
    /// Log line format: `text` (human) or `json` (one object per line). The filter is RUST_LOG.
    #[arg(
        long = "log-format",
        env = "ENGY_LOG_FORMAT",
        value_enum,
        default_value_t = engy_telemetry::log::LogFormat::Text,
        global = true
    )]
    pub log_format: engy_telemetry::log::LogFormat,
}

impl Opts {
    /// `--metrics-addr` parsed (`None` when unset or empty: metrics are off).
    ///
    /// # Errors
    /// [`ConfigError`] naming ENGY_METRICS_ADDR when it is not `host:port` with an IP.
    pub fn metrics_socket(&self) -> Result<Option<std::net::SocketAddr>, ConfigError> {
        match self.metrics_addr.as_deref().map(str::trim) {
            None | Some("") => Ok(None),
            Some(a) => a.parse().map(Some).map_err(|_| {
                bad(
                    "ENGY_METRICS_ADDR",
                    format!("{a:?} is not an IP:port address (--metrics-addr); set e.g. ENGY_METRICS_ADDR=127.0.0.1:9464"),
                )
            }),
        }
    }

    /// The serve URLs, trimmed, without trailing slashes.
    pub fn serve_urls(&self) -> Vec<String> {
        self.serve_url
            .split(',')
            .map(|s| s.trim().trim_end_matches('/').to_string())
            .filter(|s| !s.is_empty())
            .collect()
    }

    /// HTTP timeout of one serve call.
    pub fn serve_timeout(&self) -> Duration {
        secs(self.serve_http_s.unwrap_or(self.max_request_s))
    }

    /// The reply cap in bytes for rows of `hidden` floats: (GEN_CHUNK + 8192 prefill rows,
    /// sglang's default chunked-prefill size) × hidden × 24 bytes per float, + 64 MiB.
    pub fn reply_cap(&self, hidden: usize) -> usize {
        if let Some(mb) = self.max_response_mb {
            return (mb as usize).saturating_mul(1 << 20);
        }
        (self.gen_chunk + 8192)
            .saturating_mul(hidden.max(1))
            .saturating_mul(24)
            .saturating_add(64 << 20)
    }
}

/// `ENGY_ROUTING_TRACE` / `ENGY_INDEXER_TRACE` / `ENGY_CELLS`: collect a trace (or the cells)
/// when the serve offers it (`on`) or never (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceSetting {
    /// Never ask the serve.
    Off,
    /// Ask when the serve offers it and the checkpoint has its shape.
    On,
}

impl TraceSetting {
    /// True for `on`.
    pub fn is_on(self) -> bool {
        self == TraceSetting::On
    }
}

/// The gateway's lower bound on a miner's total concurrency (docs/PROTOCOL.md §2, leg plan).
pub const GATEWAY_MIN_INFLIGHT: u64 = 8;

/// Seconds after which the gateway calls a leg stale without a heartbeat (docs/PROTOCOL.md §2).
pub const GATEWAY_STALE_S: f64 = 90.0;

/// A setting the miner refuses to start with: `var` is the environment variable (the flag
/// is named in `msg`), `msg` says what is wrong and what to set instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}: {msg}")]
pub struct ConfigError {
    /// The environment variable the operator set (or must set).
    pub var: &'static str,
    /// What is wrong, with the accepted range.
    pub msg: String,
}

fn bad(var: &'static str, msg: impl Into<String>) -> ConfigError {
    ConfigError {
        var,
        msg: msg.into(),
    }
}

/// Finite and > 0.
fn positive(v: f64) -> bool {
    v.is_finite() && v > 0.0
}

impl Opts {
    /// Refuse settings the miner cannot run with (docs/MINER.md "Configuration"): each
    /// error names the variable. Checked before anything is dialed or loaded.
    ///
    /// # Errors
    /// The first [`ConfigError`] found, in the order of the settings table.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.metrics_socket()?;
        if self.max_inflight < GATEWAY_MIN_INFLIGHT {
            return Err(bad(
                "MAX_INFLIGHT",
                format!(
                    "{} is below the gateway's minimum of {GATEWAY_MIN_INFLIGHT} concurrent requests (--max-inflight); set MAX_INFLIGHT={GATEWAY_MIN_INFLIGHT} or more",
                    self.max_inflight
                ),
            ));
        }
        if self.max_tokens == 0 {
            return Err(bad(
                "MAX_TOKENS",
                "must be at least 1: it is the max_tokens of a request that sends none (--max-tokens, default 512)",
            ));
        }
        if self.max_output_tokens == 0 {
            return Err(bad(
                "MAX_OUTPUT_TOKENS",
                "must be at least 1: it caps every request's output and is advertised to the gateway (--max-output-tokens, default 32768)",
            ));
        }
        if self.max_input_tokens == 0 {
            return Err(bad(
                "MAX_INPUT_TOKENS",
                "must be at least 1: it is the prompt size advertised to the gateway in HELLO, and 0 would route this miner nothing (--max-input-tokens, default 229376)",
            ));
        }
        if !positive(self.max_request_s) {
            return Err(bad(
                "MAX_REQUEST_S",
                format!(
                    "must be a number of seconds above 0, got {} (--max-request-s, default 1800)",
                    self.max_request_s
                ),
            ));
        }
        if let Some(s) = self.serve_http_s {
            if !positive(s) {
                return Err(bad(
                    "SERVE_HTTP_S",
                    format!("must be a number of seconds above 0, got {s} (--serve-http-s; unset = MAX_REQUEST_S)"),
                ));
            }
        }
        if self.gw_workers == Some(0) {
            return Err(bad(
                "ENGY_GW_WORKERS",
                "must be at least 1, the gateway's worker count; unset it to ask the gateway's /meta (--gw-workers)",
            ));
        }
        if self.max_response_mb == Some(0) {
            return Err(bad(
                "ENGY_MAX_RESPONSE_MB",
                "must be at least 1 MiB (--max-response-mb; unset = sized from TOPLOC_GEN_CHUNK and hidden_size)",
            ));
        }
        if !positive(self.heartbeat_s) || self.heartbeat_s >= GATEWAY_STALE_S {
            return Err(bad(
                "ENGY_HEARTBEAT_S",
                format!(
                    "must be above 0 and below the gateway's {GATEWAY_STALE_S} s staleness, got {} (--heartbeat-s, default 30)",
                    self.heartbeat_s
                ),
            ));
        }
        if !(self.stream_flush_s.is_finite() && self.stream_flush_s >= 0.0) {
            return Err(bad(
                "STREAM_FLUSH_S",
                format!(
                    "must be 0 or more seconds, got {} (--stream-flush-s, default 0.05)",
                    self.stream_flush_s
                ),
            ));
        }
        if !(self.drain_s.is_finite() && self.drain_s >= 0.0) {
            return Err(bad(
                "ENGY_DRAIN_S",
                format!(
                    "must be 0 or more seconds, got {} (--drain-s, default 30)",
                    self.drain_s
                ),
            ));
        }
        if self.cells.is_on()
            && self
                .cells_spool
                .as_deref()
                .is_none_or(|p| p.as_os_str().is_empty())
        {
            return Err(bad(
                "ENGY_CELLS_SPOOL",
                "must be set with ENGY_CELLS=on: the spool directory the serve's engy_cells hooks write (--cells-spool; integrations/sglang/README.md)",
            ));
        }
        if !positive(self.cells_retain_s) {
            return Err(bad(
                "ENGY_CELLS_RETAIN_S",
                format!(
                    "must be a number of seconds above 0, got {} (--cells-retain-s, default 900)",
                    self.cells_retain_s
                ),
            ));
        }
        if self.cells_retain_mb == 0 {
            return Err(bad(
                "ENGY_CELLS_RETAIN_MB",
                "must be at least 1 MiB (--cells-retain-mb, default 2048)",
            ));
        }
        for (var, v) in [
            ("TOPLOC_TOPK", self.toploc_topk),
            ("TOPLOC_DBS", self.toploc_dbs),
            ("TOPLOC_GEN_CHUNK", self.gen_chunk),
        ] {
            if v == 0 {
                return Err(bad(var, "must be at least 1"));
            }
        }
        Ok(())
    }
}

impl Opts {
    /// TOPLOC_TOPK against the checkpoint's `hidden_size`, checked once the checkpoint is
    /// read: a full proof batch holds `TOPLOC_DBS` rows of `hidden_size` values, and top-k
    /// cannot exceed the values it picks from (toploc 0.1.6 fails), so above
    /// `TOPLOC_DBS × hidden_size` no proof could ever be built and every request would go
    /// out with null proofs. Between `hidden_size` and that bound only a short last batch
    /// (one row, say) gets a null proof, as in the reference (docs/PROTOCOL.md §5).
    ///
    /// # Errors
    /// [`ConfigError`] naming TOPLOC_TOPK with the bound.
    pub fn validate_topk(&self, hidden_size: usize) -> Result<(), ConfigError> {
        let full_batch = hidden_size.saturating_mul(self.toploc_dbs);
        if self.toploc_topk > full_batch {
            return Err(bad(
                "TOPLOC_TOPK",
                format!(
                    "{} is more than the {full_batch} values of a full proof batch (TOPLOC_DBS {} × hidden_size {hidden_size} of config.json): no proof could be built and every request would go out with null proofs; set TOPLOC_TOPK to at most {hidden_size} (default 128, --toploc-topk)",
                    self.toploc_topk, self.toploc_dbs
                ),
            ));
        }
        Ok(())
    }
}

/// A non-negative, finite seconds value as a Duration (bad values → 0).
pub fn secs(s: f64) -> Duration {
    if s.is_finite() && s > 0.0 {
        Duration::from_secs_f64(s.min(1e9))
    } else {
        Duration::ZERO
    }
}
