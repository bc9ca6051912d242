//! Cells bound to the request (issue 39, item 1): the auditor knows the request's token ids,
//! so it recomputes the hidden states teacher-forced and requires each challenged cell's `x`
//! to be the recompute's MoE input at that (position, layer).
//!
//! Without this, a cell is only self-consistent: `x` is whatever the miner wrote, and a cell of
//! zeros (zero logits make every expert a tie, a zero `y` matches a zero recompute) or a cell
//! copied from another request or another model passes every rule of [`super::verify_cell`].
//! With it, `x` is pinned to the weights and the tokens; the logits, routing and `y` rules then
//! check the rest of the cell against that `x` ([`super::verify_cell`]).
//!
//! **Cost.** One teacher-forced pass over the prefix `token_ids[..=p_max]` (`p_max` the last
//! challenged position; attention is causal, so later tokens cannot change it), keeping only the
//! challenged rows ([`crate::arch::Probe::block_rows`]: `n` rows of `2 · hidden` floats, not
//! every layer's activations). On top of that each cell costs one MoE block on one row (the
//! router, its `top_k` experts and the shared expert) and the hashing of the units it touches
//! ([`super::CommittedWeights`]). bench/RESULTS.md "Cells: cost of a challenged cell" gives the
//! measured numbers at real shape.
//!
//! **Numerics.** The serve's numerics are not stated, so each recompute of
//! [`crate::audit::Recompute::plan_for_model`] (W8A8 too on a block-FP8 checkpoint) is tried in order until one puts every challenged `x`
//! within a quarter of [`super::CellPolicy::x_rel`]; otherwise all are run and the closest is
//! kept ([`RecomputeBinding`]): on the tiny Qwen3.5-MoE checkpoint an honest f32 serve is 0.18
//! from the bf16 recompute (near-tie flips), 0 from the f32 one.
//! With the serve's routing trace, near-ties are replayed ([`crate::arch::RoutingCheck`]), so
//! the recompute stays on the serve's expert choices and its later layers' inputs stay close.
use std::collections::{BTreeMap, BTreeSet};

use engy_core::cells::Cell;
use serde::Serialize;

use crate::arch::{CommittedRouting, Margin, Probe, RoutingCheck};
use crate::audit::{default_routing_margin, Recompute, ROUTING_MARGIN_REL};
use crate::{Model, ModelError, Numerics};

/// The recompute's MoE block input and output at one (position, layer), f32.
#[derive(Debug, Clone, PartialEq)]
pub struct RecomputedRow {
    /// The block's input (post-attention norm output), `hidden` values.
    pub x: Vec<f32>,
    /// The block's output (routed + shared experts), `hidden` values.
    pub y: Vec<f32>,
}

/// Which recompute the challenged cells were bound to, and how close they were.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecomputeBinding {
    /// The numerics of the recompute kept ([`crate::Numerics`]).
    pub numerics: Numerics,
    /// Recomputes run (each one teacher-forced pass over the prefix).
    pub recomputes: usize,
    /// Token positions recomputed (`p_max + 1`).
    pub positions: usize,
    /// Whether the serve's routing trace was replayed.
    pub replayed_trace: bool,
    /// Cells whose `x` was farther than [`super::CellPolicy::x_rel`] from the recompute kept.
    pub x_failed: usize,
    /// The largest `‖x − x̂‖ / ‖x̂‖` over the bound cells.
    pub x_err_max: f32,
}

/// The recompute's MoE input and output at every (position, layer) of `wanted`, from one
/// teacher-forced pass of `model` over `token_ids[..=p_max]`. With `trace`, the serve's
/// committed routing is checked and its near-ties replayed (margin
/// [`default_routing_margin`]). Rows the pass did not reach (a dense layer, a layer out of
/// range) are absent.
///
/// # Errors
/// [`ModelError::EmptyInput`] when a wanted position is outside `token_ids` (the caller
/// filters those); the forward pass's errors.
pub fn recompute_rows(
    model: &Model,
    token_ids: &[u32],
    wanted: &BTreeSet<(usize, usize)>,
    trace: Option<&CommittedRouting>,
) -> Result<BTreeMap<(usize, usize), RecomputedRow>, ModelError> {
    let Some(last) = wanted.iter().map(|&(p, _)| p).max() else {
        return Ok(BTreeMap::new());
    };
    let ids = token_ids.get(..=last).ok_or(ModelError::EmptyInput)?;
    let margin = Margin {
        abs: default_routing_margin(model.config().kind),
        rel: ROUTING_MARGIN_REL,
    };
    let mut check = trace.map(|t| RoutingCheck::new(t.clone(), margin, true));
    let mut blocks = Vec::new();
    model.hidden_states_probed(
        ids,
        &mut Probe {
            blocks: Some(&mut blocks),
            block_rows: Some(wanted),
            check: check.as_mut(),
            ..Probe::default()
        },
    )?;
    let mut out = BTreeMap::new();
    for b in blocks {
        let x = b.x.flatten_all()?.to_vec1::<f32>()?;
        let y = b.y.flatten_all()?.to_vec1::<f32>()?;
        out.insert((b.first, b.layer), RecomputedRow { x, y });
    }
    Ok(out)
}

/// `‖a − b‖ / ‖b‖` in f64 (infinite when `b` is zero and `a` is not, or the lengths differ).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = f64::from(x) - f64::from(y);
        num += d * d;
        den += f64::from(y) * f64::from(y);
    }
    if num == 0.0 {
        return 0.0;
    }
    (num.sqrt() / den.sqrt()) as f32
}

/// The challenged cells' `x` distances (`None`: the recompute has no row there) against the
/// best recompute of `plan` (module docs): the first one with every distance within `x_rel / 4`,
/// else the one with the fewest cells outside and then the smallest largest distance.
///
/// # Errors
/// [`ModelError`] from the forward passes; [`ModelError::Config`] for a model that cannot be
/// reloaded in another numerics ([`Model::with_numerics`]).
pub fn bind_cells(
    model: &Model,
    token_ids: &[u32],
    cells: &[&Cell],
    trace: Option<&CommittedRouting>,
    recompute: Recompute,
    x_rel: f32,
) -> Result<(Vec<Option<f32>>, RecomputeBinding), ModelError> {
    let wanted: BTreeSet<(usize, usize)> = cells
        .iter()
        .map(|c| (c.position() as usize, c.layer() as usize))
        .filter(|&(p, _)| p < token_ids.len())
        .collect();
    let positions = wanted.iter().map(|&(p, _)| p + 1).max().unwrap_or(0);
    let plan = recompute.plan_for_model(model);
    let mut best: Option<(Vec<Option<f32>>, RecomputeBinding)> = None;
    let mut run = 0;
    for numerics in &plan {
        run += 1;
        let m = if *numerics == model.numerics() {
            None
        } else {
            Some(model.with_numerics(*numerics)?)
        };
        let rows = recompute_rows(m.as_ref().unwrap_or(model), token_ids, &wanted, trace)?;
        let errs: Vec<Option<f32>> = cells
            .iter()
            .map(|c| {
                let x: Vec<f32> = c.x().iter().map(|v| v.to_f32()).collect();
                rows.get(&(c.position() as usize, c.layer() as usize))
                    .map(|r| rel_l2(&x, &r.x))
            })
            .collect();
        // NaN (a non-finite x) counts as infinitely far.
        let dist = |e: &Option<f32>| e.filter(|e| !e.is_nan()).unwrap_or(f32::INFINITY);
        let x_failed = errs.iter().filter(|e| dist(e) > x_rel).count();
        let x_err_max = errs.iter().map(dist).fold(0f32, f32::max);
        let better = best.as_ref().is_none_or(|(_, b)| {
            x_failed < b.x_failed || (x_failed == b.x_failed && x_err_max < b.x_err_max)
        });
        if better {
            best = Some((
                errs,
                RecomputeBinding {
                    numerics: *numerics,
                    recomputes: 0,
                    positions,
                    replayed_trace: trace.is_some(),
                    x_failed,
                    x_err_max,
                },
            ));
        }
        // Clearly bound: stop. Bound but far (another numerics' drift, e.g. an f32 serve
        // against the bf16 recompute): try the rest and keep the closest.
        if x_failed == 0 && x_err_max <= x_rel / 4.0 {
            break;
        }
    }
    let (errs, mut binding) =
        best.ok_or_else(|| ModelError::Config("no recompute planned".into()))?;
    binding.recomputes = run;
    Ok((errs, binding))
}
