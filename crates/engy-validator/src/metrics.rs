//! The validator's Prometheus metrics (`--metrics-addr`, served by `engy_telemetry::metrics`).
//!
//! Names carry the `engy_validator_` prefix; prometheus-client appends `_total` to counters.
//! Every metric answers one operator question: is it ticking (`ticks_total{outcome}`), is
//! anything landing (`landings_total`, `last_landing_block`, `last_landing_age_seconds`), why
//! not (`chain_errors_total{name}`, `provider_errors_total{name}`), on which epoch
//! (`epoch`), and under commit-reveal (`commits_total`, `reveals_total{result}`); which
//! build runs (`build_info{version,commit,dirty}`, always 1).

use engy_telemetry::prometheus_client::metrics::counter::Counter;
use engy_telemetry::prometheus_client::metrics::family::Family;
use engy_telemetry::prometheus_client::metrics::gauge::Gauge;
use engy_telemetry::prometheus_client::registry::Registry;

/// One label `(name, value)`.
type Label = Vec<(String, String)>;

fn label(key: &str, value: &str) -> Label {
    vec![(key.to_owned(), value.to_owned())]
}

/// The validator's metrics; cheap to clone (every metric is an `Arc` inside).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    ticks: Family<Label, Counter>,
    landings: Counter,
    last_landing_block: Gauge,
    last_landing_age: Gauge,
    chain_errors: Family<Label, Counter>,
    provider_errors: Family<Label, Counter>,
    epoch: Gauge,
    commits: Counter,
    reveals: Family<Label, Counter>,
}

impl Metrics {
    /// New metrics, registered in `registry` under the `engy_validator` prefix.
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics::default();
        let r = registry.sub_registry_with_prefix("engy_validator");
        engy_telemetry::build_info::register(r, &engy_telemetry::build_info::BUILD);
        r.register(
            "ticks",
            "Completed ticks by outcome (submitted, skipped, failed, nothing, replay, chain-down, committed, refused, rate-limited, reconciled, blocked)",
            m.ticks.clone(),
        );
        r.register(
            "landings",
            "Weights this validator landed on chain (set_weights included without ExtrinsicFailed, or a landing found on chain and recorded)",
            m.landings.clone(),
        );
        r.register(
            "last_landing_block",
            "Block anchoring the last landing (the state file's last_submit_block)",
            m.last_landing_block.clone(),
        );
        r.register(
            "last_landing_age_seconds",
            "Seconds since the last landing recorded in the state file, as of the last tick",
            m.last_landing_age.clone(),
        );
        r.register(
            "chain_errors",
            "Chain failures by name (unreachable, read, or the runtime's error name such as SettingWeightsTooFast or Custom(6))",
            m.chain_errors.clone(),
        );
        r.register(
            "provider_errors",
            "Provider failures by name (fetch: http_<status>, transport, too_large; rejected: the payload reason word)",
            m.provider_errors.clone(),
        );
        r.register(
            "epoch",
            "The epoch of the vector the last tick worked with",
            m.epoch.clone(),
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
        m
    }

    /// A completed tick with `outcome`.
    pub fn tick(&self, outcome: &str) {
        self.ticks.get_or_create(&label("outcome", outcome)).inc();
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
            self.last_landing_block
                .set(i64::try_from(b).unwrap_or(i64::MAX));
        }
        if let Some(ts) = ts {
            self.last_landing_age
                .set(i64::try_from(now.saturating_sub(ts)).unwrap_or(i64::MAX));
        }
    }

    /// A chain failure named `name`.
    pub fn chain_error(&self, name: &str) {
        self.chain_errors.get_or_create(&label("name", name)).inc();
    }

    /// A provider failure named `name`.
    pub fn provider_error(&self, name: &str) {
        self.provider_errors
            .get_or_create(&label("name", name))
            .inc();
    }

    /// The epoch of the vector in hand.
    pub fn epoch(&self, epoch: u64) {
        self.epoch.set(i64::try_from(epoch).unwrap_or(i64::MAX));
    }

    /// A reveal check: `revealed` or not.
    pub fn reveal(&self, revealed: bool) {
        let result = if revealed { "revealed" } else { "not_revealed" };
        self.reveals.get_or_create(&label("result", result)).inc();
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
        m.chain_error("SettingWeightsTooFast");
        m.provider_error("http_500");
        m.provider_error("malformed");
        m.epoch(812);
        m.last_landing(Some(5_123_456), Some(1_000), 1_030);
        m.reveal(false);
        let text = engy_telemetry::metrics::encode(&registry).unwrap();
        for want in [
            "engy_validator_ticks_total{outcome=\"submitted\"} 1",
            "engy_validator_ticks_total{outcome=\"chain-down\"} 1",
            "engy_validator_landings_total 1",
            "engy_validator_commits_total 1",
            "engy_validator_chain_errors_total{name=\"SettingWeightsTooFast\"} 1",
            "engy_validator_provider_errors_total{name=\"http_500\"} 1",
            "engy_validator_provider_errors_total{name=\"malformed\"} 1",
            "engy_validator_epoch 812",
            "engy_validator_last_landing_block 5123456",
            "engy_validator_last_landing_age_seconds 30",
            "engy_validator_reveals_total{result=\"not_revealed\"} 1",
        ] {
            assert!(text.contains(want), "{want} not in:\n{text}");
        }
    }
}
