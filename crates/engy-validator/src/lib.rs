//! engy-validator library: the light validator's parts, used by the binary and its tests.
//!
//! * [`config`]: env + flags (PROTOCOL.md §7 "Config").
//! * [`schedule`]: the pure decisions of §7 (schedule, pre-gate, uid mapping, scaling,
//!   burn, standby).
//! * [`state`]: the atomic state file (§7 step 9).
//! * [`liveness`]: heartbeat file, watchdog, health (§7 "Liveness").
//! * [`provider`]: epoch fetch and heartbeat POST (§6).
//! * [`commit_reveal`]: the pure commit-reveal v4 decision and drand reveal round.
//! * [`commit_record`]: the last timelocked commit, kept apart from the state file.
//! * [`timelock`]: the drand-timelocked weights payload (tlock via `timelock` + `w3f-bls`).
//! * [`chain_rules`]: the runtime's weight rules, predicted (refusals, stored row, rate
//!   limit, activity).
//! * [`chain`]: the subxt client, dynamic against the node's metadata (§7 steps 4, 8).
//! * [`metrics`]: the Prometheus metrics of `--metrics-addr`.
//! * [`daemon`]: the tick loop; [`check`]: the operator preflight.
//! * [`wallet`]: the hotkey file, decrypted with ENGY_SN53_WALLET_PASSWORD[_FILE].
#![deny(unsafe_code)]

pub mod chain;
pub mod chain_rules;
pub mod check;
pub mod commit_record;
pub mod commit_reveal;
pub mod config;
pub mod daemon;
pub mod liveness;
pub mod metrics;
pub mod provider;
pub mod schedule;
pub mod state;
pub mod timelock;
pub mod wallet;
