//! engy-telemetry: what the engy daemons tell their operators besides their exit codes.
//!
//! * [`log`]: the process logger: text (the default, for people) or one JSON object per line
//!   (`--log-format json`, for log shippers), filtered by an operator-set variable
//!   (`ENGY_LOG` for the validator, `RUST_LOG` for the miner). A filter that does not parse is
//!   an error naming that variable, never silently replaced by the default.
//! * [`metrics`]: the Prometheus scrape endpoint behind a daemon's `--metrics-addr` (off by
//!   default), serving a [`prometheus_client`] registry the daemon fills with its own metrics.
//! * [`build_info`]: the running build (version, git commit, dirty flag) for `--version`,
//!   `health`, the miner's HELLO and the `<prefix>_build_info` metric.
//! * [`cli`]: clap usage errors that name the variable the operator set.
//!
//! The daemons own their metric names and flags; this crate owns only the plumbing, so both
//! daemons log and expose metrics the same way (docs/VALIDATOR.md, docs/MINER.md).
#![deny(unsafe_code)]

pub mod build_info;
pub mod cli;
pub mod log;
pub mod metrics;

pub use prometheus_client;
