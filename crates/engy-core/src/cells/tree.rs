//! The request's cell tree (specs/CELLS.md §3–§4): the shape leaf, the leaf order
//! (position-major, then layer), `cells_root`, inclusion paths and their check.
//!
//! ```text
//! cells_root = node(shape_leaf, MTH([cell_leaf(p, l) for p in 0..n_positions for l in layers]))
//! ```
//!
//! The shape leaf binds the SHA-256 of the request's token ids ([`super::tokens_sha256`]), so
//! one request's cells are never another's, and an auditor holding the ids checks the shape
//! against them ([`CellShape::for_request`]).
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::{
    cell_leaf, check_sizes, Cell, CellError, LogitsDtype, MAX_LAYERS, MAX_PATH, SHAPE_TAG,
};
use crate::commit::spec::Hex;
use crate::commit::tree::{self as mtree, Digest};

/// What a request's cell commitment covers: positions `0..n_positions` of the
/// teacher-forced sequence (prompt + output) whose token ids hash to `tokens_sha256`, the MoE
/// layers (ascending decoder-layer indices), and the per-cell sizes every cell must carry.
/// Its [`CellShape::leaf`] is the left child of `cells_root`, so leaf positions are never
/// ambiguous and the cells are bound to the request's tokens.
///
/// JSON (`commitment.cells.shape`, the bundle's `shape`): the seven fields by name,
/// `logits_dtype` as its code, `tokens_sha256` 64 hex digits; deserialising validates like
/// [`CellShape::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawShape")]
pub struct CellShape {
    n_positions: u32,
    layers: Vec<u32>,
    hidden: u32,
    n_experts: u32,
    top_k: u32,
    logits_dtype: u32,
    tokens_sha256: Hex,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShape {
    n_positions: u32,
    layers: Vec<u32>,
    hidden: u32,
    n_experts: u32,
    top_k: u32,
    logits_dtype: u32,
    tokens_sha256: Hex,
}

impl TryFrom<RawShape> for CellShape {
    type Error = CellError;
    fn try_from(r: RawShape) -> Result<Self, CellError> {
        let dtype = LogitsDtype::from_code(r.logits_dtype)
            .map_err(|e| CellError::BadShape(e.to_string()))?;
        Self::new(
            r.n_positions,
            r.layers,
            r.hidden,
            r.n_experts,
            r.top_k,
            dtype,
            r.tokens_sha256.0,
        )
    }
}

impl CellShape {
    /// A shape. `tokens_sha256` is [`super::tokens_sha256`] of the `n_positions` token ids
    /// the cells were computed on.
    ///
    /// Errors: [`CellError::BadShape`] when `n_positions` is 0, `layers` is empty, longer than
    /// [`MAX_LAYERS`] or not strictly ascending, or the sizes are out of range.
    pub fn new(
        n_positions: u32,
        layers: Vec<u32>,
        hidden: u32,
        n_experts: u32,
        top_k: u32,
        logits_dtype: LogitsDtype,
        tokens_sha256: Digest,
    ) -> Result<Self, CellError> {
        let bad = |m: String| Err(CellError::BadShape(m));
        if n_positions == 0 {
            return bad("n_positions is 0".into());
        }
        if layers.is_empty() || layers.len() > MAX_LAYERS || !layers.windows(2).all(|w| w[0] < w[1])
        {
            return bad(format!(
                "layers {layers:?} must be 1 ..= {MAX_LAYERS} strictly ascending indices"
            ));
        }
        check_sizes(hidden.into(), n_experts.into(), top_k.into())
            .map_err(|e| CellError::BadShape(e.to_string()))?;
        Ok(Self {
            n_positions,
            layers,
            hidden,
            n_experts,
            top_k,
            logits_dtype: logits_dtype.code(),
            tokens_sha256: Hex(tokens_sha256),
        })
    }

    /// The shape of a request whose teacher-forced sequence is `ids` (prompt + output):
    /// `n_positions = len(ids)`, `tokens_sha256 = `[`super::tokens_sha256`]`(ids)`.
    ///
    /// Errors: those of [`CellShape::new`], and [`CellError::BadShape`] for more than
    /// `u32::MAX` ids.
    pub fn for_request(
        ids: &[u32],
        layers: Vec<u32>,
        hidden: u32,
        n_experts: u32,
        top_k: u32,
        logits_dtype: LogitsDtype,
    ) -> Result<Self, CellError> {
        let n = u32::try_from(ids.len())
            .map_err(|_| CellError::BadShape(format!("{} positions", ids.len())))?;
        Self::new(
            n,
            layers,
            hidden,
            n_experts,
            top_k,
            logits_dtype,
            super::tokens_sha256(ids),
        )
    }

    /// SHA-256 of the token ids the cells were computed on ([`super::tokens_sha256`]).
    pub fn tokens_sha256(&self) -> &Digest {
        &self.tokens_sha256.0
    }

    /// How this shape differs from the request's `want` in anything but `logits_dtype`
    /// (positions, tokens, layers, sizes), in words; `None` when it does not. The router
    /// dtype is the serve's choice (specs/CELLS.md §2), so a request's shape is derived from
    /// its token ids and the committed model config with either dtype.
    pub fn request_mismatch(&self, want: &CellShape) -> Option<String> {
        let mut d = Vec::new();
        if self.n_positions != want.n_positions {
            d.push(format!(
                "n_positions {} (the request has {})",
                self.n_positions, want.n_positions
            ));
        }
        if self.tokens_sha256 != want.tokens_sha256 {
            d.push(format!(
                "tokens_sha256 {} (the request's token ids hash to {})",
                self.tokens_sha256, want.tokens_sha256
            ));
        }
        if self.layers != want.layers {
            d.push(format!(
                "layers {:?} (the model's MoE layers are {:?})",
                self.layers, want.layers
            ));
        }
        let sizes = |s: &CellShape| (s.hidden, s.n_experts, s.top_k);
        if sizes(self) != sizes(want) {
            d.push(format!(
                "(hidden, n_experts, top_k) {:?} (the model's are {:?})",
                sizes(self),
                sizes(want)
            ));
        }
        (!d.is_empty()).then(|| d.join(", "))
    }

    /// Positions covered (`0..n_positions`).
    pub fn n_positions(&self) -> u32 {
        self.n_positions
    }
    /// The MoE layers, ascending.
    pub fn layers(&self) -> &[u32] {
        &self.layers
    }
    /// `hidden` of every cell.
    pub fn hidden(&self) -> u32 {
        self.hidden
    }
    /// `n_experts` of every cell.
    pub fn n_experts(&self) -> u32 {
        self.n_experts
    }
    /// `top_k` of every cell.
    pub fn top_k(&self) -> u32 {
        self.top_k
    }
    /// The router logits' dtype of every cell. Errors: [`CellError::BadDtype`] for a
    /// deserialised shape with an unknown code.
    pub fn logits_dtype(&self) -> Result<LogitsDtype, CellError> {
        LogitsDtype::from_code(self.logits_dtype)
    }

    /// `n_positions · |layers|`.
    pub fn n_cells(&self) -> u64 {
        u64::from(self.n_positions) * self.layers.len() as u64
    }

    /// Leaf index of (position, layer): `position · |layers| + rank(layer)`; `None` when
    /// the shape does not cover it.
    pub fn index_of(&self, position: u32, layer: u32) -> Option<u64> {
        if position >= self.n_positions {
            return None;
        }
        let rank = self.layers.binary_search(&layer).ok()?;
        Some(u64::from(position) * self.layers.len() as u64 + rank as u64)
    }

    /// (position, layer) of a leaf index; `None` when `index >= n_cells`.
    pub fn cell_at(&self, index: u64) -> Option<(u32, u32)> {
        if index >= self.n_cells() {
            return None;
        }
        let n = self.layers.len() as u64;
        let position = u32::try_from(index / n).ok()?;
        let layer = *self.layers.get((index % n) as usize)?;
        Some((position, layer))
    }

    /// The shape leaf: `SHA-256(0x00 || lp(SHAPE_TAG) || tokens_sha256 || u32le(n_positions)
    /// || u32le(hidden) || u32le(n_experts) || u32le(top_k) || u32le(logits_dtype) ||
    /// u32le(|layers|) || u32le(layer)…)`.
    pub fn leaf(&self) -> Digest {
        let mut h = Sha256::new();
        h.update([mtree::LEAF_PREFIX]);
        mtree::update_lp(&mut h, SHAPE_TAG.as_bytes());
        h.update(self.tokens_sha256.0);
        for v in [
            self.n_positions,
            self.hidden,
            self.n_experts,
            self.top_k,
            self.logits_dtype,
            self.layers.len() as u32,
        ] {
            h.update(v.to_le_bytes());
        }
        for l in &self.layers {
            h.update(l.to_le_bytes());
        }
        h.finalize().into()
    }

    /// Checks that `cell` is the one this shape puts at `index`: same position and layer,
    /// and the shape's sizes and logits dtype. Errors: [`CellError::NoSuchCell`],
    /// [`CellError::ShapeMismatch`].
    pub fn check_cell(&self, index: u64, cell: &Cell) -> Result<(), CellError> {
        let (position, layer) = self.cell_at(index).ok_or(CellError::NoSuchCell {
            index,
            n_cells: self.n_cells(),
        })?;
        let got = (
            cell.position(),
            cell.layer(),
            cell.hidden(),
            cell.n_experts(),
            cell.top_k(),
            cell.router_logits().dtype().code(),
        );
        let want = (
            position,
            layer,
            self.hidden,
            self.n_experts,
            self.top_k,
            self.logits_dtype,
        );
        if got != want {
            return Err(CellError::ShapeMismatch(format!(
                "cell {index}: (position, layer, hidden, n_experts, top_k, logits_dtype) \
                 is {got:?}, the shape says {want:?}"
            )));
        }
        Ok(())
    }
}

/// The inclusion path of one cell: its leaf index and the RFC 9162 §2.1.3.1 audit path
/// (siblings bottom-up) in the tree of cell leaves. The shape leaf is the last step
/// (`cells_root = node(shape_leaf, tree_root)`), not part of `siblings`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CellPath {
    /// Leaf index (`position · |layers| + rank(layer)`).
    pub index: u64,
    /// Siblings, bottom-up.
    pub siblings: Vec<Hex>,
}

/// All cells of one request, hashed: build it from the spool, keep it (or its leaves)
/// while the request may be challenged, open cells from it.
#[derive(Debug, Clone)]
pub struct CellTree {
    shape: CellShape,
    /// `levels[0]` the leaves, each next level the pairs' nodes (a lone last node carried
    /// up), the last level the single tree root: paths in O(log n).
    levels: Vec<Vec<Digest>>,
    tree_root: Digest,
    root: Digest,
}

impl CellTree {
    /// The tree over `cells`, which must be exactly the shape's cells in leaf order.
    ///
    /// Errors: [`CellError::ShapeMismatch`] (a cell out of place or of other sizes, too
    /// few or too many cells).
    pub fn from_cells(shape: CellShape, cells: &[Cell]) -> Result<Self, CellError> {
        if cells.len() as u64 != shape.n_cells() {
            return Err(CellError::ShapeMismatch(format!(
                "{} cells given, the shape has {}",
                cells.len(),
                shape.n_cells()
            )));
        }
        let mut leaves = Vec::with_capacity(cells.len());
        for (i, c) in cells.iter().enumerate() {
            shape.check_cell(i as u64, c)?;
            leaves.push(c.leaf());
        }
        Ok(Self::from_checked_leaves(shape, leaves))
    }

    /// The tree over a spool file (cells back to back, in leaf order), one cell at a time
    /// (memory: the leaves, not the cells).
    ///
    /// Errors: the first decoding error, then those of [`CellTree::from_cells`].
    pub fn from_bytes(shape: CellShape, mut bytes: &[u8]) -> Result<Self, CellError> {
        let n_cells = shape.n_cells();
        let mut leaves = Vec::with_capacity(usize::try_from(n_cells).unwrap_or(0).min(1 << 24));
        while !bytes.is_empty() {
            let (cell, used) = Cell::decode_prefix(bytes)?;
            let index = leaves.len() as u64;
            if index >= n_cells {
                return Err(CellError::ShapeMismatch(format!(
                    "more than the shape's {n_cells} cells"
                )));
            }
            shape.check_cell(index, &cell)?;
            leaves.push(cell_leaf(&bytes[..used]));
            bytes = &bytes[used..];
        }
        if leaves.len() as u64 != n_cells {
            return Err(CellError::ShapeMismatch(format!(
                "{} cells given, the shape has {n_cells}",
                leaves.len()
            )));
        }
        Ok(Self::from_checked_leaves(shape, leaves))
    }

    fn from_checked_leaves(shape: CellShape, leaves: Vec<Digest>) -> Self {
        // Level by level, pairing left to right, a lone last node carried up: the same
        // tree as `MTH` (specs/SCHEME.md §1, checked in `commit::tree`'s tests).
        let mut levels = vec![leaves];
        while let Some(level) = levels.last().filter(|l| l.len() > 1) {
            let next = level
                .chunks(2)
                .map(|c| match c {
                    [l, r] => mtree::node(l, r),
                    [one, ..] => *one,
                    [] => mtree::empty_root(),
                })
                .collect();
            levels.push(next);
        }
        let tree_root = match levels.last().map(|l| l.as_slice()) {
            Some([one]) => *one,
            _ => mtree::empty_root(),
        };
        let root = mtree::node(&shape.leaf(), &tree_root);
        Self {
            shape,
            levels,
            tree_root,
            root,
        }
    }

    /// `cells_root = node(shape_leaf, tree_root)`: the request's cell commitment.
    pub fn root(&self) -> Digest {
        self.root
    }
    /// `MTH` of the cell leaves.
    pub fn tree_root(&self) -> Digest {
        self.tree_root
    }
    /// The shape.
    pub fn shape(&self) -> &CellShape {
        &self.shape
    }
    /// The cell leaves in leaf order.
    pub fn leaves(&self) -> &[Digest] {
        self.levels.first().map(|l| l.as_slice()).unwrap_or(&[])
    }

    /// The inclusion path of leaf `index` (RFC 9162 §2.1.3.1: at each level the sibling,
    /// none where the node is a lone last node carried up). Errors: [`CellError::NoSuchCell`].
    pub fn open(&self, index: u64) -> Result<CellPath, CellError> {
        let n_cells = self.leaves().len() as u64;
        if index >= n_cells {
            return Err(CellError::NoSuchCell { index, n_cells });
        }
        let mut i = index as usize;
        let mut siblings = Vec::new();
        let below_root = self.levels.split_last().map_or(&[][..], |(_, b)| b);
        for level in below_root {
            if let Some(s) = level.get(i ^ 1) {
                siblings.push(Hex(*s));
            }
            i >>= 1;
        }
        Ok(CellPath { index, siblings })
    }
}

/// Checks one opened cell against a committed `cells_root` and the request's shape:
/// decodes `cell_bytes`, checks it is the cell the shape puts at `path.index` (position,
/// layer, sizes, dtype), and that its leaf, the path and the shape leaf lead to
/// `cells_root`. Returns the decoded cell for the numeric checks.
///
/// The caller must take `shape` from the commitment it trusts (its leaf is bound into
/// `cells_root`, so a wrong shape fails here) and `path.index` from its own challenge
/// ([`super::select`]), not from the miner.
///
/// Errors: decoding errors, [`CellError::NoSuchCell`], [`CellError::ShapeMismatch`],
/// [`CellError::BadPath`] (also for a path of more than [`MAX_PATH`] siblings),
/// [`CellError::RootMismatch`].
pub fn verify_opening(
    shape: &CellShape,
    cells_root: &Digest,
    cell_bytes: &[u8],
    path: &CellPath,
) -> Result<Cell, CellError> {
    if path.siblings.len() > MAX_PATH {
        return Err(CellError::BadPath {
            len: path.siblings.len(),
            index: path.index,
            n_cells: shape.n_cells(),
        });
    }
    let cell = Cell::decode(cell_bytes)?;
    shape.check_cell(path.index, &cell)?;
    let siblings: Vec<Digest> = path.siblings.iter().map(|h| h.0).collect();
    let n_cells = shape.n_cells();
    let tree_root = mtree::root_from_path(&cell_leaf(cell_bytes), path.index, n_cells, &siblings)
        .ok_or(CellError::BadPath {
        len: siblings.len(),
        index: path.index,
        n_cells,
    })?;
    let root = mtree::node(&shape.leaf(), &tree_root);
    if &root != cells_root {
        return Err(CellError::RootMismatch {
            index: path.index,
            computed: hex::encode(root),
            committed: hex::encode(cells_root),
        });
    }
    Ok(cell)
}
