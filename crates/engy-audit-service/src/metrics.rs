//! The service's Prometheus metrics (served at `GET /metrics` on the API address, through
//! `engy_telemetry::metrics`). Names and labels:
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `engy_audit_queue_jobs` | gauge | `state` (queued, leased) | jobs in the queue (all processes), read at each scrape |
//! | `engy_audit_requests_total` | counter | `outcome` (new, duplicate, refused) | reports the intake answered |
//! | `engy_audit_audits_total` | counter | `verdict` | audits this process finished (their rate is audits/s) |
//! | `engy_audit_audit_seconds` | histogram | | seconds per audit, claim to verdict |
//! | `engy_audit_verdicts` | gauge | `verdict` | verdicts in the database by kind, read at each scrape |
//! | `engy_audit_lease_expiries_total` | counter | | leases this process took back after they ran out |
//! | `engy_audit_audit_errors_total` | counter | | audits that could not run (the job is kept) |
//! | `engy_audit_miner_cheat_rate` | gauge | `hotkey` | per miner, (cheat + unanswered) / judged (docs/PROTOCOL.md §8); one series per miner with verdicts (at most the subnet's 256 uids) |
//! | `engy_audit_build_info` | info | version, commit, dirty | the build |
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use engy_telemetry::metrics::Labels;
use engy_telemetry::prometheus_client;

/// The verdict words (label values).
pub const VERDICTS: [&str; 4] = ["pass", "cheat", "unproven", "unanswered"];

/// The metric handles.
#[derive(Debug)]
pub struct Metrics {
    /// Jobs by state.
    pub queue: Family<Labels, Gauge>,
    /// Reports by outcome.
    pub requests: Family<Labels, Counter>,
    /// Audits finished here, by verdict.
    pub audits: Family<Labels, Counter>,
    /// Seconds per audit.
    pub audit_seconds: Histogram,
    /// Verdicts in the database by kind.
    pub verdicts: Family<Labels, Gauge>,
    /// Leases taken back.
    pub lease_expiries: Counter,
    /// Audits that could not run.
    pub audit_errors: Counter,
    /// Per-miner cheat rate.
    pub miner_cheat_rate: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Cell challenges judged, by outcome (`crate::challenge::CellOutcome::label`).
    pub challenges: Family<Labels, Counter>,
    /// TOPLOC recompute passes over the weights: one per job at `--batch 1`, one per claimed
    /// batch of one model above it (`engy_model::audit::audit_many`).
    pub audit_passes: Counter,
}

impl Metrics {
    /// Registers every family in `registry` (each series created at 0).
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            queue: Family::default(),
            requests: Family::default(),
            audits: Family::default(),
            audit_seconds: Histogram::new([
                0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
            ]),
            verdicts: Family::default(),
            lease_expiries: Counter::default(),
            audit_errors: Counter::default(),
            miner_cheat_rate: Family::default(),
            challenges: Family::default(),
            audit_passes: Counter::default(),
        };
        for o in ["pass", "cheat", "unanswered", "not_judged"] {
            let _ = m
                .challenges
                .get_or_create(&engy_telemetry::metrics::labels(&[("outcome", o)]));
        }
        for s in ["queued", "leased"] {
            let _ = m
                .queue
                .get_or_create(&engy_telemetry::metrics::labels(&[("state", s)]));
        }
        for o in ["new", "duplicate", "refused"] {
            let _ = m
                .requests
                .get_or_create(&engy_telemetry::metrics::labels(&[("outcome", o)]));
        }
        for v in VERDICTS {
            let l = engy_telemetry::metrics::labels(&[("verdict", v)]);
            let _ = m.audits.get_or_create(&l);
            let _ = m.verdicts.get_or_create(&l);
        }
        registry.register(
            "queue_jobs",
            "Jobs in the audit queue by state (all processes sharing the database)",
            m.queue.clone(),
        );
        registry.register(
            "requests",
            "Reports the intake answered, by outcome",
            m.requests.clone(),
        );
        registry.register(
            "audits",
            "Audits this process finished, by verdict",
            m.audits.clone(),
        );
        registry.register(
            "audit_seconds",
            "Seconds per audit, from claim to verdict",
            m.audit_seconds.clone(),
        );
        registry.register(
            "verdicts",
            "Verdicts in the database by kind",
            m.verdicts.clone(),
        );
        registry.register(
            "lease_expiries",
            "Job leases taken back after they ran out (a worker died or stalled)",
            m.lease_expiries.clone(),
        );
        registry.register(
            "audit_errors",
            "Audits that could not run (the job is kept and retried)",
            m.audit_errors.clone(),
        );
        registry.register(
            "miner_cheat_rate",
            "Per miner: (cheat + unanswered) / judged verdicts (docs/PROTOCOL.md section 8)",
            m.miner_cheat_rate.clone(),
        );
        registry.register(
            "challenges",
            "Cell challenges (open_cells through the gateway) judged here, by outcome",
            m.challenges.clone(),
        );
        registry.register(
            "audit_passes",
            "TOPLOC recompute passes over the weights (a batch of one model's jobs is one pass)",
            m.audit_passes.clone(),
        );
        m
    }
}
