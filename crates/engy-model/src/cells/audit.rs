//! A miner's cell audit bundle ([`engy_core::cells::CellAuditBundle`]) checked end to end: the
//! challenge recomputed from its seed and `cells_root`, each challenged cell's opening against
//! the root, the touched weights against the trusted `model_root`, and each cell's numbers
//! ([`super::verify_cell_committed`]). `engy-audit cells` prints this report.
use engy_core::cells::{BundleError, CellAuditBundle};
use serde::Serialize;

use super::{verify_cell_committed, CellCheck, CellPolicy, CommittedCellError, CommittedWeights};
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

/// Audits `bundle` against `model` (loaded from the checkpoint `weights` indexes).
///
/// # Errors
/// [`BundleAuditError`]; a failed cell is a verdict, never an error.
pub fn audit_bundle(
    model: &Model,
    weights: &CommittedWeights,
    bundle: &CellAuditBundle,
    policy: &CellPolicy,
) -> Result<BundleReport, BundleAuditError> {
    let mut cells = Vec::new();
    for c in bundle.check()? {
        let (check, failures) = match c.opened {
            Err(e) => (None, vec![format!("opening: {e}")]),
            Ok(cell) => match verify_cell_committed(model, weights, &cell, policy) {
                Ok(check) => {
                    let f = check.failures.clone();
                    (Some(check), f)
                }
                Err(CommittedCellError::Weights(e)) => return Err(e.into()),
                Err(CommittedCellError::Model(e)) => return Err(e.into()),
            },
        };
        cells.push(BundleCell {
            index: c.index,
            position: c.position,
            layer: c.layer,
            check,
            failures,
        });
    }
    let failed = cells.iter().filter(|c| !c.pass()).count() as u64;
    Ok(BundleReport {
        verdict: if failed == 0 {
            BundleVerdict::Pass
        } else {
            BundleVerdict::Cheat
        },
        n: cells.len() as u64,
        failed,
        units_read: weights.units_read(),
        bytes_read: weights.bytes_read(),
        cells,
    })
}
