//! A miner's cell audit bundle ([`engy_core::cells::CellAuditBundle`]) checked end to end: the
//! challenge recomputed from its seed and `cells_root`, each challenged cell's opening against
//! the root, the touched weights against the trusted `model_root`, each cell's numbers
//! ([`super::verify_cell_committed`]), and the challenged cells' statistics together
//! ([`super::stats`]). [`audit_bundle_with_recompute`] also binds every challenged cell's `x`
//! to the auditor's own recompute of the request ([`super::recompute`]). `engy-audit cells`
//! prints this report.
use engy_core::cells::{BundleError, Cell, CellAuditBundle};
use serde::Serialize;

use super::recompute::bind_cells;
pub use super::recompute::RecomputeBinding;
use super::stats::{judge_cells, CellStats};
use super::{verify_cell_committed, CellCheck, CellPolicy, CommittedCellError, CommittedWeights};
use crate::arch::CommittedRouting;
use crate::{Model, ModelError};

/// One challenged cell's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BundleCell {
    /// Leaf index.
    pub index: u64,
    /// Token position.
    pub position: u32,
    /// Decoder layer.
    pub layer: u32,
    /// The numeric check, when the opening verified.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<CellCheck>,
    /// Why the cell failed (the opening's error, or the numeric check's failures); empty when
    /// it passed.
    pub failures: Vec<String>,
}

impl BundleCell {
    /// Whether the cell was opened against the root and passed every rule.
    pub fn pass(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The verdict of a bundle that answers its challenge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BundleVerdict {
    /// Every challenged cell opened and passed.
    Pass,
    /// At least one challenged cell failed or was not opened.
    Cheat,
}

/// The report of [`audit_bundle`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BundleReport {
    /// The verdict.
    pub verdict: BundleVerdict,
    /// Challenged cells.
    pub n: u64,
    /// Challenged cells that failed.
    pub failed: u64,
    /// Units whose bytes were checked against the root.
    pub units_read: u64,
    /// Tensor bytes checked against the root.
    pub bytes_read: u64,
    /// Every challenged cell, in challenge order.
    pub cells: Vec<BundleCell>,
    /// The challenged cells judged together ([`super::stats`]); a failed statistic makes the
    /// verdict a cheat.
    pub stats: CellStats,
    /// The recompute the cells' `x` were bound to ([`audit_bundle_with_recompute`]); `None`
    /// from [`audit_bundle`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recompute: Option<RecomputeBinding>,
    /// Whether the checkpoint's whole `config.json` is committed
    /// ([`CommittedWeights::config_bound`]); when `false` the routing fields outside the
    /// canonical config (`norm_topk_prob`, `routed_scaling_factor`, …) are the auditor's own.
    pub config_bound: bool,
}

/// Why a bundle got no verdict.
#[derive(Debug, thiserror::Error)]
pub enum BundleAuditError {
    /// The bundle does not answer its own challenge (an opening of an unchosen cell, or of one
    /// cell twice; `n` above the cells).
    #[error("bundle refused: {0}")]
    Refused(#[from] BundleError),
    /// The auditor's checkpoint does not match the trusted root where a cell touches it.
    #[error("the checkpoint does not match the committed weights: {0}")]
    Weights(#[from] super::WeightCheckError),
    /// The recompute failed.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// Audits `bundle` against `model` (loaded from the checkpoint `weights` indexes): each
/// cell's own rules and the statistics, without binding the cells to the request (a cell's `x`
/// is the miner's word; [`audit_bundle_with_recompute`] is the sound audit).
///
/// # Errors
/// [`BundleAuditError`]; a failed cell is a verdict, never an error.
pub fn audit_bundle(
    model: &Model,
    weights: &CommittedWeights,
    bundle: &CellAuditBundle,
    policy: &CellPolicy,
) -> Result<BundleReport, BundleAuditError> {
    audit(model, weights, bundle, None, policy)
}

/// The sound sampled audit of one request's bundle (issue 39; specs/CELLS.md §4): as
/// [`audit_bundle`], and each challenged cell's `x` must be the auditor's recompute of the
/// request at that (position, layer) within [`CellPolicy::x_rel`] (relative L2), its position
/// inside the request, its layer an MoE layer the recompute reaches.
///
/// * `token_ids`: the request's prompt ids followed by its output ids, as the serve ran them
///   (the cells' positions index this sequence). The caller binds them to the commitment
///   (the `engy-cells/v2` root commits their SHA-256 and count).
/// * `trace`: the serve's routing trace when it sent one (its near-ties are replayed so the
///   recompute follows the serve's expert choices; [`super::recompute`]).
/// * `model`: the checkpoint as loaded for the cell check (its numerics check `y`); the binding
///   tries the recomputes of `policy.recompute` over the same weights.
///
/// Cost: one teacher-forced pass per recompute tried over `token_ids[..=p_max]` (usually one:
/// the first that binds every cell ends the search), plus one MoE block per cell.
///
/// # Errors
/// [`BundleAuditError`]; a failed cell or statistic is a verdict, never an error.
pub fn audit_bundle_with_recompute(
    model: &Model,
    weights: &CommittedWeights,
    bundle: &CellAuditBundle,
    token_ids: &[u32],
    trace: Option<&CommittedRouting>,
    policy: &CellPolicy,
) -> Result<BundleReport, BundleAuditError> {
    audit(model, weights, bundle, Some((token_ids, trace)), policy)
}

fn audit(
    model: &Model,
    weights: &CommittedWeights,
    bundle: &CellAuditBundle,
    request: Option<(&[u32], Option<&CommittedRouting>)>,
    policy: &CellPolicy,
) -> Result<BundleReport, BundleAuditError> {
    let challenged = bundle.check()?;
    let opened: Vec<&Cell> = challenged
        .iter()
        .filter_map(|c| c.opened.as_ref().ok())
        .collect();
    let (x_errs, binding) = match request {
        Some((ids, trace)) => {
            let (errs, b) = bind_cells(model, ids, &opened, trace, policy.recompute, policy.x_rel)?;
            (Some((errs, ids.len())), Some(b))
        }
        None => (None, None),
    };
    // Each cell's numbers are checked with the FP8 activation rule its `x` was bound to (an
    // honest W8A8 serve's `y` against the W8A8 block, not the W8A16 one; issue 39, item 3),
    // in the verifier's own activation dtype (so a serve is still judged across numerics, as
    // the statistics were calibrated).
    let w8a8 = binding
        .as_ref()
        .is_some_and(|b| b.numerics.fp8_activations == crate::arch::Fp8Activations::PerTokenGroup);
    let mut policy = *policy;
    if w8a8 {
        policy.y_rel = policy.y_rel_w8a8;
        policy.stats.y_median = policy.stats.y_median_w8a8;
    }
    let policy = &policy;
    let bound_model = match &binding {
        Some(b) if b.numerics.fp8_activations != model.numerics().fp8_activations => {
            Some(model.with_numerics(crate::Numerics {
                fp8_activations: b.numerics.fp8_activations,
                ..model.numerics()
            })?)
        }
        _ => None,
    };
    let checker = bound_model.as_ref().unwrap_or(model);
    let mut cells = Vec::new();
    let mut next_opened = 0usize;
    for c in challenged {
        let (check, failures) = match c.opened {
            Err(e) => (None, vec![format!("opening: {e}")]),
            Ok(cell) => {
                let at = next_opened;
                next_opened += 1;
                match verify_cell_committed(checker, weights, &cell, policy) {
                    Ok(mut check) => {
                        if let Some((errs, len)) = &x_errs {
                            bind_failures(
                                &mut check,
                                errs.get(at).copied().flatten(),
                                *len,
                                policy,
                            );
                        }
                        let f = check.failures.clone();
                        (Some(check), f)
                    }
                    Err(CommittedCellError::Weights(e)) => return Err(e.into()),
                    Err(CommittedCellError::Model(e)) => return Err(e.into()),
                }
            }
        };
        cells.push(BundleCell {
            index: c.index,
            position: c.position,
            layer: c.layer,
            check,
            failures,
        });
    }
    let checks: Vec<&CellCheck> = cells.iter().filter_map(|c| c.check.as_ref()).collect();
    let stats = judge_cells(
        &checks,
        &policy.stats,
        model.config().quantization.is_some() && !w8a8,
    );
    let failed = cells.iter().filter(|c| !c.pass()).count() as u64;
    Ok(BundleReport {
        verdict: if failed == 0 && stats.pass() {
            BundleVerdict::Pass
        } else {
            BundleVerdict::Cheat
        },
        n: cells.len() as u64,
        failed,
        units_read: weights.units_read(),
        bytes_read: weights.bytes_read(),
        cells,
        stats,
        recompute: binding,
        config_bound: weights.config_bound(),
    })
}

/// Adds the binding's failure to a cell's check: its position outside the request, no
/// recompute row at (position, layer), or `x` too far from the recompute's.
fn bind_failures(check: &mut CellCheck, err: Option<f32>, len: usize, policy: &CellPolicy) {
    check.x_err = err;
    let why = if check.position as usize >= len {
        format!(
            "position {} is outside the request's {len} tokens",
            check.position
        )
    } else {
        match err {
            None => format!(
                "the recompute has no MoE block at (position {}, layer {})",
                check.position, check.layer
            ),
            Some(e) if e <= policy.x_rel => return,
            Some(e) => format!(
                "x is {e:.4} (relative L2) from the recompute's MoE input at (position {}, \
                 layer {}), more than {}",
                check.position, check.layer, policy.x_rel
            ),
        }
    };
    check.failures.push(why);
}
