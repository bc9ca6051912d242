//! The challenged cells judged together (issue 39, item 4): one cell's `y` may sit anywhere
//! within the per-cell bound [`super::CellPolicy::y_rel`], but a serve whose every cell is off
//! the same way is not rounding.
//!
//! Four statistics over the cells that passed their own rules ([`judge_cells`]):
//!
//! 1. **The median of `y_err`** (`‖y − ŷ‖ / ‖ŷ‖`, [`super::CellCheck::y_err`]) must be at most
//!    [`StatsPolicy::y_median`]. Expert-only FP8 or int4 rounding moves every cell's `y` by
//!    the weights' rounding (a few percent), an honest serve by the activations' rounding
//!    order (a few tenths of a percent).
//! 2. **The mean of `y_bias`** (`⟨y − ŷ, ŷ⟩ / ‖ŷ‖²`, [`super::CellCheck::y_bias`]) must be
//!    within ±[`StatsPolicy::y_bias`]: rounding has no direction, a serve that scales its MoE
//!    outputs by `1 + s` has `s` on every cell.
//! 3. **The near-tie count**: a cell whose experts are another set than the top-k of its own
//!    recomputed scores, within the margin ([`super::default_cell_margin`]), is a near-tie. An
//!    honest serve's router rounds its logits and flips a choice only where two scores are
//!    within that rounding; a serve that takes the cheaper of two near experts does so at
//!    every near pair. The count must be below the smallest `k` with
//!    `P(Binomial(n, p₀) ≥ k) ≤ α` ([`near_tie_limit`]), `p₀` = [`StatsPolicy::near_tie_rate`],
//!    `α` = [`StatsPolicy::false_flag`].
//! 4. **The mean scaling of each part** (issue 39, item 4): the error `y − ŷ` fitted as
//!    `a · ŷ_routed + b · ŷ_shared` over the auditor's own routed and shared outputs
//!    ([`super::CellCheck::y_bias_routed`], [`super::CellCheck::y_bias_shared`]), so each part
//!    is judged against its own norm: the means of `a` and of `b` must be within
//!    ±[`StatsPolicy::y_bias_part`]. A serve that scales only its shared expert by 1.015 moves
//!    the whole output by its share of `ŷ` (+0.004 on the tiny Qwen3.5-MoE and GLM
//!    checkpoints, under `y_bias`; median `y_err` under `y_median`) but `b` by +0.015.
//!    Honest bf16 and f32 serves: largest `|mean a|`, `|mean b|` 0.0019 over 72 audits
//!    (`tests/cells_parts.rs`); 0.012 is six times that. Architectures without a shared
//!    expert (Qwen3-MoE) have neither.
//!
//! **Calibration** (`crates/engy-model/tests/cells.rs`: `honest_bundles_pass_and_scaled_or_
//! fp8_outputs_fail_the_statistics` and `honest_cells_pass_and_open_against_the_root`; the
//! numbers in bench/RESULTS.md "Cells: statistics"): honest serves of the devnet checkpoint in
//! bf16 and in f32, every cell checked against the f32 recompute (a bf16 serve is then judged
//! across numerics, as a GPU serve's fused kernels are); 24 bundles of 32 challenged cells, and
//! 10 648 cells one by one. The thresholds sit above the largest honest value seen and below
//! the smallest cheat:
//!
//! * `y_median` = 0.012: the largest honest bundle median was 0.0050 and the largest single
//!   honest cell 0.0103 (of 10 648), so the median exceeds 0.012 only when half the challenged
//!   cells lie beyond every honest cell seen; with none of 10 648 beyond it, the per-cell rate
//!   is below 3/10 648 (95% upper bound), and 16 of 32 such cells come with probability below
//!   10⁻⁴⁰. A uniformly 1.02-scaled `y` has a median of 0.021, expert-only FP8 rounding 0.050
//!   (each cell alone passes `y_rel` = 0.05 in the first case, half of them in the second).
//! * `y_bias` = 0.006 for `n` ≥ 4 cells, `0.012 / √n` below: the largest honest bundle mean
//!   was 0.0007 and the largest single honest cell 0.0059, so even one cell alone stays below
//!   its limit; rounding's mean shrinks as `1/√n`. A 1.02 scaling has +0.020 on every cell.
//! * `near_tie_rate` = 0.01, `false_flag` = 1e-6: honest bf16 and f32 serves checked across
//!   numerics showed 2 near-ties in 768 challenged cells of the devnet checkpoint (0.26%), and
//!   0/2048, 2/1536 and 3/1536 on the devnet, Qwen3.5-MoE and GLM-MoE-DSA checkpoints over 64,
//!   48 and 48 audits (`tests/cells_near_tie.rs`, 2026-12-06): 0.01 is four times the largest
//!   rate seen. `α` = 10⁻⁶ makes a false flag from near-ties one in a million judgements: at
//!   `n` = 32 the limit is 6 near-ties. A serve that takes a near-tied set wherever one is
//!   within the margin ([`super::CellServe::NearTieSwap`]) does so at 4–15% of its cells on
//!   those checkpoints; one 32-cell audit rarely holds 6 of them, so the count is also judged
//!   over a serve's ledger of audits ([`near_ties_flagged`]), where it is always flagged after
//!   32 (devnet) or 24 audits (Qwen3.5-MoE, GLM) and an honest ledger never is. On the
//!   softmax routers such a serve is caught cell by cell besides, unless it forges its
//!   committed logits (rule 2b of [`super`], `own_logits_gap`). bench/RESULTS.md "Cells:
//!   near-tie swaps" has the rates.
//!
//! **Quantised checkpoints** (FP8, NVFP4): sglang serves them W8A8 (issue 40), whose activation
//! quantisation moves `y` by a few percent against a recompute with bf16 activations, as much
//! as the expert-only cheats. Cells bound to the W8A8 recompute
//! ([`crate::audit::Recompute::plan_for_model`]) are checked by a W8A8 verifier and judged
//! with their own thresholds: [`super::CellPolicy::y_rel_w8a8`] 0.08 per cell and
//! [`StatsPolicy::y_median_w8a8`] 0.025 (the verifier quantises its f32 expert intermediates
//! where the serve quantised bf16 ones: honest W8A8 cells of the tiny GLM checkpoint have a
//! median `y_err` of 0.0107 and a largest of 0.0557 over 15 552 cells, bench/RESULTS.md
//! "Detection per cell: glm_moe_dsa"; honest W8A8 bundles of the Qwen3.5-MoE W8A8 oracle
//! checkpoint a largest median of 0.0167 over 18 audits, their largest `|mean y_bias|`
//! 0.0014 and part bias 0.0046, `tests/cells_w8a8.rs`); the bias rules are unchanged (a
//! 1.02-scaled W8A8 `y` is caught 18/18). Other quantised cells (bound to a W8A16 recompute) are not judged on `y_median`
//! and `y_bias` ([`CellStats::y_judged`] false); the per-cell rules and the near-tie count
//! still are.
use serde::Serialize;

use super::{CellCheck, CellRouting};

/// Default [`super::CellPolicy::x_rel`]: the largest relative L2 distance between a cell's `x`
/// and the recompute's. Measured (bench/RESULTS.md "Cells: statistics"): honest bf16 and f32
/// serves bound to the closest recompute of the plan: at most 0.014 over 768 challenged cells
/// of the devnet checkpoint, 0.045 and 0.002 over 384 each of the tiny Qwen3.5-MoE and
/// GLM-MoE-DSA checkpoints (an f32 serve is 0.18 from the bf16 recompute there); expert-only
/// FP8 rounding (which moves later layers' inputs) 0.03–0.15; a cell of zeros 1.0; cells
/// copied from another request up to 1.44, another model's 1.54. 0.25 leaves the honest side
/// a 5× margin for serves whose kernels round in another order
/// over many more layers (issue 40: an FP8 checkpoint's W8A8 serve must be bound to a W8A8
/// recompute in [`crate::audit::Recompute::plan`]), and the fabricated cells a 4× one.
pub const X_REL: f32 = 0.25;

/// Thresholds of the statistics (module docs give their derivation).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct StatsPolicy {
    /// Largest median `y_err` of the challenged cells.
    pub y_median: f32,
    /// [`StatsPolicy::y_median`] for cells bound to the W8A8 recompute (module docs).
    pub y_median_w8a8: f32,
    /// Largest `|mean y_bias|` of the challenged cells.
    pub y_bias: f32,
    /// Largest `|mean|` of each part's own scaling ([`super::CellCheck::y_bias_routed`],
    /// [`super::CellCheck::y_bias_shared`]) over the challenged cells.
    pub y_bias_part: f32,
    /// Upper bound of an honest serve's per-cell near-tie rate (`p₀`).
    pub near_tie_rate: f64,
    /// Largest probability that an honest serve's near-tie count is flagged (`α`).
    pub false_flag: f64,
}

impl Default for StatsPolicy {
    fn default() -> Self {
        Self {
            y_median: 0.012,
            y_median_w8a8: 0.025,
            y_bias: 0.006,
            y_bias_part: 0.012,
            near_tie_rate: 0.01,
            false_flag: 1e-6,
        }
    }
}

/// The statistics of a set of challenged cells ([`judge_cells`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellStats {
    /// Cells judged (those whose numbers were checked).
    pub n: usize,
    /// Whether the `y` statistics were judged (false on a quantised checkpoint: module docs).
    pub y_judged: bool,
    /// Median `y_err` over cells with a finite one.
    pub y_err_median: f32,
    /// Mean `y_bias` over cells with a finite one.
    pub y_bias_mean: f32,
    /// Mean [`super::CellCheck::y_bias_routed`] over the cells that have one (`None`: none
    /// has, an architecture without a shared expert).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub y_bias_routed_mean: Option<f32>,
    /// Mean [`super::CellCheck::y_bias_shared`] over the cells that have one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub y_bias_shared_mean: Option<f32>,
    /// Cells whose routing was a near-tie.
    pub near_ties: usize,
    /// The smallest near-tie count that is flagged ([`near_tie_limit`]).
    pub near_tie_limit: usize,
    /// Every failed statistic, in words (empty when none failed).
    pub failures: Vec<String>,
}

impl CellStats {
    /// Whether every statistic held.
    pub fn pass(&self) -> bool {
        self.failures.is_empty()
    }
}

/// `P(Binomial(n, p) ≥ k)`, summed in f64 from the log-pmf.
pub fn binomial_tail(n: usize, p: f64, k: usize) -> f64 {
    if k == 0 {
        return 1.0;
    }
    if k > n || p <= 0.0 {
        return 0.0;
    }
    if p >= 1.0 {
        return 1.0;
    }
    let (lp, lq) = (p.ln(), (1.0 - p).ln());
    // ln C(n, i) built up incrementally from ln C(n, 0) = 0.
    let mut ln_c = 0f64;
    let mut tail = 0f64;
    for i in 0..=n {
        if i > 0 {
            ln_c += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        if i >= k {
            tail += (ln_c + i as f64 * lp + (n - i) as f64 * lq).exp();
        }
    }
    tail.min(1.0)
}

/// The smallest near-tie count `k` among `n` cells with `P(Binomial(n, p₀) ≥ k) ≤ α`: a
/// count of `k` or more is flagged, and an honest serve whose per-cell rate is at most `p₀`
/// is flagged with probability at most `α`. `n + 1` (never flagged) when no `k ≤ n` is that
/// unlikely. O(n): the tail is summed once from `n` down.
pub fn near_tie_limit(n: usize, p0: f64, alpha: f64) -> usize {
    if p0 <= 0.0 {
        // No honest near-tie at all: the first one is flagged.
        return 1;
    }
    if p0 >= 1.0 {
        return n + 1;
    }
    let (lp, lq) = (p0.ln(), (1.0 - p0).ln());
    // ln C(n, i) for every i, built up from ln C(n, 0) = 0.
    let mut acc = 0f64;
    let ln_c: Vec<f64> = std::iter::once(0.0)
        .chain((1..=n).map(|i| {
            acc += ((n - i + 1) as f64).ln() - (i as f64).ln();
            acc
        }))
        .collect();
    let mut tail = 0f64;
    let mut limit = n + 1;
    for k in (1..=n).rev() {
        tail += (ln_c[k] + k as f64 * lp + (n - k) as f64 * lq).exp();
        if tail > alpha {
            break;
        }
        limit = k;
    }
    limit
}

/// Whether `near_ties` near-ties among `cells` judged cells reach the limit of `policy`
/// ([`near_tie_limit`]). The per-audit statistic of [`judge_cells`] on its own `n`; the
/// same test over a serve's ledger (the sums of [`CellStats::near_ties`] and [`CellStats::n`]
/// over all its audits) keeps the false-flag bound `α` per judgement and gains power with
/// every audit: a serve that takes a near-tied set at a few percent of its cells is rarely
/// past the limit of one 32-cell audit, always past it over a few dozen (bench/RESULTS.md
/// "Cells: near-tie swaps").
pub fn near_ties_flagged(near_ties: usize, cells: usize, policy: &StatsPolicy) -> bool {
    near_ties >= near_tie_limit(cells, policy.near_tie_rate, policy.false_flag)
}

/// The limit of `|mean y_bias|` over `n` cells: `y_bias`, or `2 · y_bias / √n` when that is
/// larger (fewer than four cells; module docs).
pub fn bias_limit(y_bias: f32, n: usize) -> f32 {
    y_bias.max(2.0 * y_bias / (n.max(1) as f32).sqrt())
}

/// Judges `checks` together (module docs). Cells with a non-finite `y_err` (they failed on
/// their own) are left out of the `y` statistics; `quantized` turns those off (module docs).
pub fn judge_cells(checks: &[&CellCheck], policy: &StatsPolicy, quantized: bool) -> CellStats {
    let mut errs: Vec<f32> = checks
        .iter()
        .map(|c| c.y_err)
        .filter(|e| e.is_finite())
        .collect();
    errs.sort_by(f32::total_cmp);
    let median = match errs.len() {
        0 => 0.0,
        m if m % 2 == 1 => errs[m / 2],
        m => 0.5 * (errs[m / 2 - 1] + errs[m / 2]),
    };
    let biases: Vec<f64> = checks
        .iter()
        .map(|c| f64::from(c.y_bias))
        .filter(|b| b.is_finite())
        .collect();
    let bias = if biases.is_empty() {
        0.0
    } else {
        (biases.iter().sum::<f64>() / biases.len() as f64) as f32
    };
    let part_mean = |f: fn(&CellCheck) -> Option<f32>| {
        let v: Vec<f64> = checks
            .iter()
            .filter_map(|c| f(c))
            .filter(|b| b.is_finite())
            .map(f64::from)
            .collect();
        (!v.is_empty()).then(|| ((v.iter().sum::<f64>() / v.len() as f64) as f32, v.len()))
    };
    let routed = part_mean(|c| c.y_bias_routed);
    let shared = part_mean(|c| c.y_bias_shared);
    let n = checks.len();
    let near_ties = checks
        .iter()
        .filter(|c| c.routing == CellRouting::NearTie)
        .count();
    let limit = near_tie_limit(n, policy.near_tie_rate, policy.false_flag);
    let mut failures = Vec::new();
    if !quantized {
        if median > policy.y_median {
            failures.push(format!(
                "the median block-output error of {} cells is {median:.4}, more than {} \
                 (honest rounding stays below it)",
                errs.len(),
                policy.y_median
            ));
        }
        let bias_limit = bias_limit(policy.y_bias, biases.len());
        if bias.abs() > bias_limit {
            failures.push(format!(
                "the block outputs are scaled by {:+.4} on average over {} cells, more than \
                 ±{bias_limit:.4}",
                bias,
                biases.len(),
            ));
        }
        for (part, mean) in [("routed", routed), ("shared", shared)] {
            let Some((mean, count)) = mean else {
                continue;
            };
            let limit = self::bias_limit(policy.y_bias_part, count);
            if mean.abs() > limit {
                failures.push(format!(
                    "the {part} experts' outputs are scaled by {mean:+.4} on average over \
                     {count} cells (against their own norm), more than ±{limit:.4}"
                ));
            }
        }
    }
    if near_ties >= limit {
        failures.push(format!(
            "{near_ties} of {n} cells take a near-tied expert set; an honest serve (rate ≤ {}) \
             reaches {limit} with probability ≤ {:e}",
            policy.near_tie_rate, policy.false_flag
        ));
    }
    CellStats {
        n,
        y_judged: !quantized,
        y_err_median: median,
        y_bias_mean: bias,
        y_bias_routed_mean: routed.map(|(m, _)| m),
        y_bias_shared_mean: shared.map(|(m, _)| m),
        near_ties,
        near_tie_limit: limit,
        failures,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binomial_tail_matches_closed_forms() {
        // P(X ≥ 1) = 1 − (1 − p)^n.
        let t = binomial_tail(32, 0.02, 1);
        assert!((t - (1.0 - 0.98f64.powi(32))).abs() < 1e-12, "{t}");
        // P(X ≥ n) = p^n.
        assert!((binomial_tail(5, 0.5, 5) - 0.03125).abs() < 1e-12);
        assert_eq!(binomial_tail(5, 0.5, 0), 1.0);
        assert_eq!(binomial_tail(5, 0.5, 6), 0.0);
    }

    #[test]
    fn near_tie_limit_is_the_first_unlikely_count() {
        let k = near_tie_limit(32, 0.02, 1e-6);
        assert!(binomial_tail(32, 0.02, k) <= 1e-6);
        assert!(binomial_tail(32, 0.02, k - 1) > 1e-6);
        // One cell can never be unlikely enough at α = 1e-6 with p₀ = 0.02.
        assert_eq!(near_tie_limit(1, 0.02, 1e-6), 2);
        // The O(n) sum agrees with the tail summed per k, small and ledger-sized.
        for (n, p) in [(32, 0.01), (32, 0.02), (1024, 0.01), (5000, 0.003)] {
            let k = near_tie_limit(n, p, 1e-6);
            assert!(binomial_tail(n, p, k) <= 1e-6, "{n} {p} {k}");
            assert!(binomial_tail(n, p, k - 1) > 1e-6, "{n} {p} {k}");
        }
        assert_eq!(near_tie_limit(0, 0.02, 1e-6), 1);
    }
}
