//! engy-audit-service: `engy-audit serve`, the audit service (docs/PROTOCOL.md §11,
//! docs/AUDIT-SERVICE.md, docs/design/audit-service.md).
//!
//! The gateway reports every completed request; the service decides, from a beacon the miner
//! cannot predict, which ones to audit, audits them on workers that keep each model's weights
//! resident, and keeps each verdict (and each cheat's evidence) in a database, from which it
//! answers per-miner summaries for docs/PROTOCOL.md §8's cheat gate.
//!
//! Rooms, one concern each:
//! * [`config`]: flags and `ENGY_AUDIT_*` variables, checked;
//! * [`store`]: the schema (sqlx migrations) on SQLite or PostgreSQL, the job queue and its
//!   leases, the verdict written exactly once per commitment;
//! * [`intake`]: the HTTP API (axum): reports in, verdicts, miners, evidence, health, metrics
//!   out; [`raw`]: the commitment's bytes as the report carried them;
//! * [`sampling`]: the rate and the floor, decided by `production_seed(beacon,
//!   commitment_digest)`; [`beacon`]: subtensor block hashes as the beacon;
//! * [`worker`]: claims jobs and runs the TOPLOC recompute with the routing check and, for a
//!   commitment with cells, the cell challenge ([`challenge`]: through the gateway, judged
//!   with `engy_model::cells` as `engy-audit cells` judges);
//! * [`verdicts`]: per-miner counts, the cheat rate's Wilson interval and §8's gate;
//! * [`metrics`]: the Prometheus families; [`service`]: start-up, signals, shutdown.
#![deny(unsafe_code)]

pub mod beacon;
pub mod challenge;
pub mod config;
pub mod intake;
pub mod metrics;
pub mod raw;
pub mod sampling;
pub mod service;
pub mod store;
pub mod verdicts;
pub mod worker;

pub use config::ServeArgs;
pub use service::main;
