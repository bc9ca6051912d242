//! The validator's Prometheus metrics (`--metrics-addr`, served by `engy_telemetry::metrics`
//! as OpenMetrics or, on `Accept: text/plain;version=0.0.4`, the 0.0.4 text format).
//!
//! Names carry the `engy_validator_` prefix; prometheus-client appends `_total` to counters.
//! Every metric answers one operator question: is it ticking (`ticks_total{outcome}`), is
//! anything landing (`landings_total`, `last_landing_block`, `last_landing_age_seconds`,
//! `blocks_since_landing` against `activity_cutoff`), why not (`chain_errors_total{kind}`,
//! `provider_errors_total{kind}`), on which epoch (`epoch`) and runtime (`spec_version`,
//! `transaction_version`), under commit-reveal (`commits_total`, `reveals_total{result}`), and which
//! build runs (`build_info{version,commit,dirty}`, always 1).
//!
//! Label values come only from the closed sets below ([`OUTCOMES`], [`CHAIN_ERROR_KINDS`]
//! plus `dispatch:<Pallet>.<Error>` with metadata identifiers, [`PROVIDER_ERROR_KINDS`],
//! [`REVEAL_RESULTS`]); anything else is counted as `other`. Every series of these sets is
//! created at start-up, so it is scraped at 0 before its first event (issue 21 items 1–2).

use engy_telemetry::metrics::{labels, Labels};
use engy_telemetry::prometheus_client::metrics::counter::Counter;
use engy_telemetry::prometheus_client::metrics::family::Family;
use engy_telemetry::prometheus_client::metrics::gauge::Gauge;
use engy_telemetry::prometheus_client::registry::Registry;

/// Every tick outcome ([`crate::daemon::TickReport::outcome`]).
pub const OUTCOMES: &[&str] = &[
    "submitted",
    "skipped",
    "failed",
    "nothing",
    "replay",
    "chain-down",
    "committed",
    "refused",
    "rate-limited",
    "reconciled",
    "blocked",
    "backing-off",
];

/// The kinds of chain failure besides `dispatch:<Pallet>.<Error>`: reading
/// ([`crate::chain::ChainError::kind`]) and submitting ([`crate::chain::SubmitError::kind`]).
pub const CHAIN_ERROR_KINDS: &[&str] = &[
    "unreachable",
    "read",
    "timeout",
    "transport",
    "pool-rejected",
    "ancient-birth-block",
    "outdated",
    "not-included",
    "build",
    "missing-call",
    "dispatch-other",
    "other",
];

/// The kinds of provider failure: the fetch (`http-4xx`, `http-5xx`, `http-other`,
/// `transport`, `too-large`) and the payload's rejection reason word (PROTOCOL.md §6).
pub const PROVIDER_ERROR_KINDS: &[&str] = &[
    "http-4xx",
    "http-5xx",
    "http-other",
    "transport",
    "too-large",
    "malformed",
    "version",
    "netuid",
    "digest",
    "signature",
    "other",
];

/// The results of a reveal check.
pub const REVEAL_RESULTS: &[&str] = &["revealed", "not_revealed"];

/// `kind` when it is one of `set` or a `dispatch:<Pallet>.<Error>` of two identifiers
/// (at most 64 ASCII letters, digits or `_` each), else `other`: no free text becomes a
/// label value.
pub fn closed_kind<'a>(kind: &'a str, set: &[&str]) -> &'a str {
    let ident = |s: &str| {
        !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
    };
    let dispatch = kind
        .strip_prefix("dispatch:")
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(p, e)| ident(p) && ident(e));
    if set.contains(&kind) || dispatch {
        kind
    } else {
        "other"
    }
}

/// The validator's metrics; cheap to clone (every metric is an `Arc` inside).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    ticks: Family<Labels, Counter>,
    landings: Counter,
    last_landing_block: Gauge,
    last_landing_age: Gauge,
    blocks_since_landing: Gauge,
    activity_cutoff: Gauge,
    chain_errors: Family<Labels, Counter>,
    provider_errors: Family<Labels, Counter>,
    epoch: Gauge,
    spec_version: Gauge,
    transaction_version: Gauge,
    commits: Counter,
    reveals: Family<Labels, Counter>,
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl Metrics {
    /// New metrics, registered in `registry` under the `engy_validator` prefix, every
    /// series of the closed label sets present at 0.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("engy_validator");
        engy_telemetry::build_info::register(r, &engy_telemetry::build_info::BUILD);
        r.register(
            "ticks",
            "Completed ticks by outcome (submitted, skipped, failed, nothing, replay, chain-down, committed, refused, rate-limited, reconciled, blocked, backing-off)",
            m.ticks.clone(),
        );
        r.register(
            "landings",
            "Weights this validator landed on chain (set_weights included without ExtrinsicFailed, or a landing found on chain and recorded)",
            m.landings.clone(),
        );
        r.register(
            "last_landing_block",
            "Block anchoring the last landing (the state file's last_submit_block); 0 before the first",
            m.last_landing_block.clone(),
        );
        r.register(
            "last_landing_age_seconds",
            "Seconds since the last landing recorded in the state file, as of the last tick",
            m.last_landing_age.clone(),
        );
        r.register(
            "blocks_since_landing",
            "Blocks since the chain last took this validator's weights (head minus its LastUpdate; by the wall clock from the state file when the chain was not read), as of the last tick; alert when above activity_cutoff / 2",
            m.blocks_since_landing.clone(),
        );
        r.register(
            "activity_cutoff",
            "The subnet's activity_cutoff in blocks as last read from the chain (0 before the first read): a validator silent for longer leaves consensus",
            m.activity_cutoff.clone(),
        );
        r.register(
            "chain_errors",
            "Chain failures by kind (unreachable, read, timeout, transport, pool-rejected, ancient-birth-block, outdated, not-included, build, missing-call, dispatch-other, dispatch:<Pallet>.<Error>, other)",
            m.chain_errors.clone(),
        );
        r.register(
            "provider_errors",
            "Provider failures by kind (fetch: http-4xx, http-5xx, http-other, transport, too-large; rejected payload: malformed, version, netuid, digest, signature)",
            m.provider_errors.clone(),
        );
        r.register(
            "epoch",
            "The epoch of the vector the last tick worked with",
            m.epoch.clone(),
        );
        r.register(
            "spec_version",
            "The chain runtime's spec_version as last read (0 before the first connection)",
            m.spec_version.clone(),
        );
        r.register(
            "transaction_version",
            "The chain runtime's transaction_version as last read (0 before the first connection)",
            m.transaction_version.clone(),
        );
        r.register(
            "commits",
            "Commit-reveal: timelocked commits included",
            m.commits.clone(),
        );
        r.register(
            "reveals",
            "Commit-reveal: reveal checks by result (revealed, not_revealed)",
            m.reveals.clone(),
        );
        for &o in OUTCOMES {
            let _ = m.ticks.get_or_create(&labels(&[("outcome", o)]));
        }
        for &k in CHAIN_ERROR_KINDS {
            let _ = m.chain_errors.get_or_create(&labels(&[("kind", k)]));
        }
        for &k in PROVIDER_ERROR_KINDS {
            let _ = m.provider_errors.get_or_create(&labels(&[("kind", k)]));
        }
        for &r in REVEAL_RESULTS {
            let _ = m.reveals.get_or_create(&labels(&[("result", r)]));
        }
        m
    }

    /// A completed tick with `outcome` (one of [`OUTCOMES`]).
    pub fn tick(&self, outcome: &str) {
        let outcome = if OUTCOMES.contains(&outcome) {
            outcome
        } else {
            "other"
        };
        self.ticks
            .get_or_create(&labels(&[("outcome", outcome)]))
            .inc();
        match outcome {
            "submitted" | "reconciled" => {
                self.landings.inc();
            }
            "committed" => {
                self.commits.inc();
            }
            _ => {}
        }
    }

    /// The last landing as the state file records it (`None`: nothing landed yet).
    pub fn last_landing(&self, block: Option<u64>, ts: Option<u64>, now: u64) {
        if let Some(b) = block {
            self.last_landing_block.set(to_i64(b));
        }
        if let Some(ts) = ts {
            self.last_landing_age.set(to_i64(now.saturating_sub(ts)));
        }
    }

    /// Blocks since the last landing and the subnet's `activity_cutoff`, when known.
    pub fn landing_gap(&self, blocks_since: Option<u64>, activity_cutoff: Option<u64>) {
        if let Some(b) = blocks_since {
            self.blocks_since_landing.set(to_i64(b));
        }
        if let Some(c) = activity_cutoff {
            self.activity_cutoff.set(to_i64(c));
        }
    }

    /// A chain failure of `kind` ([`closed_kind`] of [`CHAIN_ERROR_KINDS`]).
    pub fn chain_error(&self, kind: &str) {
        let kind = closed_kind(kind, CHAIN_ERROR_KINDS);
        self.chain_errors
            .get_or_create(&labels(&[("kind", kind)]))
            .inc();
    }

    /// A provider failure of `kind` (one of [`PROVIDER_ERROR_KINDS`], else `other`).
    pub fn provider_error(&self, kind: &str) {
        let kind = if PROVIDER_ERROR_KINDS.contains(&kind) {
            kind
        } else {
            "other"
        };
        self.provider_errors
            .get_or_create(&labels(&[("kind", kind)]))
            .inc();
    }

    /// The epoch of the vector in hand.
    pub fn epoch(&self, epoch: u64) {
        self.epoch.set(to_i64(epoch));
    }

    /// The runtime version of the chain as last read.
    pub fn runtime(&self, spec_version: u32, transaction_version: u32) {
        self.spec_version.set(i64::from(spec_version));
        self.transaction_version.set(i64::from(transaction_version));
    }

    /// A reveal check: `revealed` or not.
    pub fn reveal(&self, revealed: bool) {
        let result = if revealed { "revealed" } else { "not_revealed" };
        self.reveals
            .get_or_create(&labels(&[("result", result)]))
            .inc();
    }
}

/// The `kind` of a provider fetch failure of HTTP status `code`.
pub fn http_kind(code: u16) -> &'static str {
    match code {
        400..=499 => "http-4xx",
        500..=599 => "http-5xx",
        _ => "http-other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_as_scraped() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        m.tick("submitted");
        m.tick("committed");
        m.tick("chain-down");
        m.chain_error("dispatch:SubtensorModule.SettingWeightsTooFast");
        m.chain_error("User error: {\"invalid\":{\"ancientBirthBlock\":null}} (1010)");
        m.chain_error("dispatch:Sub tensor.X\"");
        m.provider_error(http_kind(500));
        m.provider_error("malformed");
        m.epoch(812);
        m.last_landing(Some(5_123_456), Some(1_000), 1_030);
        m.landing_gap(Some(2_600), Some(5_000));
        m.runtime(293, 1);
        m.reveal(false);
        let text = engy_telemetry::metrics::encode(&registry).unwrap();
        for want in [
            "engy_validator_ticks_total{outcome=\"submitted\"} 1",
            "engy_validator_ticks_total{outcome=\"chain-down\"} 1",
            "engy_validator_ticks_total{outcome=\"replay\"} 0",
            "engy_validator_landings_total 1",
            "engy_validator_commits_total 1",
            "engy_validator_chain_errors_total{kind=\"dispatch:SubtensorModule.SettingWeightsTooFast\"} 1",
            "engy_validator_chain_errors_total{kind=\"other\"} 2",
            "engy_validator_chain_errors_total{kind=\"ancient-birth-block\"} 0",
            "engy_validator_provider_errors_total{kind=\"http-5xx\"} 1",
            "engy_validator_provider_errors_total{kind=\"malformed\"} 1",
            "engy_validator_provider_errors_total{kind=\"transport\"} 0",
            "engy_validator_epoch 812",
            "engy_validator_last_landing_block 5123456",
            "engy_validator_last_landing_age_seconds 30",
            "engy_validator_blocks_since_landing 2600",
            "engy_validator_activity_cutoff 5000",
            "engy_validator_spec_version 293",
            "engy_validator_reveals_total{result=\"not_revealed\"} 1",
            "engy_validator_reveals_total{result=\"revealed\"} 0",
        ] {
            assert!(text.contains(want), "{want} not in:\n{text}");
        }
    }
}
