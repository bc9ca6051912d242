//! The tick loop (PROTOCOL.md §7): I/O at the edges, decisions in [`crate::schedule`].
//!
//! Each tick prints exactly one line saying what happened and when the validator acts next,
//! and stamps the heartbeat file however it turned out.

use std::time::Duration;

use engy_core::keys::Hotkey;

use crate::chain::{self, Chain, Sr25519Signer};
use crate::commit_record::{self, CommitRecord};
use crate::commit_reveal::{self, Submission};
use crate::config::Settings;
use crate::schedule::{self, Decision, EpochRelation, Plan, Source};
use crate::state::{self, State};
use crate::timelock::{self, WeightsTlockPayload};

/// The `version_key` sent with `set_weights` (PROTOCOL.md §7 step 8).
pub const VERSION_KEY: u64 = 0;

/// Unix milliseconds now.
fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The wallet hotkey as a chain signer.
pub struct HotkeySigner<'a>(pub &'a Hotkey);

impl Sr25519Signer for HotkeySigner<'_> {
    fn public_key(&self) -> [u8; 32] {
        self.0.public_key()
    }
    fn sign(&self, message: &[u8]) -> [u8; 64] {
        self.0.sign(message)
    }
}

/// Severity of a tick's line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    /// Healthy outcome (submitted, skipped on schedule, provider outage with cache).
    Info,
    /// Something the operator may need to look at (a failed submit, a rejected payload).
    Warn,
    /// Nothing lands until the operator (or the provider) acts: the replay guard refusing
    /// every payload, the last landing nearing `activity_cutoff`.
    Error,
}

/// The diagnosis of a state file whose `last_applied` epoch is ahead of the provider's
/// verified `epoch` (the replay guard, PROTOCOL.md §7 step 2, then refuses every payload
/// and nothing lands), with both recoveries; `None` when the epoch is not older.
pub fn replay_diagnosis(
    epoch: u64,
    last_applied: Option<u64>,
    state_file: &std::path::Path,
) -> Option<String> {
    let last = last_applied.filter(|l| *l > epoch)?;
    Some(format!(
        "state file {path}: last_applied epoch {last} is {gap} epoch(s) ahead of the provider's verified epoch {epoch}: the replay guard refuses every payload older than {last}, so NOTHING LANDS (the cached vector is not resubmitted either); if this state file came from another network or netuid, or is damaged, move it aside and restart (mv {path} {path}.bak); if the provider is behind, nothing lands until it serves an epoch above {last}",
        path = state_file.display(),
        gap = last - epoch,
    ))
}

/// The one line announcing a runtime upgrade between two connections, `None` when the
/// runtime is the same: `runtime upgraded: spec 218 → 293, transaction_version 1 → 1;
/// transaction extensions changed: added X, removed Y` (or `unchanged: …`). Inputs are
/// `(spec_version, transaction_version, extension names in order)`.
pub fn runtime_change(
    before: &(u32, u32, Vec<String>),
    now: &(u32, u32, Vec<String>),
) -> Option<String> {
    if before == now {
        return None;
    }
    let (spec0, tx0, ext0) = before;
    let (spec1, tx1, ext1) = now;
    let what = if spec0 == spec1 {
        format!("runtime changed at spec {spec1}")
    } else {
        format!("runtime upgraded: spec {spec0} → {spec1}")
    };
    let exts = if ext0 == ext1 {
        format!(
            "transaction extensions unchanged ({}): the extrinsic is built as before",
            ext1.join(", ")
        )
    } else {
        let added: Vec<&str> = ext1
            .iter()
            .filter(|e| !ext0.contains(e))
            .map(String::as_str)
            .collect();
        let removed: Vec<&str> = ext0
            .iter()
            .filter(|e| !ext1.contains(e))
            .map(String::as_str)
            .collect();
        let mut parts = Vec::new();
        if !added.is_empty() {
            parts.push(format!("added {}", added.join(", ")));
        }
        if !removed.is_empty() {
            parts.push(format!("removed {}", removed.join(", ")));
        }
        if parts.is_empty() {
            parts.push("reordered".to_owned());
        }
        format!(
            "transaction extensions CHANGED ({}): the extrinsic is now built with {}",
            parts.join("; "),
            ext1.join(", ")
        )
    };
    Some(format!("{what}, transaction_version {tx0} → {tx1}; {exts}"))
}

/// `dropped N unregistered hotkey(s) holding X% of the weight: 5Abc…wxyz=123,…` (§7 step 5:
/// log the dropped hotkeys and their weight share), empty when none was dropped.
fn dropped_note(r: &schedule::Resolved) -> Option<String> {
    (!r.dropped.is_empty()).then(|| {
        format!(
            "dropped {} unregistered hotkey(s) holding {:.1}% of the weight: {}",
            r.dropped.len(),
            r.dropped_share * 100.0,
            r.dropped
                .iter()
                .map(|(h, w)| format!("{}={w}", short(h)))
                .collect::<Vec<_>>()
                .join(",")
        )
    })
}

/// What one tick did: the one log line and what it means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickReport {
    /// Severity.
    pub level: Level,
    /// The line (what happened; when the validator acts next).
    pub line: String,
    /// Short outcome word for tests and metrics: `submitted`, `skipped`, `failed`,
    /// `nothing`, `replay`, `chain-down`, `committed` (a timelocked commit, not yet revealed).
    pub outcome: &'static str,
}

/// The longest wait of the dispatch backoff in seconds (the poll interval when longer).
pub const BACKOFF_CAP_S: u64 = 3600;

/// The backoff cap for `poll_s`: [`BACKOFF_CAP_S`], or `poll_s` when that is longer.
pub fn backoff_cap(poll_s: u64) -> u64 {
    BACKOFF_CAP_S.max(poll_s)
}

/// Seconds to wait after the `failures`-th dispatch failure in a row: `poll_s × 2^failures`,
/// capped at [`backoff_cap`] (1 failure: skip one poll; 2: three; …).
pub fn backoff_delay(poll_s: u64, failures: u32) -> u64 {
    poll_s
        .saturating_mul(1u64 << failures.min(32))
        .min(backoff_cap(poll_s))
}

/// True for a failure that dispatched (included, `ExtrinsicFailed`) and will fail the same
/// way until something changes: not the rate limits, which have their own wait
/// (`LastUpdate + WeightsSetRateLimit`), and not a commit-reveal switch, which the next
/// tick follows.
fn backs_off(e: &chain::SubmitError) -> bool {
    match e {
        chain::SubmitError::Dispatch { name, .. } => !matches!(
            name.as_str(),
            "SettingWeightsTooFast"
                | "CommittingWeightsTooFast"
                | "CommitRevealEnabled"
                | "CommitRevealDisabled"
        ),
        chain::SubmitError::DispatchOther(_) => true,
        _ => false,
    }
}

/// Consecutive dispatch failures of this process (issue 21 item 6).
#[derive(Debug, Default, Clone)]
struct Backoff {
    /// Failures in a row (0: no backoff).
    failures: u32,
    /// Unix seconds before which nothing is sent.
    next_try: u64,
    /// The epoch and hyperparameters of the last failure.
    epoch: u64,
    hp: Option<chain::Hyperparams>,
    /// The runtime's name of the last failure.
    last_error: String,
}

impl Backoff {
    /// Records a failure at `now`; returns the wait before the next try.
    fn fail(
        &mut self,
        epoch: u64,
        hp: &chain::Hyperparams,
        now: u64,
        poll_s: u64,
        name: &str,
    ) -> u64 {
        self.failures = self.failures.saturating_add(1);
        let wait = backoff_delay(poll_s, self.failures);
        self.next_try = now.saturating_add(wait);
        self.epoch = epoch;
        self.hp = Some(*hp);
        self.last_error = name.to_owned();
        wait
    }

    /// Why the backoff no longer holds: a new epoch or a changed hyperparameter.
    fn reset_by(&self, epoch: u64, hp: &chain::Hyperparams) -> Option<String> {
        if self.failures == 0 {
            return None;
        }
        if epoch != self.epoch {
            return Some(format!(
                "new epoch {epoch}, the failure was at epoch {}",
                self.epoch
            ));
        }
        let before = self.hp.as_ref()?;
        (before != hp).then(|| format!("hyperparameters changed: {}", hp_diff(before, hp)))
    }

    /// Seconds left to wait at `now`, `None` when a submission may go out.
    fn wait(&self, now: u64) -> Option<u64> {
        (self.failures > 0 && now < self.next_try).then(|| self.next_try - now)
    }
}

/// `weights_version_key 5 → 0, …`: the hyperparameters that differ.
fn hp_diff(a: &chain::Hyperparams, b: &chain::Hyperparams) -> String {
    let mut out = Vec::new();
    let mut cmp = |name: &str, x: String, y: String| {
        if x != y {
            out.push(format!("{name} {x} → {y}"));
        }
    };
    cmp(
        "weights_rate_limit",
        a.weights_rate_limit.to_string(),
        b.weights_rate_limit.to_string(),
    );
    cmp(
        "min_allowed_weights",
        a.min_allowed_weights.to_string(),
        b.min_allowed_weights.to_string(),
    );
    cmp(
        "max_weight_limit",
        a.max_weight_limit.to_string(),
        b.max_weight_limit.to_string(),
    );
    cmp(
        "commit_reveal_weights_enabled",
        a.commit_reveal_weights_enabled.to_string(),
        b.commit_reveal_weights_enabled.to_string(),
    );
    cmp(
        "activity_cutoff",
        a.activity_cutoff.to_string(),
        b.activity_cutoff.to_string(),
    );
    cmp(
        "weights_version_key",
        a.weights_version_key.to_string(),
        b.weights_version_key.to_string(),
    );
    cmp(
        "weights_min_stake",
        a.weights_min_stake.to_string(),
        b.weights_min_stake.to_string(),
    );
    out.join(", ")
}

/// Blocks since the last landing and how that was found.
struct LandingGap {
    since: u64,
    what: String,
}

/// The vector a tick works with.
struct Vector {
    epoch: u64,
    weights: Vec<(String, u16)>,
    digest: Option<String>,
    source: Source,
    /// Why the payload was not used (fetch failure / rejection), when falling back.
    fallback_reason: Option<String>,
}

/// The long-lived daemon state (settings, key, HTTP client, one-shot notices).
pub struct Daemon {
    settings: Settings,
    hotkey: Hotkey,
    http: reqwest::Client,
    extensions_checked: bool,
    /// Set by [`run`] before the last of `--ticks N`: the line then says the process exits
    /// instead of naming a poll that never comes.
    final_tick: bool,
    /// The subnet's `ActivityCutoff` as last read (kept for ticks that cannot reach the chain).
    activity_cutoff: Option<u16>,
    /// What this tick read of the validator's own activity: `(head, LastUpdate)`.
    view: Option<(u64, u64)>,
    /// The epoch and reason of the last vector refused by the subnet's weight rules, so the
    /// reason is logged in full once per epoch.
    refused: Option<(u64, String)>,
    /// Metrics, when `--metrics-addr` serves them.
    metrics: Option<crate::metrics::Metrics>,
    /// What the last tick knew of the landings (written to the heartbeat file).
    landing: crate::liveness::Landing,
    /// The runtime of the last connection: `(spec_version, transaction_version, extension
    /// names)`, to announce a runtime upgrade once.
    runtime: Option<(u32, u32, Vec<String>)>,
    /// True once this tick has sent an extrinsic (read after a signal abandons the tick).
    sent: bool,
    /// Consecutive dispatch failures and when the next attempt is allowed.
    backoff: Backoff,
}

fn short(hk: &str) -> String {
    match (hk.get(..6), hk.len() > 12) {
        (Some(head), true) => format!("{head}…{}", hk.get(hk.len() - 4..).unwrap_or("")),
        _ => hk.to_owned(),
    }
}

impl Daemon {
    /// A daemon for `settings` signing with `hotkey`.
    pub fn new(settings: Settings, hotkey: Hotkey) -> anyhow::Result<Daemon> {
        Ok(Daemon {
            settings,
            hotkey,
            http: crate::provider::client()?,
            extensions_checked: false,
            final_tick: false,
            activity_cutoff: None,
            view: None,
            refused: None,
            metrics: None,
            landing: crate::liveness::Landing::default(),
            runtime: None,
            sent: false,
            backoff: Backoff::default(),
        })
    }

    /// Records every tick in `metrics` (served by `--metrics-addr`).
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Daemon {
        self.metrics = Some(metrics);
        self
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    fn next_poll(&self) -> String {
        if self.final_tick {
            "--ticks limit reached, exiting".to_owned()
        } else {
            format!("next poll in {} s", self.settings.poll_s)
        }
    }

    fn retry(&self) -> String {
        if self.final_tick {
            "no retry (--ticks limit reached, exiting)".to_owned()
        } else {
            format!("retry next poll in {} s", self.settings.poll_s)
        }
    }

    /// Reports the chain's runtime: at the first connection its spec and transaction
    /// versions and the transaction extensions (naming any this client cannot encode);
    /// afterwards, once per change, a runtime upgrade seen under the running validator
    /// ([`runtime_change`]: old → new spec, and whether the extrinsic's extensions changed).
    /// The versions are also the `spec_version` / `transaction_version` metrics.
    pub fn report_extensions(&mut self, chain: &Chain) {
        let md = chain.metadata();
        let (spec, txv) = chain.runtime_version();
        let names = chain::extension_names(&md);
        if let Some(m) = &self.metrics {
            m.runtime(spec, txv);
        }
        let now = (spec, txv, names.clone());
        let before = self.runtime.replace(now.clone());
        if let Some(line) = before.as_ref().and_then(|b| runtime_change(b, &now)) {
            let bad = chain::unsupported_extensions(&md);
            if bad.is_empty() {
                tracing::warn!("chain {}: {line}", chain.url());
            } else {
                tracing::error!(
                    "chain {}: {line}; the new runtime uses transaction extension(s) this validator cannot encode: {} — set_weights cannot be signed; upgrade engy-validator",
                    chain.url(),
                    bad.join(", ")
                );
            }
        }
        if self.extensions_checked {
            return;
        }
        self.extensions_checked = true;
        let bad = chain::unsupported_extensions(&md);
        if bad.is_empty() {
            tracing::info!(
                "chain {}: runtime spec {spec} tx {txv}; transaction extensions all encodable: {}",
                chain.url(),
                names.join(", ")
            );
        } else {
            tracing::error!(
                "chain {}: runtime spec {spec} tx {txv} uses transaction extension(s) this validator cannot encode: {} — set_weights cannot be signed for this runtime; upgrade engy-validator (extensions: {})",
                chain.url(),
                bad.join(", "),
                names.join(", ")
            );
        }
    }

    /// Fetch + verify, falling back to the cache (§7 step 1). `Err(line)` when there is
    /// nothing to work with.
    async fn vector(&self, st: &State) -> Result<Vector, String> {
        let s = &self.settings;
        let reason = match crate::provider::fetch_latest(&self.http, &s.api).await {
            Ok(body) => match engy_core::payload::verify(&body, &s.master_hotkey, s.netuid) {
                Ok(v) => {
                    return Ok(Vector {
                        epoch: v.epoch_index,
                        weights: v.weights,
                        digest: Some(v.digest),
                        source: Source::Payload,
                        fallback_reason: None,
                    })
                }
                Err(e) => {
                    self.provider_error(e.reason_word());
                    format!("payload rejected: {}", e.reason_word())
                }
            },
            Err(e) => {
                self.provider_error(match &e {
                    crate::provider::FetchError::Status(code) => crate::metrics::http_kind(*code),
                    crate::provider::FetchError::Transport(_) => "transport",
                    crate::provider::FetchError::TooLarge(_) => "too-large",
                });
                format!("fetch failed: {e}")
            }
        };
        match (&st.cached_weights, st.last_applied) {
            (Some(w), Some(epoch)) => Ok(Vector {
                epoch,
                weights: w.clone(),
                digest: st.cached_digest.clone(),
                source: Source::Cache,
                fallback_reason: Some(reason),
            }),
            _ => Err(format!(
                "{reason}; no cached vector, nothing submitted (the chain keeps the last weights); {}",
                self.next_poll()
            )),
        }
    }

    /// Runs one tick (§7 steps 1–10) at unix time `now`. Never panics; every failure is in
    /// the report. A tick that landed nothing is raised to ERROR, with the blocks left,
    /// once the last landing is older than half of the subnet's `activity_cutoff`
    /// ([`Daemon::activity_alarm`]).
    pub async fn tick(&mut self, now: u64) -> TickReport {
        self.view = None;
        self.sent = false;
        let mut report = self.tick_inner(now).await;
        if !matches!(report.outcome, "submitted" | "committed" | "reconciled") {
            if let Some(alarm) = self.activity_alarm(now) {
                report.level = Level::Error;
                report.line.push_str(&alarm);
            }
        }
        // a landing in this tick is 0 blocks ago (the chain read was taken before it)
        let landed = matches!(report.outcome, "submitted" | "committed" | "reconciled");
        let gap = if landed {
            Some(0)
        } else {
            self.landing_gap(now).map(|g| g.since)
        };
        self.landing = crate::liveness::Landing {
            blocks_since: gap,
            activity_cutoff: self.activity_cutoff.map(u64::from),
            refused: (report.outcome == "replay").then(|| "replay".to_owned()),
        };
        if let Some(m) = &self.metrics {
            m.tick(report.outcome);
            let st = state::read(&self.settings.state_file);
            m.last_landing(
                st.last_submit_block,
                st.last_submit_ts,
                crate::liveness::unix_now(),
            );
            m.landing_gap(self.landing.blocks_since, self.landing.activity_cutoff);
        }
        report
    }

    /// What the last tick knew of this validator's landings, for the heartbeat file
    /// (`health --landing`).
    pub fn landing(&self) -> &crate::liveness::Landing {
        &self.landing
    }

    fn chain_error(&self, kind: &str) {
        if let Some(m) = &self.metrics {
            m.chain_error(kind);
        }
    }

    /// Blocks since this validator's weights last landed: from this tick's chain read
    /// (`head − LastUpdate`), else from the state file's `last_submit_ts` on the wall clock
    /// (12 s blocks); `None` when neither is known.
    fn landing_gap(&self, now: u64) -> Option<LandingGap> {
        match self.view {
            Some((head, last_update)) if last_update > 0 && head >= last_update => {
                Some(LandingGap {
                    since: head - last_update,
                    what: format!(
                        "its LastUpdate is block #{last_update}, {} blocks ago",
                        head - last_update
                    ),
                })
            }
            Some(_) => None,
            None => {
                let st = state::read(&self.settings.state_file);
                let ts = st.last_submit_ts.filter(|ts| *ts <= now)?;
                let blocks = (now - ts) / schedule::BLOCK_S;
                Some(LandingGap {
                    since: blocks,
                    what: format!("the last landing recorded in the state file was {} s ago (~{blocks} blocks by the wall clock)", now - ts),
                })
            }
        }
    }

    /// ` — ERROR: …` when the last landing is older than half of `activity_cutoff`: from
    /// this tick's chain read (`head − LastUpdate`), else from the state file's
    /// `last_submit_ts` on the wall clock (12 s blocks), against the cutoff last read (or
    /// subtensor's default, said as such, when the chain was never reached).
    fn activity_alarm(&self, now: u64) -> Option<String> {
        let (cutoff, cutoff_note) = match self.activity_cutoff {
            Some(c) => (c, String::new()),
            None => (
                crate::chain_rules::DEFAULT_ACTIVITY_CUTOFF,
                " (subtensor's default: not read from the chain yet)".to_owned(),
            ),
        };
        let LandingGap { since, what } = self.landing_gap(now)?;
        let a = crate::chain_rules::Activity {
            since,
            cutoff: u64::from(cutoff),
        };
        if !a.alarming() {
            return None;
        }
        let left = if a.remaining() == 0 {
            "it is already out of consensus (inactive) until weights land".to_owned()
        } else {
            format!(
                "it drops out of consensus in {} blocks (~{} s) unless weights land",
                a.remaining(),
                a.remaining().saturating_mul(schedule::BLOCK_S)
            )
        };
        Some(format!(
            " — NOTHING HAS LANDED for more than half of activity_cutoff {cutoff}{cutoff_note}: {what}; {left}"
        ))
    }

    async fn tick_inner(&mut self, now: u64) -> TickReport {
        let s = self.settings.clone();
        let st = state::read(&s.state_file);
        let anchors = st.anchors();
        let info = |outcome, line| TickReport {
            level: Level::Info,
            line,
            outcome,
        };
        let warn = |outcome, line| TickReport {
            level: Level::Warn,
            line,
            outcome,
        };

        // 1. fetch + verify, else the cache
        let v = match self.vector(&st).await {
            Ok(v) => v,
            Err(line) => return warn("nothing", line),
        };
        if let Some(m) = &self.metrics {
            m.epoch(v.epoch);
        }
        let via = match &v.fallback_reason {
            Some(r) => format!("{r}; using cached epoch {}", v.epoch),
            None => format!("epoch {} verified", v.epoch),
        };

        // 2–3. replay guard and pre-gate, before any chain connection
        match schedule::relate_epoch(v.epoch, anchors.last_applied) {
            EpochRelation::Replay { last_applied } => {
                return TickReport {
                    level: Level::Error,
                    outcome: "replay",
                    line: format!(
                        "{via}: older than last applied epoch {last_applied}, refused (replay guard), nothing submitted; nothing lands while the state file is {} epoch(s) ahead of the provider: if it came from another network or is damaged, move {} aside and restart; {}",
                        last_applied - v.epoch,
                        s.state_file.display(),
                        self.next_poll()
                    ),
                };
            }
            EpochRelation::Same => {
                if let Some(wait) =
                    schedule::pregate(now, anchors.last_submit_ts, s.resubmit_blocks)
                {
                    return info(
                        "skipped",
                        format!(
                            "{via}: already applied, resubmit due in ~{wait} s (pre-gate, chain not contacted); {}",
                            self.next_poll()
                        ),
                    );
                }
            }
            EpochRelation::New => {}
        }

        // 4. open the chain once for this tick
        let chain = match Chain::connect(&s.chain_url).await {
            Ok(c) => c,
            Err(e) => {
                self.chain_error(e.kind());
                return warn(
                    "chain-down",
                    format!(
                        "{via}: chain unreachable ({e}); nothing submitted, state unchanged; {}",
                        self.retry()
                    ),
                );
            }
        };
        self.report_extensions(&chain);
        let unsupported = chain::unsupported_extensions(&chain.metadata());
        if !unsupported.is_empty() {
            return warn(
                "blocked",
                format!(
                    "{via}: set_weights cannot be signed for this runtime (transaction extension(s) {} reported at start-up); nothing submitted; {}",
                    unsupported.join(", "),
                    self.next_poll()
                ),
            );
        }
        // a block read failure degrades to the wall clock (only positive numbers count)
        let block = chain.block_number().await.ok().filter(|b| *b > 0);
        let decision = schedule::decide(v.epoch, &anchors, block, now, s.resubmit_blocks);
        let why = match decision {
            Decision::NotDue(wait) => {
                return info(
                    "skipped",
                    format!(
                        "{via}: already applied at block {}, resubmit due {wait}; {}",
                        anchors
                            .last_submit_block
                            .map_or("?".into(), |b| format!("#{b}")),
                        self.next_poll()
                    ),
                )
            }
            Decision::Replay { last_applied } => {
                return warn(
                    "replay",
                    format!(
                        "{via}: older than last applied epoch {last_applied}, refused; {}",
                        self.next_poll()
                    ),
                )
            }
            Decision::SubmitNew => "new epoch".to_owned(),
            Decision::Resubmit => match (block, anchors.last_submit_block) {
                (Some(b), Some(l)) if b >= l => format!("resubmit, {} blocks since last", b - l),
                _ => "resubmit (wall clock)".to_owned(),
            },
        };

        // hyperparameters and the validator's own LastUpdate first: they say how long
        // nothing has landed even when the metagraph cannot be read
        let hp = match chain.hyperparams(s.netuid).await {
            Ok(h) => h,
            Err(e) => {
                self.chain_error(e.kind());
                return warn(
                    "chain-down",
                    format!("{via} ({why}): hyperparameters read failed ({e}); nothing submitted, state unchanged; {}", self.retry()),
                );
            }
        };
        self.activity_cutoff = Some(hp.activity_cutoff);
        // the validator's own uid and LastUpdate (None: not registered, or unreadable; the
        // submit then names the cause)
        let own = chain
            .neuron(s.netuid, self.hotkey.public_key())
            .await
            .ok()
            .flatten();
        if let (Some(b), Some(n)) = (block, own) {
            self.view = Some((b, n.last_update));
        }
        let metagraph = match chain.metagraph(s.netuid).await {
            Ok(m) => m,
            Err(e) => {
                self.chain_error(e.kind());
                return warn(
                    "chain-down",
                    format!("{via} ({why}): metagraph read failed ({e}); nothing submitted, state unchanged; {}", self.retry()),
                );
            }
        };
        let mut notes: Vec<String> = Vec::new();
        let mut level = Level::Info;
        // commit-reveal: the path of this submission, and the reveal of the last commit
        let submission = match chain.commit_reveal_state(s.netuid).await {
            Ok(cr) => commit_reveal::decide(&cr, unix_now_ms()),
            Err(e) => match hp.commit_reveal_weights_enabled {
                false => Ok(Submission::SetWeights),
                true => {
                    self.chain_error(e.kind());
                    return warn(
                        "chain-down",
                        format!("{via} ({why}): commit-reveal state read failed ({e}); nothing submitted, state unchanged; {}", self.retry()),
                    );
                }
            },
        };
        // its own log line (INFO revealed / ERROR not revealed), once per commit
        if let Some((is_error, _)) = self.check_reveal(&chain, block).await {
            if let Some(m) = &self.metrics {
                m.reveal(!is_error);
            }
        }
        let submission = match submission {
            Ok(sub) => sub,
            Err(e) => {
                return warn(
                    "failed",
                    format!(
                        "{via} ({why}): commit-reveal is ENABLED on netuid {} and no commit can be accepted: {e}; nothing submitted, state unchanged; {}",
                        s.netuid,
                        self.retry()
                    ),
                )
            }
        };

        // 5–7. uids, scaling, dropped hotkeys, burn, standby
        let cache = st.cached_weights.as_deref();
        let planned = schedule::plan(&v.weights, v.source, cache, &metagraph, &s.master_hotkey);
        let (source, resolved, primary) = match planned {
            Plan::Submit {
                source,
                resolved,
                primary,
            } => (source, resolved, primary),
            Plan::Nothing { primary } => {
                let mut line = format!(
                    "{via} ({why}): nothing lands ({} of {} hotkeys registered), no standby vector and owner hotkey not registered; nothing submitted",
                    v.weights.len() - primary.dropped.len(),
                    v.weights.len()
                );
                if let Some(note) = dropped_note(&primary) {
                    line.push_str(&format!(" [{note}]"));
                }
                line.push_str(&format!("; {}", self.next_poll()));
                return warn("nothing", line);
            }
        };
        if let Some(note) = dropped_note(&primary) {
            notes.push(note);
        }
        if source != v.source {
            notes.push(format!(
                "standby: submitting the {} vector",
                source.as_str()
            ));
        }
        if let Some(hk) = schedule::unexpected_burn(&resolved, &metagraph, &s.master_hotkey) {
            notes.push(format!(
                "all weight on one hotkey {hk} that is not the subnet owner hotkey (submitting anyway)"
            ));
        }
        let notes = if notes.is_empty() {
            String::new()
        } else {
            format!(" [{}]", notes.join("; "))
        };

        // the subnet's weight rules, before anything is sent (`check` predicts the same)
        if let Some(reason) = crate::chain_rules::refusal(
            &resolved,
            own.map(|n| n.uid),
            metagraph.len(),
            hp.min_allowed_weights,
            hp.max_weight_limit,
        ) {
            let first = self.refused.as_ref() != Some(&(v.epoch, reason.clone()));
            self.refused = Some((v.epoch, reason.clone()));
            let line = if first {
                format!(
                    "{via} ({why}): the {} vector of {} uids cannot land: {reason}; nothing submitted (every poll of this epoch rechecks, and says this once); {}",
                    source.as_str(),
                    resolved.uids.len(),
                    self.next_poll()
                )
            } else {
                format!(
                    "{via} ({why}): nothing submitted: the vector still breaks the subnet's weight rules (the reason was logged at this epoch's first refusal); {}",
                    self.next_poll()
                )
            };
            return TickReport {
                level: if first { Level::Error } else { Level::Warn },
                outcome: "refused",
                line,
            };
        }
        // the chain's rate limit: LastUpdate + WeightsSetRateLimit (also for commits). A vector
        // the chain already holds is recorded as landed (a previous run stopped between the
        // inclusion and its state write); anything else waits for that block.
        if let (Some(b), Some(n)) = (block, own) {
            if let Some(until) =
                crate::chain_rules::rate_limited_until(b, n.last_update, hp.weights_rate_limit)
            {
                // a landing the state file does not know: this epoch was never recorded, or
                // LastUpdate is past the state's own resubmit cadence (a resubmit that landed
                // unrecorded); a normal landing sits a few blocks after last_submit_block
                let unrecorded = match (anchors.last_applied, anchors.last_submit_block) {
                    (Some(last), Some(lsb)) if v.epoch <= last => {
                        n.last_update > lsb.saturating_add(s.resubmit_blocks)
                    }
                    _ => true,
                };
                let holds = unrecorded
                    && matches!(submission, Submission::SetWeights)
                    && chain.weights(s.netuid, n.uid).await.ok()
                        == Some(crate::chain_rules::stored_row(&resolved));
                if holds {
                    let saved = self.save_submission(&st, &v, source, Some(n.last_update), now);
                    return TickReport {
                        level: if saved.is_empty() { Level::Info } else { Level::Warn },
                        outcome: "reconciled",
                        line: format!(
                            "{via} ({why}): the chain already holds this vector (Weights row of uid {} matches, LastUpdate #{}): recorded as landed in block #{}, nothing submitted (a previous run stopped before writing its state, or another process with this hotkey set it); next resubmit in {} blocks, {}{notes}{saved}",
                            n.uid,
                            n.last_update,
                            n.last_update,
                            s.resubmit_blocks,
                            self.next_poll()
                        ),
                    };
                }
                return warn(
                    "rate-limited",
                    format!(
                        "{via} ({why}): the chain accepts weights from uid {} again at block #{until} (LastUpdate #{} + WeightsSetRateLimit {}), {} block(s) from now (~{} s); nothing submitted, state unchanged; {}{notes}",
                        n.uid,
                        n.last_update,
                        hp.weights_rate_limit,
                        until - b - 1,
                        (until - b - 1).saturating_mul(schedule::BLOCK_S),
                        self.next_poll()
                    ),
                );
            }
        }

        // a call that dispatched and failed is not re-sent every poll: exponential backoff,
        // reset by a new epoch or a changed hyperparameter (issue 21 item 6)
        if let Some(reason) = self.backoff.reset_by(v.epoch, &hp) {
            tracing::info!(
                "dispatch backoff reset ({reason}): the last {} dispatch failure(s) ({}) no longer hold; submitting now",
                self.backoff.failures,
                self.backoff.last_error
            );
            self.backoff = Backoff::default();
        }
        if let Some(wait) = self.backoff.wait(now) {
            return warn(
                "backing-off",
                format!(
                    "{via} ({why}): not submitted: the last submission dispatched and failed with {} ({} time(s) in a row); next try in {wait} s (exponential backoff, capped at {} s; a new epoch or a changed hyperparameter retries at once); {}{notes}",
                    self.backoff.last_error,
                    self.backoff.failures,
                    backoff_cap(s.poll_s),
                    self.next_poll()
                ),
            );
        }

        // 8. set_weights (or the timelocked commit), waiting for inclusion
        let signer = HotkeySigner(&self.hotkey);
        if let Submission::Commit {
            call,
            version,
            reveal_round,
            plan,
        } = submission
        {
            let payload = WeightsTlockPayload {
                hotkey: self.hotkey.public_key(),
                uids: resolved.uids.clone(),
                values: resolved.weights.clone(),
                version_key: VERSION_KEY,
            };
            let commit = match timelock::commit_bytes(&payload, reveal_round) {
                Ok(c) => c,
                Err(e) => {
                    return warn(
                        "failed",
                        format!("{via} ({why}): timelock encryption FAILED: {e}; nothing submitted, state unchanged; {}{notes}", self.retry()),
                    )
                }
            };
            self.sent = true;
            let mut result = chain
                .commit_timelocked(call, s.netuid, &commit, reveal_round, version, &signer)
                .await;
            if let Some(first) = result.as_ref().err().filter(|e| e.stale_era_or_nonce()) {
                self.resubmit_notice(&format!("{via} ({why})"), call.name(), first);
                result = chain
                    .commit_timelocked(call, s.netuid, &commit, reveal_round, version, &signer)
                    .await;
            }
            let inclusion = match result {
                Ok(inc) => inc,
                Err(e) => {
                    let what = format!("{} of {} uids", call.name(), resolved.uids.len());
                    return self
                        .failed(
                            &chain,
                            &e,
                            &hp,
                            (v.epoch, now),
                            &format!("{via} ({why})"),
                            &what,
                            &notes,
                        )
                        .await;
                }
            };
            self.backoff = Backoff::default();
            let record = CommitRecord {
                epoch: v.epoch,
                commit_epoch: plan.commit_epoch,
                reveal_epoch: plan.reveal_epoch,
                reveal_round,
                commit_block: inclusion.block,
                reveal_block: plan.reveal_block,
                payload_sha256: payload.sha256_hex(),
                uids: resolved.uids.clone(),
                checked: false,
            };
            let recorded = match commit_record::write(&s.state_file, &record) {
                Ok(()) => String::new(),
                Err(e) => {
                    level = Level::Warn;
                    format!(" WARNING: the commit record was not written ({e}); its reveal will not be checked")
                }
            };
            // the commit moves LastUpdate (subtensor `internal_commit_timelocked_weights`),
            // so the resubmit schedule counts from it like from a set_weights
            let saved = self.save_submission(
                &st,
                &v,
                source,
                block.or(Some(inclusion.block).filter(|b| *b > 0)),
                now,
            );
            if !saved.is_empty() {
                level = Level::Warn;
            }
            return TickReport {
                level,
                outcome: "committed",
                line: format!(
                    "{via} ({why}): {} of {} uids from {} committed in block #{} (not landed yet): drand round {reveal_round}, reveals in chain epoch {} from block #{}, checked from block #{}; next resubmit in {} blocks (~{} s), {}{notes}{recorded}{saved}",
                    call.name(),
                    resolved.uids.len(),
                    source.as_str(),
                    inclusion.block,
                    plan.reveal_epoch,
                    plan.reveal_block,
                    record.check_from(),
                    s.resubmit_blocks,
                    schedule::interval_s(s.resubmit_blocks),
                    self.next_poll()
                ),
            };
        }
        self.sent = true;
        let mut result = chain
            .set_weights(
                s.netuid,
                &resolved.uids,
                &resolved.weights,
                VERSION_KEY,
                &signer,
            )
            .await;
        // an era or nonce the pool refuses: built again (fresh era from the latest block,
        // fresh nonce) and sent once more in this tick, not a poll later
        let mut resent = String::new();
        if let Some(first) = result.as_ref().err().filter(|e| e.stale_era_or_nonce()) {
            self.resubmit_notice(&format!("{via} ({why})"), "set_weights", first);
            resent = format!(
                " (resubmitted once with a fresh era after the pool refused the first as {})",
                first.kind()
            );
            result = chain
                .set_weights(
                    s.netuid,
                    &resolved.uids,
                    &resolved.weights,
                    VERSION_KEY,
                    &signer,
                )
                .await;
        }
        let inclusion = match result {
            Ok(inc) => inc,
            Err(e) => {
                // an uncertain outcome (the node went away, no inclusion seen): the chain
                // may hold it after all; if so it is recorded as landed, never resent
                if e.uncertain() {
                    if let Some(n) = self.landed_anyway(&chain, &resolved, block).await {
                        let saved = self.save_submission(&st, &v, source, Some(n), now);
                        return TickReport {
                            level: Level::Warn,
                            outcome: "reconciled",
                            line: format!(
                                "{via} ({why}): set_weights of {} uids from {}: inclusion not confirmed ({e}), but the chain holds the vector (LastUpdate #{n}): recorded as landed in block #{n}; next resubmit in {} blocks, {}{notes}{saved}",
                                resolved.uids.len(),
                                source.as_str(),
                                s.resubmit_blocks,
                                self.next_poll()
                            ),
                        };
                    }
                }
                let what = format!("set_weights of {} uids{resent}", resolved.uids.len());
                return self
                    .failed(
                        &chain,
                        &e,
                        &hp,
                        (v.epoch, now),
                        &format!("{via} ({why})"),
                        &what,
                        &notes,
                    )
                    .await;
            }
        };

        // 9. only now, write the state atomically. The cadence anchors on the block read
        // before submitting (§7 step 8: RESUBMIT_BLOCKS 120 leaves 20 blocks of a 100-block
        // rate limit for inclusion lag); the inclusion block only when none was read.
        self.backoff = Backoff::default();
        let landed_block = block.or(Some(inclusion.block).filter(|b| *b > 0));
        let saved = self.save_submission(&st, &v, source, landed_block, now);
        if !saved.is_empty() {
            level = Level::Warn;
        }
        TickReport {
            level,
            outcome: "submitted",
            line: format!(
                "{via} ({why}): set_weights of {} uids from {} landed in block #{}{resent}; next resubmit in {} blocks (~{} s), {}{notes}{saved}",
                resolved.uids.len(),
                source.as_str(),
                inclusion.block,
                s.resubmit_blocks,
                schedule::interval_s(s.resubmit_blocks),
                self.next_poll()
            ),
        }
    }
}

impl Daemon {
    /// Writes the state after an accepted submission (§7 step 9); returns a warning
    /// fragment when the write failed, empty otherwise.
    fn save_submission(
        &self,
        st: &State,
        v: &Vector,
        source: Source,
        landed_block: Option<u64>,
        now: u64,
    ) -> String {
        let mut next = State {
            last_applied: Some(v.epoch),
            last_submit_block: landed_block,
            // the wall clock at inclusion, not at the tick's start: the fetch, connect and
            // inclusion wait can take minutes, and the wall-clock fallback (§7 step 2) must
            // count from the landing, as the chain's rate limit does
            last_submit_ts: Some(crate::liveness::unix_now().max(now)),
            cached_weights: st.cached_weights.clone(),
            cached_digest: st.cached_digest.clone(),
        };
        if source == Source::Payload {
            next.cached_weights = Some(v.weights.clone());
            next.cached_digest = v.digest.clone();
        }
        match state::write(&self.settings.state_file, &next) {
            Ok(()) => String::new(),
            Err(e) => format!(" WARNING: landed but the state file was not written ({e}); the next tick may resubmit early"),
        }
    }

    fn provider_error(&self, name: &str) {
        if let Some(m) = &self.metrics {
            m.provider_error(name);
        }
    }

    /// The tick report of a failed submission (`set_weights` or a commit, `what` names it):
    /// the error by name, the runtime's hint, and what happens next ([`Daemon::after_failure`]).
    #[allow(clippy::too_many_arguments)]
    async fn failed(
        &mut self,
        chain: &Chain,
        e: &chain::SubmitError,
        hp: &chain::Hyperparams,
        (epoch, now): (u64, u64),
        head: &str,
        what: &str,
        notes: &str,
    ) -> TickReport {
        self.chain_error(&e.kind());
        let hint = chain::dispatch_hint(&e.name())
            .map(|h| format!(" — {h}"))
            .unwrap_or_default();
        let after = self.after_failure(chain, e, hp).await;
        let retry = if backs_off(e) && !self.final_tick {
            // counted from the failure, not from the tick's start: the inclusion wait can
            // take longer than the first backoff step
            let now = crate::liveness::unix_now().max(now);
            let wait = self
                .backoff
                .fail(epoch, hp, now, self.settings.poll_s, &e.name());
            format!(
                "dispatch failure {} in a row: next try in {wait} s (at unix {}; exponential backoff, capped at {} s; a new epoch or a changed hyperparameter retries at once)",
                self.backoff.failures,
                now.saturating_add(wait),
                backoff_cap(self.settings.poll_s)
            )
        } else {
            self.retry()
        };
        TickReport {
            level: Level::Warn,
            outcome: "failed",
            line: format!(
                "{head}: {what} FAILED: {e}{hint}; state unchanged, {retry}{after}{notes}"
            ),
        }
    }

    /// The WARN line of a submission the pool refused for its era or nonce, before it is
    /// built again and resent once.
    fn resubmit_notice(&self, head: &str, what: &str, first: &chain::SubmitError) {
        self.chain_error(&first.kind());
        tracing::warn!(
            "{head}: {what} refused by the transaction pool: {first}; building it again with a fresh era and nonce and resubmitting now (once in this tick)"
        );
    }

    /// After a failed submit: for a rate-limit refusal (`SettingWeightsTooFast`,
    /// `CommittingWeightsTooFast`, pool `Custom(6)`), when the chain accepts weights again
    /// (read fresh: `LastUpdate + WeightsSetRateLimit`), so the line says the validator waits;
    /// for an uncertain outcome, that the next tick checks the chain first. Empty otherwise.
    async fn after_failure(
        &self,
        chain: &Chain,
        e: &chain::SubmitError,
        hp: &chain::Hyperparams,
    ) -> String {
        let name = e.name();
        let rate_limited = matches!(
            name.as_str(),
            "SettingWeightsTooFast" | "CommittingWeightsTooFast" | "Custom(6)"
        );
        if rate_limited {
            let own = chain
                .neuron(self.settings.netuid, self.hotkey.public_key())
                .await
                .ok()
                .flatten();
            if let Some(n) = own.filter(|n| n.last_update > 0) {
                return format!(
                    "; the chain accepts weights again at block #{} (LastUpdate #{} + WeightsSetRateLimit {}): nothing is resubmitted before then",
                    n.last_update.saturating_add(hp.weights_rate_limit),
                    n.last_update,
                    hp.weights_rate_limit
                );
            }
        }
        if e.uncertain() {
            return "; it may still land: the next tick reads the chain's Weights row and LastUpdate before resubmitting".to_owned();
        }
        String::new()
    }

    /// After an uncertain submit: `Some(LastUpdate)` when the chain now holds `resolved` as
    /// this validator's Weights row with a `LastUpdate` after `read_before` (the block read
    /// before submitting), i.e. the extrinsic landed although its inclusion was not seen.
    async fn landed_anyway(
        &self,
        chain: &Chain,
        resolved: &schedule::Resolved,
        read_before: Option<u64>,
    ) -> Option<u64> {
        let s = &self.settings;
        let n = chain
            .neuron(s.netuid, self.hotkey.public_key())
            .await
            .ok()??;
        if n.last_update <= read_before.unwrap_or(0) {
            return None;
        }
        let row = chain.weights(s.netuid, n.uid).await.ok()?;
        (row == crate::chain_rules::stored_row(resolved)).then_some(n.last_update)
    }

    /// Checks the reveal of the last recorded commit once its reveal block plus
    /// [`commit_record::REVEAL_MARGIN_BLOCKS`] has passed and logs one line (INFO revealed,
    /// ERROR not revealed with its likely cause): `(is_error, line)`, `None` when there is
    /// nothing to check yet or storage could not be read (retried next tick). The record is
    /// marked checked once judged.
    async fn check_reveal(&self, chain: &Chain, block: Option<u64>) -> Option<(bool, String)> {
        let s = &self.settings;
        let mut record = commit_record::read(&s.state_file)?;
        if record.checked || block? < record.check_from() {
            return None;
        }
        let hk = self.hotkey.public_key();
        let queued = chain
            .queued_commits(s.netuid, hk, &[record.commit_epoch])
            .await
            .ok()?;
        let still_queued = queued
            .iter()
            .any(|(_, b, r)| *b == record.commit_block && *r == record.reveal_round);
        let uid = chain.neuron(s.netuid, hk).await.ok()??.uid;
        let row: Vec<u16> = chain
            .weights(s.netuid, uid)
            .await
            .ok()?
            .into_iter()
            .map(|(d, _)| d)
            .collect();
        let last_stored = chain
            .commit_reveal_state(s.netuid)
            .await
            .ok()
            .and_then(|c| c.last_stored_round);
        let check = commit_record::judge(&record, still_queued, &row, last_stored);
        let out = commit_record::describe(&record, &check);
        if out.0 {
            tracing::error!("{}", out.1);
        } else {
            tracing::info!("{}", out.1);
        }
        record.checked = true;
        let _ = commit_record::write(&s.state_file, &record);
        Some(out)
    }

    /// Start-up: when the state file's `last_applied` is ahead of the provider's verified
    /// epoch, says so at ERROR with the recovery ([`replay_diagnosis`]) before the first
    /// tick refuses it. A fetch that fails is left to the first tick.
    pub async fn report_replay(&self) {
        let s = &self.settings;
        let Some(last_applied) = state::read(&s.state_file).last_applied else {
            return;
        };
        let Ok(body) = crate::provider::fetch_latest(&self.http, &s.api).await else {
            return;
        };
        if let Ok(v) = engy_core::payload::verify(&body, &s.master_hotkey, s.netuid) {
            if let Some(line) = replay_diagnosis(v.epoch_index, Some(last_applied), &s.state_file) {
                tracing::error!("{line}");
            }
        }
    }

    /// The best-effort provider heartbeat (PROTOCOL.md §6), after the tick's work, so it
    /// never delays a submit; a failure is appended to the tick's line and ignored.
    pub async fn provider_heartbeat(&self, mut report: TickReport) -> TickReport {
        let s = &self.settings;
        let st = state::read(&s.state_file);
        let r = crate::provider::post_heartbeat(
            &self.http,
            &s.api,
            s.netuid,
            &self.hotkey,
            st.last_applied,
            st.cached_digest.as_deref(),
            crate::liveness::unix_now(),
        )
        .await;
        if let Err(e) = r {
            report
                .line
                .push_str(&format!(" (provider heartbeat: {e}, ignored)"));
        }
        report
    }
}

/// Runs the daemon until SIGTERM/SIGINT (exit 0) or `max_ticks` ticks: first connects to the
/// chain once to report the runtime's transaction extensions (an unreachable chain is only
/// a warning; the first tick retries), then ticks every `poll_s` seconds. The signal
/// handlers are installed before that first connect, so a signal during start-up also
/// exits 0 (the connect can take up to its 30 s timeout).
pub async fn run(mut daemon: Daemon, max_ticks: Option<u64>) -> anyhow::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let s = daemon.settings().clone();
    let startup = async {
        match Chain::connect(&s.chain_url).await {
            Ok(c) => daemon.report_extensions(&c),
            Err(e) => {
                tracing::warn!("chain not reachable at start-up ({e}); the first tick retries")
            }
        }
        daemon.report_replay().await;
    };
    tokio::select! {
        _ = startup => {}
        _ = term.recv() => { tracing::info!("SIGTERM during start-up; exiting 0"); return Ok(()); }
        _ = int.recv() => { tracing::info!("SIGINT during start-up; exiting 0"); return Ok(()); }
    }
    let mut interval = tokio::time::interval(Duration::from_secs(s.poll_s));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut done = 0u64;
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = term.recv() => { tracing::info!("SIGTERM: no tick in progress; exiting 0"); return Ok(()); }
            _ = int.recv() => { tracing::info!("SIGINT: no tick in progress; exiting 0"); return Ok(()); }
        }
        daemon.final_tick = max_ticks.is_some_and(|m| done + 1 >= m);
        let now = crate::liveness::unix_now();
        let report = tokio::select! {
            r = daemon.tick(now) => Some(r),
            _ = term.recv() => None,
            _ = int.recv() => None,
        };
        let Some(report) = report else {
            if daemon.sent {
                tracing::warn!("signal during a tick: abandoned it after its extrinsic was sent: it MAY STILL LAND; the state file is only written once an inclusion is seen, so the next start reads the chain's Weights row and LastUpdate and records it as landed instead of sending it again; exiting 0");
            } else {
                tracing::info!("signal during a tick: abandoned it before anything was sent (state file unchanged); exiting 0");
            }
            return Ok(());
        };
        if let Err(e) = crate::liveness::stamp_with(
            &s.heartbeat_file,
            crate::liveness::unix_now(),
            daemon.landing(),
        ) {
            tracing::warn!(
                "heartbeat file {} not written: {e}",
                s.heartbeat_file.display()
            );
        }
        // Best effort: a signal abandons the POST at once (it may otherwise run to its
        // 10 s timeout); the tick's line is still printed.
        let (report, signal) = tokio::select! {
            r = daemon.provider_heartbeat(report.clone()) => (r, None),
            _ = term.recv() => (report, Some("SIGTERM")),
            _ = int.recv() => (report, Some("SIGINT")),
        };
        match report.level {
            Level::Info => tracing::info!("{}", report.line),
            Level::Warn => tracing::warn!("{}", report.line),
            Level::Error => tracing::error!("{}", report.line),
        }
        if let Some(sig) = signal {
            tracing::info!("{sig} during the provider heartbeat POST: abandoned it (best effort; the tick's work is done); exiting 0");
            return Ok(());
        }
        done += 1;
        if max_ticks.is_some_and(|m| done >= m) {
            return Ok(());
        }
    }
}
