//! engy-validator library: the light validator's parts, used by the binary and its tests.
//!
//! * [`schedule`]: the pure decisions of PROTOCOL.md §7 (schedule, pre-gate, uid mapping,
//!   scaling, burn, standby).
//! * [`state`]: the atomic state file (§7 step 9).
//! * [`liveness`]: heartbeat file, watchdog, health (§7 "Liveness").
//! * [`chain`]: the subxt client, dynamic against the node's metadata (§7 steps 4, 8).
#![deny(unsafe_code)]

pub mod chain;
pub mod liveness;
pub mod schedule;
pub mod state;
