//! The miner's Prometheus metrics, scraped at `GET /metrics` on `--metrics-addr` (off by
//! default; served by [`engy_telemetry::metrics::serve`]). docs/MINER.md "Metrics" lists
//! them:
//!
//! * `engy_miner_requests_total{outcome}`: every `serve` frame by how it ended
//!   ([`Outcome`]);
//! * `engy_miner_serve_seconds`: serve frame → `response` frame of completed requests;
//! * `engy_miner_proof_build_seconds`: TOPLOC proof build time of one request (all its
//!   batches);
//! * `engy_miner_inflight`: requests being served, all legs;
//! * `engy_miner_legs_connected`: legs whose session is up (HELLO sent);
//! * `engy_miner_reconnects_total`: re-dials after a session ended or a dial failed;
//! * `engy_miner_traces_total{trace,outcome}`: per completed request and collected trace
//!   (`trace` = `routing` | `indexer`, docs/PROTOCOL.md §3.10), whether it was `attached`,
//!   or why not: `not_offered` (the serve lacks the flag), `missing` (asked, no field),
//!   `malformed`, `rows` (rows that do not line up); only kinds the settings and the
//!   checkpoint collect are counted;
//! * `engy_miner_cells_total{outcome}`: per completed request while cells are on
//!   (docs/PROTOCOL.md §10), whether its commitment carries `cells` (`attached`) or why
//!   not: `not_offered` (the serve was not started with the engy_cells hooks), `pass` (the
//!   commit pass failed), `spool` (nothing new, unreadable or inconsistent in the spool),
//!   `tokens` (the spooled pass ran another sequence), `retain` (larger than the retention
//!   budget);
//! * `engy_miner_cells_retained_requests`, `engy_miner_cells_retained_bytes`: what the
//!   retention store holds;
//! * `engy_miner_cells_evictions_total{reason}`: requests evicted from it, `age` or `size`;
//! * `engy_miner_cells_openings_total{outcome}`: `open_cells` frames answered: `ok`,
//!   `unknown_request`, `bad_challenge`;
//! * `engy_miner_build_info{version,commit,dirty}`: always 1, the running build
//!   ([`engy_telemetry::build_info`]).
use std::sync::Arc;
use std::time::Duration;

use engy_telemetry::prometheus_client::metrics::counter::Counter;
use engy_telemetry::prometheus_client::metrics::family::Family;
use engy_telemetry::prometheus_client::metrics::gauge::Gauge;
use engy_telemetry::prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use engy_telemetry::prometheus_client::registry::Registry;

/// How a `serve` ended (the `outcome` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A completion with its commitment.
    Completed,
    /// An error `response` (serve failure, misaligned rows, bad request).
    Failed,
    /// Stopped by the miner (SIGTERM drain timed out): an error `response`.
    Aborted,
    /// Cancelled by the gateway: nothing more was sent.
    Cancelled,
    /// Answered at once without serving: draining, or cancelled just before it arrived.
    Refused,
}

impl Outcome {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::Failed => "failed",
            Outcome::Aborted => "aborted",
            Outcome::Cancelled => "cancelled",
            Outcome::Refused => "refused",
        }
    }
}

type Labels = [(&'static str, &'static str); 1];
type TraceLabels = [(&'static str, &'static str); 2];

/// The `trace` label values of `engy_miner_traces_total`.
pub const TRACE_KINDS: [&str; 2] = ["routing", "indexer"];

/// The `outcome` label values of `engy_miner_traces_total`.
pub const TRACE_OUTCOMES: [&str; 5] = ["attached", "not_offered", "missing", "malformed", "rows"];

/// The `outcome` label values of `engy_miner_cells_total`.
pub const CELLS_OUTCOMES: [&str; 6] = [
    "attached",
    "not_offered",
    "pass",
    "spool",
    "tokens",
    "retain",
];

/// The `reason` label values of `engy_miner_cells_evictions_total`.
pub const CELLS_EVICTIONS: [&str; 2] = ["age", "size"];

/// The `outcome` label values of `engy_miner_cells_openings_total`.
pub const CELLS_OPENINGS: [&str; 3] = ["ok", "unknown_request", "bad_challenge"];

/// Every metric of the miner, registered in one [`Registry`] (prefix `engy_miner`).
#[derive(Debug)]
pub struct Metrics {
    requests: Family<Labels, Counter>,
    serve_seconds: Histogram,
    proof_build_seconds: Histogram,
    inflight: Gauge,
    legs_connected: Gauge,
    reconnects: Counter,
    traces: Family<TraceLabels, Counter>,
    cells: Family<Labels, Counter>,
    cells_retained_requests: Gauge,
    cells_retained_bytes: Gauge,
    cells_evictions: Family<Labels, Counter>,
    cells_openings: Family<Labels, Counter>,
    registry: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics, all zero.
    pub fn new() -> Self {
        let requests = Family::<Labels, Counter>::default();
        // 10 ms … ~164 s: a short completion to a long generation.
        let serve_seconds = Histogram::new(exponential_buckets(0.01, 2.0, 15));
        // 0.1 ms … ~1.6 s per request.
        let proof_build_seconds = Histogram::new(exponential_buckets(0.0001, 2.0, 15));
        let inflight = Gauge::default();
        let legs_connected = Gauge::default();
        let reconnects = Counter::default();
        let traces = Family::<TraceLabels, Counter>::default();
        let mut r = Registry::with_prefix("engy_miner");
        engy_telemetry::build_info::register(&mut r, &engy_telemetry::build_info::BUILD);
        r.register(
            "requests",
            "Gateway serve frames by how they ended",
            requests.clone(),
        );
        r.register(
            "serve_seconds",
            "Serve frame to response frame, completed requests",
            serve_seconds.clone(),
        );
        r.register(
            "proof_build_seconds",
            "TOPLOC proof build time of one request",
            proof_build_seconds.clone(),
        );
        r.register("inflight", "Requests being served", inflight.clone());
        r.register(
            "legs_connected",
            "Gateway legs with a live session",
            legs_connected.clone(),
        );
        r.register(
            "reconnects",
            "Gateway re-dials after a session ended or a dial failed",
            reconnects.clone(),
        );
        r.register(
            "traces",
            "Completed requests by collected trace and whether it was attached (else why not)",
            traces.clone(),
        );
        let cells = Family::<Labels, Counter>::default();
        let cells_retained_requests = Gauge::default();
        let cells_retained_bytes = Gauge::default();
        let cells_evictions = Family::<Labels, Counter>::default();
        let cells_openings = Family::<Labels, Counter>::default();
        r.register(
            "cells",
            "Completed requests while cells are on: cells attached to the commitment, else why not",
            cells.clone(),
        );
        r.register(
            "cells_retained_requests",
            "Requests whose cells the retention store holds",
            cells_retained_requests.clone(),
        );
        r.register(
            "cells_retained_bytes",
            "Bytes the retention store holds (cells and their trees)",
            cells_retained_bytes.clone(),
        );
        r.register(
            "cells_evictions",
            "Requests evicted from the cells retention store, by reason",
            cells_evictions.clone(),
        );
        r.register(
            "cells_openings",
            "open_cells frames answered, by outcome",
            cells_openings.clone(),
        );
        for (family, key, values) in [
            (&cells, "outcome", &CELLS_OUTCOMES[..]),
            (&cells_evictions, "reason", &CELLS_EVICTIONS[..]),
            (&cells_openings, "outcome", &CELLS_OPENINGS[..]),
        ] {
            for v in values {
                let _ = family.get_or_create(&[(key, v)]);
            }
        }
        for t in TRACE_KINDS {
            for o in TRACE_OUTCOMES {
                let _ = traces.get_or_create(&[("trace", t), ("outcome", o)]);
            }
        }
        for o in [
            Outcome::Completed,
            Outcome::Failed,
            Outcome::Aborted,
            Outcome::Cancelled,
            Outcome::Refused,
        ] {
            // Every outcome is scraped from the start (0), so rates need no absent series.
            let _ = requests.get_or_create(&[("outcome", o.as_str())]);
        }
        Self {
            requests,
            serve_seconds,
            proof_build_seconds,
            inflight,
            legs_connected,
            reconnects,
            traces,
            cells,
            cells_retained_requests,
            cells_retained_bytes,
            cells_evictions,
            cells_openings,
            registry: Arc::new(r),
        }
    }

    /// The registry to serve.
    pub fn registry(&self) -> Arc<Registry> {
        Arc::clone(&self.registry)
    }

    /// A `serve` ended with `outcome`.
    pub fn request(&self, outcome: Outcome) {
        self.requests
            .get_or_create(&[("outcome", outcome.as_str())])
            .inc();
    }

    /// A completed request took `d` from its serve frame to its response frame.
    pub fn served_in(&self, d: Duration) {
        self.serve_seconds.observe(d.as_secs_f64());
    }

    /// One request's proof took `d` to build.
    pub fn proof_built_in(&self, d: Duration) {
        self.proof_build_seconds.observe(d.as_secs_f64());
    }

    /// Requests being served now.
    pub fn set_inflight(&self, n: usize) {
        self.inflight.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A leg's session came up (`+1`) or ended (`-1`).
    pub fn leg_up(&self, up: bool) {
        if up {
            self.legs_connected.inc();
        } else {
            self.legs_connected.dec();
        }
    }

    /// A completed request's `trace` (a [`TRACE_KINDS`] value) ended with `outcome` (a
    /// [`TRACE_OUTCOMES`] value; anything else is not counted, so the label set stays
    /// closed).
    pub fn trace(&self, trace: &'static str, outcome: &'static str) {
        if TRACE_KINDS.contains(&trace) && TRACE_OUTCOMES.contains(&outcome) {
            self.traces
                .get_or_create(&[("trace", trace), ("outcome", outcome)])
                .inc();
        }
    }

    /// A completed request's cells ended with `outcome` (a [`CELLS_OUTCOMES`] value; others
    /// are not counted).
    pub fn cells(&self, outcome: &'static str) {
        if CELLS_OUTCOMES.contains(&outcome) {
            self.cells.get_or_create(&[("outcome", outcome)]).inc();
        }
    }

    /// The retention store now holds `requests` requests, `bytes` bytes.
    pub fn cells_retained(&self, requests: usize, bytes: u64) {
        self.cells_retained_requests
            .set(i64::try_from(requests).unwrap_or(i64::MAX));
        self.cells_retained_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A request was evicted for `reason` (a [`CELLS_EVICTIONS`] value).
    pub fn cells_evicted(&self, reason: &'static str) {
        if CELLS_EVICTIONS.contains(&reason) {
            self.cells_evictions
                .get_or_create(&[("reason", reason)])
                .inc();
        }
    }

    /// An `open_cells` was answered with `outcome` (a [`CELLS_OPENINGS`] value).
    pub fn cells_opening(&self, outcome: &'static str) {
        if CELLS_OPENINGS.contains(&outcome) {
            self.cells_openings
                .get_or_create(&[("outcome", outcome)])
                .inc();
        }
    }

    /// Evictions counted for `reason` so far.
    pub fn cells_evictions(&self, reason: &'static str) -> u64 {
        self.cells_evictions
            .get_or_create(&[("reason", reason)])
            .get()
    }

    /// `open_cells` answers counted with `outcome` so far.
    pub fn cells_openings(&self, outcome: &'static str) -> u64 {
        self.cells_openings
            .get_or_create(&[("outcome", outcome)])
            .get()
    }

    /// A leg re-dials.
    pub fn reconnect(&self) {
        self.reconnects.inc();
    }
}
