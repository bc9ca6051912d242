//! Per-miner verdict summaries (`GET /v1/miners/{hotkey}`) and docs/PROTOCOL.md §8's cheat
//! gate ("cheat verdicts above 1 % per miner, with a minimum sample; `unproven` verdicts
//! never gate").
//!
//! The gate's rate is `failed / judged`, where `failed = cheat + unanswered` (a miner that
//! does not answer a challenge by its deadline must not gain by it: a refusal counts as the
//! cheat it may hide) and `judged = pass + cheat + unanswered` (`unproven` is left out, as
//! §8 says). The gate fires when `judged ≥ min_sample` and the rate is above
//! [`CHEAT_GATE_RATE`]. Beside the point rate the summary gives its 95 % Wilson score
//! interval (Wilson 1927; z = 1.959964), which stays inside [0, 1] and is not degenerate at
//! 0 or `judged` failures, so a reader sees how far a small sample's rate can be trusted;
//! `gate_certain` says whether the interval's lower end is already above the threshold.
use crate::store::Counts;

/// §8's threshold: a miner whose cheat rate is above 1 % is gated.
pub const CHEAT_GATE_RATE: f64 = 0.01;

/// The normal quantile of a two-sided 95 % interval.
const Z95: f64 = 1.959_964;

/// The 95 % Wilson score interval `(low, high)` of `k` successes in `n` trials; `(0, 1)`
/// when `n` is 0.
pub fn wilson95(k: u64, n: u64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let n_f = n as f64;
    let p = k.min(n) as f64 / n_f;
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / n_f;
    let centre = (p + z2 / (2.0 * n_f)) / denom;
    let half = Z95 * (p * (1.0 - p) / n_f + z2 / (4.0 * n_f * n_f)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// One miner's verdicts and §8's gate over them (all models, or one).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Verdicts written (every kind).
    pub audited: u64,
    /// `pass` verdicts.
    pub pass: u64,
    /// `cheat` verdicts.
    pub cheat: u64,
    /// `unproven` verdicts (never gate).
    pub unproven: u64,
    /// `unanswered` verdicts (counted as failed by the gate).
    pub unanswered: u64,
    /// `pass + cheat + unanswered`: the gate's sample.
    pub judged: u64,
    /// `(cheat + unanswered) / judged`; 0 when nothing is judged.
    pub cheat_rate: f64,
    /// The 95 % Wilson interval of `cheat_rate`, `[low, high]`.
    pub cheat_rate_wilson95: [f64; 2],
    /// The gate's minimum sample (`judged` needed before it may fire).
    pub min_sample: u64,
    /// Whether §8's gate fires: `judged ≥ min_sample` and `cheat_rate > 1 %`.
    pub gate_fires: bool,
    /// Whether the interval's lower end is above 1 % as well (the gate would fire at any
    /// plausible true rate, not only at the observed one).
    pub gate_certain: bool,
}

impl Summary {
    /// The summary of `c` with the gate's minimum sample `min_sample`.
    pub fn of(c: &Counts, min_sample: u64) -> Summary {
        let failed = c.cheat + c.unanswered;
        let judged = c.pass + failed;
        let cheat_rate = if judged == 0 {
            0.0
        } else {
            failed as f64 / judged as f64
        };
        let (low, high) = wilson95(failed, judged);
        let gate_fires = judged >= min_sample && judged > 0 && cheat_rate > CHEAT_GATE_RATE;
        Summary {
            audited: judged + c.unproven,
            pass: c.pass,
            cheat: c.cheat,
            unproven: c.unproven,
            unanswered: c.unanswered,
            judged,
            cheat_rate,
            cheat_rate_wilson95: [low, high],
            min_sample,
            gate_fires,
            gate_certain: gate_fires && low > CHEAT_GATE_RATE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_the_textbook_values() {
        // Newcombe (1998) table I: 0/10 → (0, 0.2775); 1/29 → (0.0061, 0.1718).
        let (lo, hi) = wilson95(0, 10);
        assert!(lo.abs() < 1e-12 && (hi - 0.2775).abs() < 1e-4, "{lo} {hi}");
        let (lo, hi) = wilson95(1, 29);
        assert!(
            (lo - 0.0061).abs() < 1e-4 && (hi - 0.1718).abs() < 1e-4,
            "{lo} {hi}"
        );
    }

    #[test]
    fn the_gate_needs_its_minimum_sample_and_ignores_unproven() {
        let c = Counts {
            pass: 5,
            cheat: 1,
            unproven: 50,
            unanswered: 0,
        };
        assert!(!Summary::of(&c, 20).gate_fires, "6 judged < 20");
        let s = Summary::of(&c, 6);
        assert!(s.gate_fires && s.judged == 6 && s.audited == 56);
        // A miner that never answers is gated like a cheat.
        let silent = Counts {
            pass: 30,
            unanswered: 3,
            ..Counts::default()
        };
        assert!(Summary::of(&silent, 20).gate_fires);
        let honest = Counts {
            pass: 200,
            unproven: 9,
            ..Counts::default()
        };
        assert!(!Summary::of(&honest, 20).gate_fires);
    }
}
