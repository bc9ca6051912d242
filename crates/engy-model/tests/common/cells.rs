//! The cell audit's test setup, made one way: a request's cell shape, the committed weights of a
//! checkpoint folder, and a 32-cell challenge opened and audited (docs/PROTOCOL.md §10).
use std::path::Path;

use engy_core::cells::{tokens_sha256, Cell, CellAuditBundle, CellShape, CellTree};
use engy_core::commit::{self, CommitOptions, Progress, SpecFile};
use engy_model::cells::{
    audit_bundle_with_recompute, BundleReport, CellPolicy, CommittedWeights, Openings,
};
use engy_model::Model;

/// The shape of the cells `model` serves for the request `ids`: its MoE layers among `cells`,
/// the hidden size, experts and top-k, the router logits' dtype and the tokens' hash.
pub fn shape_of(model: &Model, ids: &[u32], cells: &[Cell]) -> CellShape {
    let s = model.routing_shape().unwrap();
    let mut layers: Vec<u32> = cells.iter().map(|c| c.layer()).collect();
    layers.sort_unstable();
    layers.dedup();
    CellShape::new(
        ids.len() as u32,
        layers,
        model.config().hidden_size as u32,
        s.experts as u32,
        s.top_k as u32,
        cells[0].router_logits().dtype(),
        tokens_sha256(ids),
    )
    .unwrap()
}

/// The checkpoint folder's weights, opened against its own weight commitment (the trusted
/// spec an auditor holds).
pub fn committed(dir: &Path) -> CommittedWeights {
    let c =
        commit::commit_checkpoint(dir, &CommitOptions::default(), &Progress::default()).unwrap();
    let spec = SpecFile::from_commitment(&c, 0.0);
    CommittedWeights::open(dir, c.model_root, Openings::Spec(Box::new(spec))).unwrap()
}

/// The bundle a miner answers a 32-cell challenge at `seed` with: `cells`, served by `serve`
/// for the request `ids`, committed and opened.
pub fn bundle(serve: &Model, ids: &[u32], cells: &[Cell], seed: [u8; 32]) -> CellAuditBundle {
    let tree = CellTree::from_cells(shape_of(serve, ids, cells), cells).unwrap();
    CellAuditBundle::open(&tree, &seed, 32, |i| Ok(cells[i as usize].encode())).unwrap()
}

/// That bundle audited by `verifier` against `w` with the default policy.
pub fn audit(
    verifier: &Model,
    w: &CommittedWeights,
    serve: &Model,
    ids: &[u32],
    cells: &[Cell],
    seed: [u8; 32],
) -> BundleReport {
    let b = bundle(serve, ids, cells, seed);
    audit_bundle_with_recompute(verifier, w, &b, ids, None, &CellPolicy::default()).unwrap()
}
