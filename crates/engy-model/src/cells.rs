//! The sampled cell audit's numeric check (specs/CELLS.md §4, last step; docs/AUDITOR.md
//! "Cells"): one opened cell — an MoE block's input `x`, the router logits, the experts used,
//! the block's output `y` — against the checkpoint's weights.
//!
//! 0. **Finite**: `x` and the router logits must be finite (a NaN logit would vanish in the
//!    largest-error fold below; the cell format refuses them too).
//! 1. **Router logits**: the recompute `x · W_rᵀ` (f32 from the committed bf16 `x`) must equal
//!    the committed logits within `|Δ| ≤ logits_abs + logits_rel · |ℓ̂|` per expert (a bf16
//!    router's rounding plus GEMM accumulation order).
//! 2. **Routing**: the committed expert set must be the architecture's own top-k of the
//!    recomputed scores, or a near-tie within the cell margin ([`default_cell_margin`]).
//!    On the softmax routers (the Qwen MoEs) the committed experts must also be the top-k of
//!    the cell's own committed logits: a serve routes from the logits it commits, so a set
//!    taken within the margin against the router's own choice shows there (issue 39,
//!    systematic near-tie swaps).
//! 3. **Output**: the recomputed block output — the committed experts dispatched, weighted by
//!    the rule from the recomputed router scores, plus the shared expert — must be within a
//!    relative L2 distance `y_rel` of the committed `y`.
//!
//! Only the tensors the cell touches are read ([`crate::Architecture::moe_block`] on a model
//! opened with [`crate::Residency::Streaming`]: the router, the experts dispatched and the
//! shared expert of that layer; every other tensor stays an unread mmapped page).
//! [`verify_cell_committed`] first checks those tensors' bytes against the checkpoint's
//! committed `model_root` ([`weights`]).
//!
//! A cell alone is only self-consistent: [`audit_bundle_with_recompute`] binds each
//! challenged cell's `x` to the auditor's own recompute of the request ([`recompute`]) and
//! judges the challenged cells together ([`stats`]: median `y` error, mean `y` bias, near-tie
//! count), which is what catches a serve whose every cell is slightly off.
//!
//! Beside it: [`serve_cells`], the cells a serve commits, honest or cheating, and [`cheat`],
//! the checkpoint copies of the expert-only cheats.
use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use engy_core::cells::Cell;
use serde::Serialize;

use crate::arch::{CommittedRouting, Margin, Probe, RoutingCheck, RoutingShape};
use crate::audit::ROUTING_MARGIN_REL;
use crate::{Model, ModelError};

pub mod audit;
pub mod cheat;
pub mod recompute;
pub mod stats;
pub mod weights;

pub use audit::{
    audit_bundle, audit_bundle_with_recompute, BundleAuditError, BundleCell, BundleReport,
    BundleVerdict, RecomputeBinding,
};
pub use cheat::{write_expert_cheat, ExpertQuant};
pub use stats::{judge_cells, CellStats};
pub use weights::{CommittedWeights, Openings, WeightCheckError};

/// Tolerances of the cell check (calibration: [`stats`] module docs and docs/AUDITOR.md
/// "Cells").
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct CellPolicy {
    /// Absolute part of the router-logit tolerance.
    pub logits_abs: f32,
    /// Relative part of the router-logit tolerance (fraction of the recomputed logit).
    pub logits_rel: f32,
    /// Largest relative L2 distance `‖y − ŷ‖ / ‖ŷ‖` of a passing output (one cell alone; the
    /// challenged cells together are judged by [`stats`]).
    pub y_rel: f32,
    /// Absolute routing near-tie margin of a cell (scores recomputed from the cell's own `x`);
    /// `None`: the architecture's default ([`default_cell_margin`]), tighter than the routing
    /// trace's ([`crate::audit::default_routing_margin`]), which also absorbs the recompute's drift.
    pub margin: Option<f32>,
    /// Largest relative L2 distance `‖x − x̂‖ / ‖x̂‖` between a cell's `x` and the
    /// recompute's MoE input at its (position, layer) ([`audit_bundle_with_recompute`]).
    pub x_rel: f32,
    /// [`CellPolicy::y_rel`] for cells bound to the W8A8 recompute (a block-FP8 checkpoint
    /// served as sglang does): the verifier's W8A8 quantises its own f32 expert
    /// intermediates where the serve quantised bf16 ones, so a few honest cells' `y` differ by
    /// more than 5% (bench/RESULTS.md "Cells: W8A8"; [`stats`] module docs).
    pub y_rel_w8a8: f32,
    /// The recomputes tried for that binding ([`crate::audit::Recompute::plan`]); the one
    /// closest to the cells is kept.
    pub recompute: crate::audit::Recompute,
    /// The statistics over the challenged cells ([`stats::StatsPolicy`]).
    pub stats: stats::StatsPolicy,
}

impl Default for CellPolicy {
    fn default() -> Self {
        Self {
            logits_abs: 1.0 / 64.0,
            logits_rel: 1.0 / 64.0,
            y_rel: 0.05,
            y_rel_w8a8: 0.08,
            margin: None,
            x_rel: stats::X_REL,
            recompute: crate::audit::Recompute::Auto,
            stats: stats::StatsPolicy::default(),
        }
    }
}

/// The absolute near-tie margin of a cell's routing, in the architecture's score units: the
/// scores are recomputed from the cell's own `x`, so only the router's rounding separates
/// them from the serve's (module docs of [`stats`]): router logits for the Qwen MoEs (1/32,
/// twice the logit tolerance's absolute part; the relative part [`ROUTING_MARGIN_REL`] covers
/// a bf16 router's ulps), `sigmoid + bias` for GLM (1/128: the sigmoid's slope is at most 1/4,
/// so twice the logit tolerance moves a score by at most 1/128; GLM's router runs in f32). The
/// routing trace's margin ([`crate::audit::default_routing_margin`], 0.33 on GLM) is wider because its
/// scores come from the recompute's own hidden states, which DSA ties move.
pub fn default_cell_margin(kind: crate::arch::ArchKind) -> f32 {
    match kind {
        crate::arch::ArchKind::Qwen3Moe | crate::arch::ArchKind::Qwen3_5Moe => 1.0 / 32.0,
        crate::arch::ArchKind::GlmMoeDsa => 1.0 / 128.0,
    }
}

/// How the committed experts compare with the recompute's own routing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CellRouting {
    /// The same set.
    Agree,
    /// Another set within the margin.
    NearTie,
    /// Another set outside the margin (or ids that are no expert).
    Mismatch,
}

/// The check of one cell.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CellCheck {
    /// Token position.
    pub position: u32,
    /// Decoder layer.
    pub layer: u32,
    /// Largest `|Δℓ| / (logits_abs + logits_rel · |ℓ̂|)` over experts (≤ 1 passes).
    pub logits_err: f32,
    /// The routing comparison.
    pub routing: CellRouting,
    /// For a [`CellRouting::NearTie`]: how far the committed set sits below the recomputed
    /// top-k (the best unchosen score minus the worst chosen one,
    /// [`crate::arch::routing::set_gap`]), in the architecture's score units (router logits
    /// for the Qwen MoEs, `sigmoid + bias` for GLM); `None` otherwise. An honest serve's
    /// near-ties are its router's rounding, a sliver of the margin; a serve that picks within
    /// the margin spreads them over all of it ([`stats`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub near_tie_gap: Option<f32>,
    /// `‖y − ŷ‖ / ‖ŷ‖`.
    pub y_err: f32,
    /// `⟨y − ŷ, ŷ⟩ / ‖ŷ‖²`: the error's part along the recompute's output (a serve that scales
    /// every output by `1 + s` has `s` here on every cell; rounding averages to 0).
    pub y_bias: f32,
    /// The error `y − ŷ` fitted as `a · ŷ_routed + b · ŷ_shared` (least squares over the
    /// auditor's own routed and shared outputs): `a`, the routed part's scaling relative to
    /// its own norm; `None` on an architecture without a shared expert (or parts too close to
    /// collinear to split). A serve that scales one part by `1 + s` has `s` here while the
    /// whole-output [`CellCheck::y_bias`] sees only that part's share of `ŷ` ([`stats`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub y_bias_routed: Option<f32>,
    /// `b` of [`CellCheck::y_bias_routed`]: the shared part's scaling relative to its own norm.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub y_bias_shared: Option<f32>,
    /// `‖x − x̂‖ / ‖x̂‖` against the recompute's MoE input at (position, layer), when the cell
    /// was bound to a recompute ([`audit_bundle_with_recompute`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub x_err: Option<f32>,
    /// Every failed rule, in words (empty when the cell passes).
    pub failures: Vec<String>,
}

impl CellCheck {
    /// Whether every rule held.
    pub fn pass(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Checks `cell` against `model`'s weights (module docs). A cell that does not fit the model
/// (a dense layer, other sizes) fails with the reason; it is never an error.
///
/// # Errors
/// Only the verifier's own failures: weight decoding and tensor operations.
pub fn verify_cell(
    model: &Model,
    cell: &Cell,
    policy: &CellPolicy,
) -> Result<CellCheck, ModelError> {
    let (position, layer) = (cell.position(), cell.layer());
    let mut check = CellCheck {
        position,
        layer,
        logits_err: f32::INFINITY,
        routing: CellRouting::Mismatch,
        near_tie_gap: None,
        y_err: f32::INFINITY,
        y_bias: f32::INFINITY,
        y_bias_routed: None,
        y_bias_shared: None,
        x_err: None,
        failures: Vec::new(),
    };
    let shape = match fit(model, cell) {
        Ok(shape) => shape,
        Err(why) => {
            check.failures.push(why);
            return Ok(check);
        }
    };
    let hidden = model.config().hidden_size;
    let x: Vec<f32> = cell.x().iter().map(|v| v.to_f32()).collect();
    if x.iter().any(|v| !v.is_finite()) {
        check.failures.push("x is not finite".into());
        return Ok(check);
    }
    let theirs = cell.router_logits().to_f32();
    if theirs.iter().any(|v| !v.is_finite()) {
        // NaN would vanish in the max below (f32::max ignores NaN): refuse it here.
        check.failures.push("router logits are not finite".into());
        return Ok(check);
    }
    let x = Tensor::from_vec(x, (1, hidden), &Device::Cpu)?;
    let committed = committed_cell(shape, position as usize, layer as usize, cell.expert_ids());
    let margin = Margin {
        abs: policy
            .margin
            .unwrap_or_else(|| default_cell_margin(model.config().kind)),
        rel: ROUTING_MARGIN_REL,
    };
    // One pass: the block dispatches the committed experts whatever the recompute's own
    // choice, and the check classifies the set with the real margin.
    let mut classify = RoutingCheck::new(committed, margin, true).dispatching_committed();
    let mut logits = BTreeMap::new();
    let mut shared = Vec::new();
    let out = model.arch().moe_block(
        layer as usize,
        &x,
        position as usize,
        &mut Probe {
            check: Some(&mut classify),
            router_logits: Some(&mut logits),
            shared: Some(&mut shared),
            ..Probe::default()
        },
    )?;
    let Some(y_hat) = out else {
        check
            .failures
            .push(format!("layer {layer} is not an MoE layer of the model"));
        return Ok(check);
    };
    let t = classify.totals();
    check.routing = if t.agree == 1 {
        CellRouting::Agree
    } else if t.near_tie == 1 {
        check.near_tie_gap = classify.near_tie_gaps().first().copied();
        CellRouting::NearTie
    } else {
        CellRouting::Mismatch
    };
    if check.routing == CellRouting::Mismatch {
        check.failures.push(format!(
            "the experts {:?} are not the router's top-{} within the margin",
            cell.expert_ids(),
            shape.top_k
        ));
    } else if let Some(gap) = own_logits_gap(model.config().kind, &theirs, cell.expert_ids()) {
        check.failures.push(format!(
            "the experts {:?} are not the top-{} of the cell's own router logits (an unchosen \
             logit is {gap:.5} above a chosen one)",
            cell.expert_ids(),
            shape.top_k
        ));
    }
    // Router logits.
    let own = logits
        .get(&(position as usize, layer as usize))
        .cloned()
        .unwrap_or_default();
    check.logits_err = own
        .iter()
        .zip(&theirs)
        .map(|(&o, &t)| (t - o).abs() / (policy.logits_abs + policy.logits_rel * o.abs()))
        .fold(0.0, f32::max);
    if own.len() != theirs.len() || !check.logits_err.is_finite() || check.logits_err > 1.0 {
        check.failures.push(format!(
            "router logits differ from x·W_r by {:.2}× the tolerance",
            check.logits_err
        ));
    }
    // Output.
    let y_hat = y_hat.flatten_all()?.to_vec1::<f32>()?;
    let (mut num, mut den, mut dot) = (0f64, 0f64, 0f64);
    for (a, b) in cell.y().iter().zip(&y_hat) {
        let d = f64::from(a.to_f32()) - f64::from(*b);
        num += d * d;
        den += f64::from(*b) * f64::from(*b);
        dot += d * f64::from(*b);
    }
    check.y_err = (num.sqrt() / den.sqrt().max(f64::MIN_POSITIVE)) as f32;
    check.y_bias = (dot / den.max(f64::MIN_POSITIVE)) as f32;
    if let Some(s) = shared.first() {
        let s = s.flatten_all()?.to_vec1::<f32>()?;
        let y: Vec<f32> = cell.y().iter().map(|v| v.to_f32()).collect();
        if let Some((a, b)) = part_biases(&y, &y_hat, &s) {
            check.y_bias_routed = Some(a);
            check.y_bias_shared = Some(b);
        }
    }
    if !check.y_err.is_finite() || check.y_err > policy.y_rel {
        check.failures.push(format!(
            "the block output is {:.4} (relative L2) from the recompute, more than {}",
            check.y_err, policy.y_rel
        ));
    }
    Ok(check)
}

/// The least-squares `(a, b)` of `y − ŷ ≈ a · (ŷ − s) + b · s` ([`CellCheck::y_bias_routed`]),
/// in f64; `None` for lengths that differ, non-finite values, or parts too close to collinear
/// (the 2×2 Gram determinant below 10⁻⁶ of its diagonal product, `s` or `ŷ − s` zero among
/// them).
fn part_biases(y: &[f32], y_hat: &[f32], s: &[f32]) -> Option<(f32, f32)> {
    if y.len() != y_hat.len() || s.len() != y_hat.len() {
        return None;
    }
    let (mut rr, mut rs, mut ss, mut dr, mut ds) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for ((&y, &h), &s) in y.iter().zip(y_hat).zip(s) {
        let (y, h, s) = (f64::from(y), f64::from(h), f64::from(s));
        let (r, d) = (h - s, y - h);
        rr += r * r;
        rs += r * s;
        ss += s * s;
        dr += d * r;
        ds += d * s;
    }
    let det = rr * ss - rs * rs;
    if !det.is_finite() || det <= 1e-6 * rr * ss || rr == 0.0 || ss == 0.0 {
        return None;
    }
    let a = (dr * ss - ds * rs) / det;
    let b = (ds * rr - dr * rs) / det;
    (a.is_finite() && b.is_finite()).then_some((a as f32, b as f32))
}

/// Rule 2b (issue 39, systematic near-tie swaps): on the softmax routers (the Qwen MoEs, whose
/// top-k is the top-k of the logits), a serve routes from the very logits it commits, so its
/// experts are the top-k of the cell's own `router_logits` (equal logits may go either way).
/// A serve that takes another set within the margin and commits its router's true logits
/// breaks this at every such cell; to pass it must also move the committed logits, which the
/// logit rule bounds and the near-tie count judges ([`stats`]). Returns how far the best
/// unchosen logit is above the worst chosen one when it is (`None`: consistent, or an
/// architecture whose scores are not the logits alone: GLM's `sigmoid + bias`).
fn own_logits_gap(kind: crate::arch::ArchKind, logits: &[f32], ids: &[u32]) -> Option<f32> {
    if !matches!(
        kind,
        crate::arch::ArchKind::Qwen3Moe | crate::arch::ArchKind::Qwen3_5Moe
    ) {
        return None;
    }
    let gap = crate::arch::routing::set_gap(logits, ids);
    (gap.is_finite() && gap > 0.0).then_some(gap)
}

/// The model's routing shape when `cell` fits it (sizes, layer in range), else why not.
fn fit(model: &Model, cell: &Cell) -> Result<RoutingShape, String> {
    let Some(shape) = model.routing_shape() else {
        return Err("the model has no MoE layers".into());
    };
    let hidden = model.config().hidden_size;
    let sizes = (
        cell.hidden() as usize,
        cell.n_experts() as usize,
        cell.top_k() as usize,
    );
    let layer = cell.layer();
    if sizes != (hidden, shape.experts, shape.top_k) || layer as usize >= shape.layers {
        return Err(format!(
            "the cell is (hidden, experts, top_k) = {sizes:?} at layer {layer}; the model has \
             ({hidden}, {}, {}) and {} layers",
            shape.experts, shape.top_k, shape.layers
        ));
    }
    Ok(shape)
}

/// Why a cell could not be checked against committed weights.
#[derive(Debug, thiserror::Error)]
pub enum CommittedCellError {
    /// A touched unit's bytes do not match the trusted `model_root`: the auditor's checkpoint
    /// is not the committed one (nothing is said about the miner).
    #[error(transparent)]
    Weights(#[from] WeightCheckError),
    /// The recompute failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// [`verify_cell`] after checking the tensors the cell touches (its layer's router and
/// shared expert, its experts) against the trusted root ([`CommittedWeights::check_cell`]).
/// `weights` must index the checkpoint `model` was loaded from. A cell that does not fit the
/// model, or sits at a layer without a router, fails in [`verify_cell`] without a weight read.
///
/// # Errors
/// [`CommittedCellError::Weights`] naming the unit (and, with opening proofs, the tensor)
/// that differs; [`CommittedCellError::Model`] as [`verify_cell`].
pub fn verify_cell_committed(
    model: &Model,
    weights: &CommittedWeights,
    cell: &Cell,
    policy: &CellPolicy,
) -> Result<CellCheck, CommittedCellError> {
    if fit(model, cell).is_ok() && weights.is_moe_layer(cell.layer()) {
        weights.check_cell(cell)?;
    }
    Ok(verify_cell(model, cell, policy)?)
}

/// A one-cell trace: `ids` at (`position`, `layer`), the rest of the row 0.
fn committed_cell(
    shape: RoutingShape,
    position: usize,
    layer: usize,
    ids: &[u32],
) -> CommittedRouting {
    let mut row = vec![0; shape.per_position()];
    let at = layer * shape.top_k;
    for (j, &e) in ids.iter().take(shape.top_k).enumerate() {
        row[at + j] = e;
    }
    CommittedRouting {
        start: position,
        shape,
        ids: row,
    }
}

/// How a serve builds its cells ([`serve_cells`]): honestly, or with one of the cheats the
/// sampled audit must catch where TOPLOC is weakest (docs/AUDITOR.md "Cells").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum CellServe {
    /// The block's true input, logits, experts and output.
    Honest,
    /// The routed experts run in int4 ([`ExpertQuant::Int4`], group 32), the router,
    /// attention and shared expert exact: `model` must be loaded from the copy
    /// [`write_expert_cheat`] wrote; its cells are built as [`CellServe::Honest`] builds them
    /// (that serve's true values, which the committed experts do not give).
    Int4Experts,
    /// As [`CellServe::Int4Experts`] with block FP8 E4M3 experts ([`ExpertQuant::Fp8`]).
    Fp8Experts,
    /// Computes only the top `k − 1` experts but reports all `k` ids.
    TopKReduced,
    /// Runs another expert's weights (the next id) in place of the last chosen one, reporting
    /// the chosen ids.
    ExpertSwap,
    /// Reports the previous position's block output (a plausible `y` that was never computed
    /// from this `x`).
    FabricatedY,
    /// Systematic near-tie swaps (issue 39): wherever another expert set — one chosen expert
    /// swapped for one unchosen — is within the cell margin of the router's top-k
    /// ([`default_cell_margin`], as the auditor classifies it), dispatches and reports that set
    /// instead (the one whose swapped-in expert has the lowest id: the designated cheap
    /// experts), with the block output of the experts it ran. Each such cell alone is a
    /// legal near-tie; only the rate betrays the serve ([`stats`]).
    NearTieSwap,
}

impl CellServe {
    /// Every serve, honest first.
    pub const ALL: [CellServe; 7] = [
        CellServe::Honest,
        CellServe::Int4Experts,
        CellServe::Fp8Experts,
        CellServe::TopKReduced,
        CellServe::ExpertSwap,
        CellServe::FabricatedY,
        CellServe::NearTieSwap,
    ];

    /// The checkpoint copy this serve runs ([`write_expert_cheat`]), for the expert-only
    /// cheats; `None` for serves of the honest checkpoint.
    pub fn expert_quant(self) -> Option<ExpertQuant> {
        match self {
            CellServe::Int4Experts => Some(ExpertQuant::Int4 { group_size: 32 }),
            CellServe::Fp8Experts => Some(ExpertQuant::Fp8),
            _ => None,
        }
    }

    /// Its name in tables and logs (`honest`, `int4-experts`, …).
    pub fn label(self) -> &'static str {
        match self {
            CellServe::Honest => "honest",
            CellServe::Int4Experts => "int4-experts",
            CellServe::Fp8Experts => "fp8-experts",
            CellServe::TopKReduced => "top-k-reduced",
            CellServe::ExpertSwap => "expert-swap",
            CellServe::FabricatedY => "fabricated-y",
            CellServe::NearTieSwap => "near-tie-swap",
        }
    }
}

/// The cells (specs/CELLS.md §2) of one teacher-forced pass of `model` over `ids` (every
/// position, every MoE layer, in leaf order: position-major, then layer), built as `serve`
/// builds them. The router logits are committed in the dtype the model computes them in
/// (bf16 for a [`crate::Compute::Bf16`] Qwen router, f32 otherwise); `x` and `y` are rounded to
/// bf16.
///
/// # Errors
/// [`ModelError`] from the forward pass; [`ModelError::Config`] for a model without MoE layers
/// or a cell the format refuses.
pub fn serve_cells(model: &Model, ids: &[u32], serve: CellServe) -> Result<Vec<Cell>, ModelError> {
    use engy_core::cells::RouterLogits;
    use half::bf16;

    let shape = model
        .routing_shape()
        .ok_or_else(|| ModelError::Config("the model has no MoE layers".into()))?;
    let mut blocks = Vec::new();
    let mut logits = BTreeMap::new();
    let mut record = crate::arch::RoutingRecord::new(shape);
    model.hidden_states_probed(
        ids,
        &mut Probe {
            blocks: Some(&mut blocks),
            router_logits: Some(&mut logits),
            routing: Some(&mut record),
            ..Probe::default()
        },
    )?;
    let bf16_logits = model.compute() == crate::Compute::Bf16
        && matches!(
            model.config().kind,
            crate::arch::ArchKind::Qwen3Moe | crate::arch::ArchKind::Qwen3_5Moe
        );
    let to_bf16 = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&f| bf16::from_f32(f)).collect() };
    let mut by_cell: BTreeMap<(usize, usize), Cell> = BTreeMap::new();
    let mut prev_y: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    for b in &blocks {
        let xs = b.x.to_vec2::<f32>()?;
        let ys = b.y.to_vec2::<f32>()?;
        for (i, (x, y)) in xs.iter().zip(&ys).enumerate() {
            let pos = b.first + i;
            let own = record.ids(pos, pos + 1);
            let mut chosen: Vec<u32> =
                own[b.layer * shape.top_k..(b.layer + 1) * shape.top_k].to_vec();
            let y = match serve {
                CellServe::Honest | CellServe::Int4Experts | CellServe::Fp8Experts => y.clone(),
                CellServe::FabricatedY => prev_y
                    .get(&b.layer)
                    .cloned()
                    .unwrap_or_else(|| y.iter().map(|v| -v).collect()),
                CellServe::NearTieSwap => {
                    match near_tie_swap(model, shape, b.layer, pos, x, &chosen)? {
                        Some((set, y)) => {
                            chosen = set;
                            y
                        }
                        None => y.clone(),
                    }
                }
                CellServe::TopKReduced | CellServe::ExpertSwap => {
                    let mut used = chosen.clone();
                    if serve == CellServe::TopKReduced {
                        used.pop();
                    } else if let Some(last) = used.last_mut() {
                        *last = (*last + 1) % shape.experts as u32;
                        while chosen.contains(last) {
                            *last = (*last + 1) % shape.experts as u32;
                        }
                    }
                    forced_block(model, shape, b.layer, pos, x, &used)?
                }
            };
            prev_y.insert(b.layer, ys[i].clone());
            let l = logits.get(&(pos, b.layer)).cloned().unwrap_or_default();
            let router = if bf16_logits {
                RouterLogits::Bf16(to_bf16(&l))
            } else {
                RouterLogits::F32(l)
            };
            chosen.sort_unstable();
            let cell = Cell::new(
                pos as u32,
                b.layer as u32,
                to_bf16(x),
                router,
                chosen,
                to_bf16(&y),
            )
            .map_err(|e| ModelError::Config(format!("cell ({pos}, {}): {e}", b.layer)))?;
            by_cell.insert((pos, b.layer), cell);
        }
    }
    Ok(by_cell.into_values().collect())
}

/// A row's swapped expert set and the block output with it ([`near_tie_swap`]).
type SwappedRow = (Vec<u32>, Vec<f32>);

/// The set [`CellServe::NearTieSwap`] takes at one row: among the sets that swap one of
/// `chosen` for one unchosen expert and that the cell check classifies as a near-tie (margin
/// [`default_cell_margin`]), the one whose swapped-in expert has the lowest id, with its block
/// output; `None` when no swap is within the margin.
fn near_tie_swap(
    model: &Model,
    shape: RoutingShape,
    layer: usize,
    position: usize,
    x: &[f32],
    chosen: &[u32],
) -> Result<Option<SwappedRow>, ModelError> {
    let margin = Margin {
        abs: default_cell_margin(model.config().kind),
        rel: ROUTING_MARGIN_REL,
    };
    let xt = Tensor::from_vec(x.to_vec(), (1, x.len()), &Device::Cpu)?;
    for e in 0..shape.experts as u32 {
        if chosen.contains(&e) {
            continue;
        }
        for out in 0..chosen.len() {
            let mut set = chosen.to_vec();
            set[out] = e;
            let mut classify =
                RoutingCheck::new(committed_cell(shape, position, layer, &set), margin, true)
                    .dispatching_committed();
            let y = model.arch().moe_block(
                layer,
                &xt,
                position,
                &mut Probe {
                    check: Some(&mut classify),
                    ..Probe::default()
                },
            )?;
            if let (Some(y), 1) = (y, classify.totals().near_tie) {
                return Ok(Some((set, y.flatten_all()?.to_vec1::<f32>()?)));
            }
        }
    }
    Ok(None)
}

/// The block output of `layer` on one row `x` with the experts `used` dispatched (weighted by
/// the rule over `used`).
fn forced_block(
    model: &Model,
    shape: RoutingShape,
    layer: usize,
    position: usize,
    x: &[f32],
    used: &[u32],
) -> Result<Vec<f32>, ModelError> {
    let forced_shape = RoutingShape {
        top_k: used.len(),
        ..shape
    };
    let mut row = vec![0; forced_shape.per_position()];
    row[layer * used.len()..(layer + 1) * used.len()].copy_from_slice(used);
    let mut check = RoutingCheck::new(
        CommittedRouting {
            start: position,
            shape: forced_shape,
            ids: row,
        },
        Margin {
            abs: f32::INFINITY,
            rel: 0.0,
        },
        true,
    );
    let xt = Tensor::from_vec(x.to_vec(), (1, x.len()), &Device::Cpu)?;
    let y = model
        .arch()
        .moe_block(
            layer,
            &xt,
            position,
            &mut Probe {
                check: Some(&mut check),
                ..Probe::default()
            },
        )?
        .ok_or_else(|| ModelError::Config(format!("layer {layer} is not an MoE layer")))?;
    Ok(y.flatten_all()?.to_vec1::<f32>()?)
}
