//! The light validator's decisions as pure functions: no I/O, no clock reads, no chain.
//!
//! Every rule here is PROTOCOL.md §7 (steps 2, 3, 5, 6 and 7); the daemon feeds these
//! functions what it read (state file, block number, metagraph) and acts on their answer.
//!
//! Failure directions are asymmetric: a missed submission costs consensus membership
//! (`activity_cutoff`), an extra one costs at most a `SettingWeightsTooFast` rejection, so
//! every ambiguous case resolves toward submitting. The one exception is the replay guard:
//! an epoch older than the last applied one is never submitted.

/// Nominal finney block time in seconds; used only for the wall-clock fallback and the
/// pre-gate (PROTOCOL.md §7 step 2–3).
pub const BLOCK_S: u64 = 12;

/// Largest weight value and the exact sum a submitted vector is scaled to (PROTOCOL.md §7
/// step 5; `u16::MAX`).
pub const WEIGHT_SUM: u64 = 65_535;

/// What the local anchors say, as read from the state file (all optional: a fresh validator
/// has none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Anchors {
    /// Epoch of the last successful submission (`last_applied`).
    pub last_applied: Option<u64>,
    /// Block number anchoring the last successful submission.
    pub last_submit_block: Option<u64>,
    /// Unix seconds of the last successful submission.
    pub last_submit_ts: Option<u64>,
}

/// How the epoch of the vector in hand relates to the last applied epoch (§7 step 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpochRelation {
    /// No applied epoch yet, or the epoch is newer: submit now.
    New,
    /// The epoch already applied: resubmit on the interval.
    Same,
    /// Older than the last applied epoch: never submit (the replay guard).
    Replay {
        /// The last applied epoch that the vector is older than.
        last_applied: u64,
    },
}

/// Classifies `epoch` against the last applied epoch (PROTOCOL.md §7 step 2).
pub fn relate_epoch(epoch: u64, last_applied: Option<u64>) -> EpochRelation {
    match last_applied {
        None => EpochRelation::New,
        Some(last) if epoch > last => EpochRelation::New,
        Some(last) if epoch == last => EpochRelation::Same,
        Some(last) => EpochRelation::Replay { last_applied: last },
    }
}

/// When the next resubmission is due, for the "acts next" part of a tick's log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Due once this many more blocks have been produced.
    Blocks(u64),
    /// Due in this many seconds (wall clock).
    Seconds(u64),
}

impl std::fmt::Display for Wait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Wait::Blocks(n) => write!(f, "in {n} blocks (~{} s)", n.saturating_mul(BLOCK_S)),
            Wait::Seconds(s) => write!(f, "in ~{s} s"),
        }
    }
}

/// Outcome of the schedule for one tick (PROTOCOL.md §7 step 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// A new epoch: submit now.
    SubmitNew,
    /// Same epoch and the resubmit interval has passed: submit.
    Resubmit,
    /// Same epoch, not due yet.
    NotDue(Wait),
    /// Older epoch: never submitted.
    Replay {
        /// The last applied epoch.
        last_applied: u64,
    },
}

/// The resubmit interval in wall-clock seconds: `resubmit_blocks × 12 s`.
pub fn interval_s(resubmit_blocks: u64) -> u64 {
    resubmit_blocks.saturating_mul(BLOCK_S)
}

/// The schedule (PROTOCOL.md §7 step 2).
///
/// * new epoch → [`Decision::SubmitNew`]; older epoch → [`Decision::Replay`];
/// * same epoch with a usable block number (`current_block` and `last_submit_block` both
///   known and positive) → due when `current_block − last_submit_block ≥ resubmit_blocks`;
/// * otherwise the wall clock: due when `now − last_submit_ts ≥ resubmit_blocks × 12 s`,
///   when the clock went backwards, or with no timestamp at all.
///
/// `current_block` of 0 counts as unusable (only positive integers count, §7 step 4). A
/// block number lower than the anchor (a chain reset, a different network) is not trusted
/// either, and falls back to the wall clock.
pub fn decide(
    epoch: u64,
    anchors: &Anchors,
    current_block: Option<u64>,
    now: u64,
    resubmit_blocks: u64,
) -> Decision {
    match relate_epoch(epoch, anchors.last_applied) {
        EpochRelation::New => Decision::SubmitNew,
        EpochRelation::Replay { last_applied } => Decision::Replay { last_applied },
        EpochRelation::Same => {
            let blocks = match (current_block, anchors.last_submit_block) {
                (Some(cur), Some(last)) if cur > 0 && last > 0 && cur >= last => Some(cur - last),
                _ => None,
            };
            match blocks {
                Some(elapsed) if elapsed >= resubmit_blocks => Decision::Resubmit,
                Some(elapsed) => Decision::NotDue(Wait::Blocks(resubmit_blocks - elapsed)),
                None => match wall_clock_wait(now, anchors.last_submit_ts, resubmit_blocks) {
                    None => Decision::Resubmit,
                    Some(wait) => Decision::NotDue(Wait::Seconds(wait)),
                },
            }
        }
    }
}

/// Wall-clock fallback: `None` when due, else the seconds left.
fn wall_clock_wait(now: u64, last_submit_ts: Option<u64>, resubmit_blocks: u64) -> Option<u64> {
    let last = last_submit_ts?;
    // The clock went backwards: treat as due (we cannot know how long it has been).
    let elapsed = now.checked_sub(last)?;
    let interval = interval_s(resubmit_blocks);
    (elapsed < interval).then(|| interval - elapsed)
}

/// The pre-gate (PROTOCOL.md §7 step 3): before opening any chain connection, for the same
/// epoch only, skip when `0 ≤ now − last_submit_ts < resubmit_blocks × 12 s × 0.8`.
///
/// Returns `Some(seconds until the resubmit is due)` when the tick can skip without touching
/// the chain. It only skips what [`decide`] refuses on the wall clock (0.8 < 1), and the
/// caller consults it only for [`EpochRelation::Same`].
pub fn pregate(now: u64, last_submit_ts: Option<u64>, resubmit_blocks: u64) -> Option<u64> {
    let last = last_submit_ts?;
    let elapsed = now.checked_sub(last)?;
    let interval = interval_s(resubmit_blocks);
    // × 0.8 in integer arithmetic (no float rounding at the edge).
    let gate = interval.saturating_mul(4) / 5;
    (elapsed < gate).then(|| interval - elapsed)
}

/// A payload weight vector resolved against the metagraph and ready for `set_weights`.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// Destination uids, ascending.
    pub uids: Vec<u16>,
    /// Weights aligned with `uids`, summing to exactly 65535 (or all zero).
    pub weights: Vec<u16>,
    /// Payload hotkeys that are not registered on the netuid, with the weight they held.
    pub dropped: Vec<(String, u16)>,
    /// Share of the payload's total weight held by the dropped hotkeys, in `0.0..=1.0`
    /// (0 when the payload's total is 0).
    pub dropped_share: f64,
}

impl Resolved {
    /// True when nothing can land: no registered hotkey or a zero sum (§7 step 7).
    pub fn is_empty(&self) -> bool {
        self.weights.iter().all(|w| *w == 0)
    }

    /// The uid holding all non-zero weight, when exactly one uid does (burn, §7 step 6).
    pub fn sole_uid(&self) -> Option<u16> {
        let mut nonzero = self.uids.iter().zip(&self.weights).filter(|(_, w)| **w > 0);
        let first = nonzero.next()?;
        nonzero.next().is_none().then_some(*first.0)
    }
}

/// Maps payload hotkeys to uids and scales the weights (PROTOCOL.md §7 step 5).
///
/// `metagraph[uid]` is the hotkey (SS58) registered at `uid` on the netuid; uids are never
/// taken from anywhere else. Hotkeys not in the metagraph are dropped and reported with
/// their weight; a hotkey listed twice has its weights summed (one uid can only appear once
/// in `set_weights`). The kept weights are scaled to sum to exactly 65535:
/// `w·65535 // total` each, the rounding gap goes to the largest weight (ties → lowest uid);
/// an all-zero vector stays all zero. The result is sorted by uid.
pub fn resolve(vector: &[(String, u16)], metagraph: &[String]) -> Resolved {
    use std::collections::{BTreeMap, HashMap};
    let index: HashMap<&str, u16> = metagraph
        .iter()
        .enumerate()
        .filter_map(|(uid, hk)| u16::try_from(uid).ok().map(|uid| (hk.as_str(), uid)))
        .rev() // the lowest uid wins if a hotkey were ever listed twice
        .collect();
    let mut kept: BTreeMap<u16, u64> = BTreeMap::new();
    let mut dropped = Vec::new();
    let (mut total_all, mut total_dropped) = (0u64, 0u64);
    for (hotkey, w) in vector {
        total_all += u64::from(*w);
        match index.get(hotkey.as_str()) {
            Some(uid) => *kept.entry(*uid).or_default() += u64::from(*w),
            None => {
                total_dropped += u64::from(*w);
                dropped.push((hotkey.clone(), *w));
            }
        }
    }
    let dropped_share = if total_all == 0 {
        0.0
    } else {
        total_dropped as f64 / total_all as f64
    };
    let (uids, weights) = normalise(&kept);
    Resolved {
        uids,
        weights,
        dropped,
        dropped_share,
    }
}

/// Scales uid-keyed weights to sum to exactly 65535 (see [`resolve`]).
fn normalise(kept: &std::collections::BTreeMap<u16, u64>) -> (Vec<u16>, Vec<u16>) {
    let total: u64 = kept.values().sum();
    let uids: Vec<u16> = kept.keys().copied().collect();
    if total == 0 {
        return (uids.clone(), vec![0; uids.len()]);
    }
    // Each term ≤ 65535 because w ≤ total; u128 keeps w·65535 exact for any total.
    let mut scaled: Vec<u64> = kept
        .values()
        .map(|w| (u128::from(*w) * u128::from(WEIGHT_SUM) / u128::from(total)) as u64)
        .collect();
    let gap = WEIGHT_SUM - scaled.iter().sum::<u64>();
    // Largest original weight, ties → lowest uid (BTreeMap iterates uids ascending, and
    // max_by_key keeps the LAST maximum, so compare on (w, Reverse(position))).
    if let Some((pos, _)) = kept
        .values()
        .enumerate()
        .max_by_key(|(pos, w)| (**w, std::cmp::Reverse(*pos)))
    {
        if let Some(s) = scaled.get_mut(pos) {
            *s += gap;
        }
    }
    let weights = scaled
        .into_iter()
        .map(|w| u16::try_from(w).unwrap_or(u16::MAX))
        .collect();
    (uids, weights)
}

/// Where the vector a tick submits came from (§7 steps 1 and 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The freshly fetched and verified payload.
    Payload,
    /// The cached vector (the last one this validator landed).
    Cache,
    /// Standby burn: 65535 to the subnet owner hotkey.
    Burn,
}

impl Source {
    /// Lowercase word for log lines.
    pub fn as_str(&self) -> &'static str {
        match self {
            Source::Payload => "payload",
            Source::Cache => "cache",
            Source::Burn => "burn",
        }
    }
}

/// What a tick submits after uid resolution and the standby rule (§7 steps 5–7).
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Submit `resolved` (`standby` = it is not the primary vector of this tick).
    Submit {
        /// Where the vector came from.
        source: Source,
        /// The vector to submit.
        resolved: Resolved,
        /// What resolving the primary vector dropped (for the log), even in standby.
        primary: Resolved,
    },
    /// Nothing lands and there is no standby: submit nothing.
    Nothing {
        /// The primary vector as resolved (for the log).
        primary: Resolved,
    },
}

/// Chooses the vector to submit (PROTOCOL.md §7 steps 5 and 7).
///
/// The primary vector (`primary_source` is [`Source::Payload`] or [`Source::Cache`]) is
/// resolved first. When nothing of it lands: the cached vector if it lands and it was not
/// already the primary, else a burn of 65535 to `owner_hotkey` if it is registered, else
/// nothing.
pub fn plan(
    primary: &[(String, u16)],
    primary_source: Source,
    cache: Option<&[(String, u16)]>,
    metagraph: &[String],
    owner_hotkey: &str,
) -> Plan {
    let first = resolve(primary, metagraph);
    if !first.is_empty() {
        return Plan::Submit {
            source: primary_source,
            resolved: first.clone(),
            primary: first,
        };
    }
    if primary_source != Source::Cache {
        if let Some(cached) = cache {
            let r = resolve(cached, metagraph);
            if !r.is_empty() {
                return Plan::Submit {
                    source: Source::Cache,
                    resolved: r,
                    primary: first,
                };
            }
        }
    }
    let burn = resolve(&[(owner_hotkey.to_owned(), u16::MAX)], metagraph);
    if !burn.is_empty() {
        return Plan::Submit {
            source: Source::Burn,
            resolved: burn,
            primary: first,
        };
    }
    Plan::Nothing { primary: first }
}

/// Burn detection (§7 step 6): `Some(hotkey)` when one hotkey holds all non-zero weight and
/// it is NOT `owner_hotkey` (warn, but submit anyway). `metagraph` maps uid → hotkey.
pub fn unexpected_burn<'a>(
    resolved: &Resolved,
    metagraph: &'a [String],
    owner_hotkey: &str,
) -> Option<&'a str> {
    let uid = resolved.sole_uid()?;
    let hotkey = metagraph.get(usize::from(uid))?;
    (hotkey != owner_hotkey).then_some(hotkey.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn anchors(applied: u64, block: u64, ts: u64) -> Anchors {
        Anchors {
            last_applied: Some(applied),
            last_submit_block: Some(block),
            last_submit_ts: Some(ts),
        }
    }
    fn mg(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("hk{i}")).collect()
    }
    fn v(pairs: &[(&str, u16)]) -> Vec<(String, u16)> {
        pairs.iter().map(|(h, w)| (h.to_string(), *w)).collect()
    }

    #[test]
    fn new_epoch_submits_now() {
        assert_eq!(
            decide(5, &Anchors::default(), None, 0, 120),
            Decision::SubmitNew
        );
        assert_eq!(
            decide(6, &anchors(5, 1000, 0), Some(1001), 1, 120),
            Decision::SubmitNew
        );
    }

    #[test]
    fn older_epoch_is_never_submitted() {
        for block in [None, Some(1), Some(1_000_000)] {
            assert_eq!(
                decide(4, &anchors(5, 1000, 0), block, u64::MAX, 120),
                Decision::Replay { last_applied: 5 }
            );
        }
    }

    #[test]
    fn same_epoch_resubmits_on_block_interval() {
        let a = anchors(5, 1000, 0);
        assert_eq!(
            decide(5, &a, Some(1119), 0, 120),
            Decision::NotDue(Wait::Blocks(1))
        );
        assert_eq!(decide(5, &a, Some(1120), 0, 120), Decision::Resubmit);
        assert_eq!(decide(5, &a, Some(5000), 0, 120), Decision::Resubmit);
    }

    #[test]
    fn block_beats_wall_clock_when_usable() {
        // The wall clock says "long ago", the blocks say "not yet": blocks win.
        let a = anchors(5, 1000, 0);
        assert_eq!(
            decide(5, &a, Some(1010), 1_000_000, 120),
            Decision::NotDue(Wait::Blocks(110))
        );
    }

    #[test]
    fn wall_clock_fallback_without_usable_block() {
        let a = anchors(5, 1000, 10_000);
        let iv = 120 * BLOCK_S;
        assert_eq!(
            decide(5, &a, None, 10_000 + iv - 1, 120),
            Decision::NotDue(Wait::Seconds(1))
        );
        assert_eq!(decide(5, &a, None, 10_000 + iv, 120), Decision::Resubmit);
        // Block 0 is not a usable block number.
        assert_eq!(
            decide(5, &a, Some(0), 10_000, 120),
            Decision::NotDue(Wait::Seconds(iv))
        );
        // A block below the anchor (chain reset) is not trusted.
        assert_eq!(
            decide(5, &a, Some(10), 10_000, 120),
            Decision::NotDue(Wait::Seconds(iv))
        );
        // No anchor block at all.
        let b = Anchors {
            last_submit_block: None,
            ..a
        };
        assert_eq!(
            decide(5, &b, Some(5000), 10_000 + iv, 120),
            Decision::Resubmit
        );
    }

    #[test]
    fn wall_clock_backwards_or_missing_is_due() {
        let a = anchors(5, 1000, 10_000);
        assert_eq!(decide(5, &a, None, 9_999, 120), Decision::Resubmit);
        let b = Anchors {
            last_submit_ts: None,
            ..a
        };
        assert_eq!(decide(5, &b, None, 10_000, 120), Decision::Resubmit);
    }

    #[test]
    fn pregate_window() {
        let iv = 120 * BLOCK_S; // 1440
        assert_eq!(pregate(1000, Some(1000), 120), Some(iv));
        assert_eq!(pregate(1000 + 1151, Some(1000), 120), Some(iv - 1151));
        assert_eq!(pregate(1000 + 1152, Some(1000), 120), None); // 0.8 × 1440 = 1152
        assert_eq!(pregate(999, Some(1000), 120), None); // clock went backwards
        assert_eq!(pregate(1000, None, 120), None);
    }

    #[test]
    fn pregate_only_skips_what_the_schedule_refuses() {
        // Exhaustive over a grid: whenever the pre-gate skips, the wall-clock schedule
        // (which is all the pre-gate can know) refuses too.
        for rb in [0u64, 1, 2, 5, 100, 120, 121, 1000] {
            for last in [0u64, 1, 500, 10_000] {
                for dt in 0..(rb * BLOCK_S + 20) {
                    let now = last + dt;
                    if pregate(now, Some(last), rb).is_some() {
                        let a = Anchors {
                            last_applied: Some(1),
                            last_submit_block: None,
                            last_submit_ts: Some(last),
                        };
                        assert!(
                            matches!(decide(1, &a, None, now, rb), Decision::NotDue(_)),
                            "pre-gate skipped a due tick: rb={rb} last={last} now={now}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn resolve_maps_uids_and_scales_exactly() {
        let m = mg(6);
        let r = resolve(&v(&[("hk4", 1), ("hk2", 1), ("hk3", 1)]), &m);
        assert_eq!(r.uids, vec![2, 3, 4]);
        assert_eq!(
            r.weights.iter().map(|w| u64::from(*w)).sum::<u64>(),
            WEIGHT_SUM
        );
        // 65535/3 = 21845 exactly
        assert_eq!(r.weights, vec![21845, 21845, 21845]);
        let r = resolve(&v(&[("hk1", 1), ("hk2", 1)]), &m);
        // 32767 + 32767 = 65534, gap 1 → the tie goes to the lowest uid
        assert_eq!(r.weights, vec![32768, 32767]);
        let r = resolve(&v(&[("hk1", 1), ("hk5", 2), ("hk2", 2)]), &m);
        // 13107, 26214, 26214 = 65535 (no gap) — sorted by uid 1,2,5
        assert_eq!(r.uids, vec![1, 2, 5]);
        assert_eq!(r.weights, vec![13107, 26214, 26214]);
        let r = resolve(&v(&[("hk1", 3), ("hk2", 3), ("hk3", 1)]), &m);
        // 28086 + 28086 + 9362 = 65534 → gap to largest, tie → uid 1
        assert_eq!(r.weights, vec![28087, 28086, 9362]);
    }

    #[test]
    fn resolve_sum_is_exact_for_many_shapes() {
        let m = mg(256);
        for n in 1..40u16 {
            let vec: Vec<(String, u16)> = (0..n)
                .map(|i| {
                    (
                        format!("hk{}", (i * 7) % 256),
                        i.wrapping_mul(977) % 65535 + 1,
                    )
                })
                .collect();
            let r = resolve(&vec, &m);
            assert_eq!(
                r.weights.iter().map(|w| u64::from(*w)).sum::<u64>(),
                WEIGHT_SUM
            );
            assert!(r.uids.windows(2).all(|w| w[0] < w[1]));
        }
    }

    #[test]
    fn resolve_drops_unregistered_with_share() {
        let m = mg(3);
        let r = resolve(&v(&[("hk1", 300), ("ghost", 100)]), &m);
        assert_eq!(r.uids, vec![1]);
        assert_eq!(r.weights, vec![65535]);
        assert_eq!(r.dropped, v(&[("ghost", 100)]));
        assert!((r.dropped_share - 0.25).abs() < 1e-12);
    }

    #[test]
    fn resolve_all_zero_stays_zero_and_duplicates_merge() {
        let m = mg(3);
        let r = resolve(&v(&[("hk1", 0), ("hk2", 0)]), &m);
        assert_eq!(r.weights, vec![0, 0]);
        assert!(r.is_empty());
        assert_eq!(r.dropped_share, 0.0);
        let r = resolve(&v(&[("hk1", 1), ("hk1", 1), ("hk2", 2)]), &m);
        assert_eq!(r.uids, vec![1, 2]);
        assert_eq!(r.weights, vec![32768, 32767]);
        assert!(resolve(&[], &m).is_empty());
    }

    #[test]
    fn burn_detection() {
        let m = mg(4);
        let r = resolve(&v(&[("hk2", 5), ("hk3", 0)]), &m);
        assert_eq!(r.sole_uid(), Some(2));
        assert_eq!(unexpected_burn(&r, &m, "hk0"), Some("hk2"));
        assert_eq!(unexpected_burn(&r, &m, "hk2"), None);
        let r = resolve(&v(&[("hk2", 5), ("hk3", 1)]), &m);
        assert_eq!(unexpected_burn(&r, &m, "hk0"), None);
    }

    #[test]
    fn standby_order_cache_then_burn_then_nothing() {
        let m = mg(3);
        let ghost = v(&[("ghost", 10)]);
        let cache = v(&[("hk2", 1)]);
        // payload lands → payload
        match plan(&cache, Source::Payload, Some(&ghost), &m, "hk0") {
            Plan::Submit { source, .. } => assert_eq!(source, Source::Payload),
            p => panic!("{p:?}"),
        }
        // payload does not land → cache
        match plan(&ghost, Source::Payload, Some(&cache), &m, "hk0") {
            Plan::Submit {
                source,
                resolved,
                primary,
            } => {
                assert_eq!(source, Source::Cache);
                assert_eq!(resolved.uids, vec![2]);
                assert_eq!(primary.dropped.len(), 1);
            }
            p => panic!("{p:?}"),
        }
        // the cache was already the source → burn to the owner
        match plan(&ghost, Source::Cache, Some(&ghost), &m, "hk0") {
            Plan::Submit {
                source, resolved, ..
            } => {
                assert_eq!(source, Source::Burn);
                assert_eq!((resolved.uids, resolved.weights), (vec![0], vec![65535]));
            }
            p => panic!("{p:?}"),
        }
        // zero sum payload, cache does not land either → burn
        let zero = v(&[("hk1", 0)]);
        assert!(matches!(
            plan(&zero, Source::Payload, Some(&ghost), &m, "hk0"),
            Plan::Submit {
                source: Source::Burn,
                ..
            }
        ));
        // owner not registered → nothing
        assert!(matches!(
            plan(&ghost, Source::Payload, None, &m, "nobody"),
            Plan::Nothing { .. }
        ));
    }
}
