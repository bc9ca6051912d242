//! The runtime's own weight rules, predicted (pure): what subtensor will refuse, what it
//! stores, when it accepts weights from this hotkey again, and how long the validator stays
//! in consensus. The daemon asks these before it submits, so a vector the chain must refuse
//! is never sent poll after poll, and `check` asks the same ones.
//!
//! Sources: subtensor `pallets/subtensor/src/subnets/weights.rs` (`do_set_weights`,
//! `check_length`, `max_weight_limited`, `is_self_weight`, `check_rate_limit`),
//! `pallets/subtensor/src/epoch/math.rs` (`vec_u16_max_upscale_to_u16`,
//! `check_vec_max_limited`) and `pallets/subtensor/src/epoch/run_epoch.rs` (a validator whose
//! `LastUpdate` is `activity_cutoff` or more blocks old is inactive).

use crate::schedule::Resolved;

/// subtensor's default `ActivityCutoff` (blocks), used only when this process never read the
/// subnet's own value (the chain was unreachable since start-up); every message says so.
pub const DEFAULT_ACTIVITY_CUTOFF: u16 = 5000;

/// Why the runtime would refuse `resolved` from `own_uid` (`do_set_weights`'s
/// `WeightVecLengthIsLow` and `MaxWeightExceeded` checks), `None` when it passes them.
///
/// * length: at least `min(subnet_n, min_allowed_weights)` dests, unless the vector is a
///   single self weight (`is_self_weight`: one dest equal to `own_uid`);
/// * largest weight: its share of the sum at most `max_weight_limit / 65535`, unless the
///   limit is 65535 or the vector is a single self weight (`max_weight_limited`; the
///   runtime normalises in I32F32, this compares the exact fractions).
pub fn refusal(
    resolved: &Resolved,
    own_uid: Option<u16>,
    subnet_n: usize,
    min_allowed_weights: u16,
    max_weight_limit: u16,
) -> Option<String> {
    let n = resolved.uids.len();
    let self_weight = n == 1 && own_uid.is_some() && resolved.uids.first() == own_uid.as_ref();
    if self_weight {
        return None;
    }
    let min_allowed = subnet_n.min(usize::from(min_allowed_weights));
    if n < min_allowed {
        return Some(format!(
            "{n} dest uid(s) but the subnet's min_allowed_weights is {min_allowed_weights} (subnet size {subnet_n}): the chain refuses it (WeightVecLengthIsLow)"
        ));
    }
    if max_weight_limit == u16::MAX {
        return None;
    }
    let sum: u64 = resolved.weights.iter().map(|w| u64::from(*w)).sum();
    let max = resolved.weights.iter().copied().max().unwrap_or(0);
    if sum > 0 && u64::from(max) * u64::from(u16::MAX) > u64::from(max_weight_limit) * sum {
        return Some(format!(
            "its largest weight is {:.1}% of the vector but the subnet's max_weight_limit is {max_weight_limit} ({:.1}%): the chain refuses it (MaxWeightExceeded)",
            max as f64 * 100.0 / sum as f64,
            f64::from(max_weight_limit) * 100.0 / f64::from(u16::MAX)
        ));
    }
    None
}

/// The weights the runtime stores for `weights` (`vec_u16_max_upscale_to_u16`): the largest
/// becomes 65535, the others scale with it in I32F32 fixed point, rounded to nearest; an
/// all-zero vector stays all zero.
pub fn max_upscale(weights: &[u16]) -> Vec<u16> {
    let max = u128::from(weights.iter().copied().max().unwrap_or(0));
    if max == 0 {
        return vec![0; weights.len()];
    }
    let (one, half, u) = (1u128 << 32, 1u128 << 31, u128::from(u16::MAX));
    weights
        .iter()
        .map(|&e| {
            let e = u128::from(e);
            // the runtime's two branches (avoiding I32F32 overflow above 32768)
            let fx = if max > 32768 {
                e * ((u << 32) / max)
            } else {
                ((e * u) << 32) / max
            };
            u16::try_from((fx + half) / one).unwrap_or(u16::MAX)
        })
        .collect()
}

/// The `Weights(netuid, uid)` row the runtime stores when `resolved` lands:
/// `(dest uid, max-upscaled weight)` in uid order.
pub fn stored_row(resolved: &Resolved) -> Vec<(u16, u16)> {
    resolved
        .uids
        .iter()
        .copied()
        .zip(max_upscale(&resolved.weights))
        .collect()
}

/// The first block at which the runtime accepts weights from a uid whose `LastUpdate` is
/// `last_update`, when the next block (`head + 1`) is still too early (`check_rate_limit`:
/// allowed when `block − last_update ≥ rate_limit`, or when `last_update` is 0, never set).
/// `None` when a submission now can pass the rate limit.
pub fn rate_limited_until(head: u64, last_update: u64, rate_limit: u64) -> Option<u64> {
    if last_update == 0 {
        return None;
    }
    let allowed_from = last_update.saturating_add(rate_limit);
    (head.saturating_add(1) < allowed_from).then_some(allowed_from)
}

/// How close the validator is to dropping out of consensus: blocks since its last landing
/// against the subnet's `activity_cutoff`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Blocks since the last landing (chain `LastUpdate`, or estimated from the wall clock).
    pub since: u64,
    /// The subnet's `ActivityCutoff` in blocks.
    pub cutoff: u64,
}

impl Activity {
    /// True once the last landing is older than half of `activity_cutoff`: the point where
    /// an operator must hear that nothing lands, with time left to act.
    pub fn alarming(&self) -> bool {
        self.since.saturating_mul(2) > self.cutoff
    }

    /// Blocks left before the validator is inactive (0 when it already is).
    pub fn remaining(&self) -> u64 {
        self.cutoff.saturating_sub(self.since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolved(uids: &[u16], weights: &[u16]) -> Resolved {
        Resolved {
            uids: uids.to_vec(),
            weights: weights.to_vec(),
            dropped: vec![],
            dropped_share: 0.0,
        }
    }

    #[test]
    fn length_and_largest_weight_follow_do_set_weights() {
        let one = resolved(&[3], &[65535]);
        // one dest with min_allowed_weights 2 on a 10-neuron subnet: refused
        let r = refusal(&one, Some(1), 10, 2, u16::MAX).unwrap();
        assert!(r.contains("WeightVecLengthIsLow"), "{r}");
        // ... unless the subnet has only one neuron, or it is a self weight
        assert_eq!(refusal(&one, Some(1), 1, 2, u16::MAX), None);
        assert_eq!(refusal(&one, Some(3), 10, 2, 100), None);
        // a single 65535 weight against max_weight_limit < 65535
        let r = refusal(&one, Some(1), 10, 1, 65534).unwrap();
        assert!(
            r.contains("MaxWeightExceeded") && r.contains("100.0%"),
            "{r}"
        );
        assert_eq!(refusal(&one, Some(1), 10, 1, u16::MAX), None);
        // the largest share against the limit's share of 65535, exactly at the edge
        let half = resolved(&[1, 2], &[32768, 32767]);
        assert_eq!(refusal(&half, None, 10, 1, 32768), None);
        assert!(refusal(&half, None, 10, 1, 32767).is_some());
        // an all-zero vector has no largest share
        assert_eq!(refusal(&resolved(&[1, 2], &[0, 0]), None, 10, 1, 1), None);
    }

    #[test]
    fn stored_rows_are_max_upscaled() {
        assert_eq!(max_upscale(&[65535, 0]), vec![65535, 0]);
        assert_eq!(max_upscale(&[1, 3]), vec![21845, 65535]);
        assert_eq!(max_upscale(&[0, 0]), vec![0, 0]);
        assert_eq!(
            stored_row(&resolved(&[4, 9], &[16384, 49151])),
            vec![(4, 21845), (9, 65535)]
        );
    }

    #[test]
    fn rate_limit_counts_from_last_update() {
        // LastUpdate 1000, limit 100: the block 1100 is the first accepted one
        assert_eq!(rate_limited_until(1050, 1000, 100), Some(1100));
        assert_eq!(rate_limited_until(1098, 1000, 100), Some(1100));
        assert_eq!(rate_limited_until(1099, 1000, 100), None);
        // never set
        assert_eq!(rate_limited_until(5, 0, 100), None);
        assert_eq!(rate_limited_until(1000, 1000, 0), None);
    }

    #[test]
    fn activity_alarm_at_half_the_cutoff() {
        let a = Activity {
            since: 2500,
            cutoff: 5000,
        };
        assert!(!a.alarming());
        let a = Activity {
            since: 2501,
            cutoff: 5000,
        };
        assert!(a.alarming());
        assert_eq!(a.remaining(), 2499);
        let gone = Activity {
            since: 6000,
            cutoff: 5000,
        };
        assert_eq!(gone.remaining(), 0);
    }
}
