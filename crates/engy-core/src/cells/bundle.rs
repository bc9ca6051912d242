//! The cell audit bundle (specs/CELLS.md §7): what a miner hands an auditor for one
//! challenged request, as JSON: the committed `cells_root` and shape, the challenge's seed and
//! size, and one opening (canonical cell bytes + inclusion path) per challenged cell.
//!
//! ```json
//! {"cells_root": "<64 hex>",
//!  "shape": {"n_positions": 96, "layers": [0, 1], "hidden": 64, "n_experts": 4, "top_k": 2,
//!            "logits_dtype": 1},
//!  "seed": "<64 hex>", "n": 16,
//!  "openings": [{"index": 37, "cell": "<base64 of the canonical bytes>",
//!                "path": ["<64 hex>", …]}, …]}
//! ```
//!
//! [`CellAuditBundle::check`] recomputes the challenge from `seed` and `cells_root`
//! ([`super::select`]), refuses a bundle that opens a cell the challenge did not choose (or
//! one twice), and checks each chosen cell's opening ([`super::verify_opening`]); a chosen cell
//! without an opening is a failed cell ([`CellError::NotOpened`]).
use serde::{Deserialize, Serialize};

use super::tree::{verify_opening, CellPath, CellShape, CellTree};
use super::{select, Cell, CellError};
use crate::commit::spec::Hex;
use crate::commit::tree::Digest;

/// One opened cell of a [`CellAuditBundle`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleOpening {
    /// Leaf index (`position · |layers| + rank(layer)`).
    pub index: u64,
    /// The cell's canonical bytes (specs/CELLS.md §2), base64 (RFC 4648 standard alphabet,
    /// padded) in JSON.
    #[serde(with = "b64")]
    pub cell: Vec<u8>,
    /// The inclusion path's siblings, bottom-up (specs/CELLS.md §4), 64 hex digits each.
    pub path: Vec<Hex>,
}

/// A miner's answer to a cell challenge (module docs; specs/CELLS.md §7).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CellAuditBundle {
    /// The request's committed `cells_root`.
    pub cells_root: Hex,
    /// The request's cell shape (its leaf is bound into `cells_root`).
    pub shape: CellShape,
    /// The challenge seed (32 bytes, drawn after the commitment).
    pub seed: Hex,
    /// Cells challenged.
    pub n: u64,
    /// One opening per challenged cell, in any order.
    pub openings: Vec<BundleOpening>,
}

/// Why a bundle is not an answer to its own challenge (the bundle is refused as a whole).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BundleError {
    /// The challenge cannot be drawn (`n` larger than the shape's cells).
    #[error("challenge: {0}")]
    Challenge(CellError),
    /// An opening of a cell the challenge did not choose.
    #[error("opening of cell {index}, which the challenge did not choose")]
    NotChallenged {
        /// The leaf index opened.
        index: u64,
    },
    /// Two openings of one cell.
    #[error("cell {index} is opened twice")]
    Duplicate {
        /// The leaf index.
        index: u64,
    },
}

/// One challenged cell and what its opening gave.
#[derive(Debug, Clone, PartialEq)]
pub struct ChallengedCell {
    /// Leaf index.
    pub index: u64,
    /// Token position the shape puts at `index`.
    pub position: u32,
    /// Decoder layer the shape puts at `index`.
    pub layer: u32,
    /// The decoded cell, checked against `cells_root`, or why the opening failed.
    pub opened: Result<Cell, CellError>,
}

impl CellAuditBundle {
    /// The bundle a miner sends: the cells `seed` chooses among `tree`'s (`n` of them), each
    /// opened from `tree` with its canonical bytes from `cell_bytes(index)` (the retention
    /// store).
    ///
    /// Errors: [`CellError::TooMany`] (`n` above the cells), [`CellError::NoSuchCell`], and
    /// whatever `cell_bytes` returns.
    pub fn open(
        tree: &CellTree,
        seed: &[u8; 32],
        n: u64,
        mut cell_bytes: impl FnMut(u64) -> Result<Vec<u8>, CellError>,
    ) -> Result<Self, CellError> {
        let root = tree.root();
        let mut openings = Vec::new();
        for index in select(seed, &root, tree.shape().n_cells(), n)? {
            let path = tree.open(index)?;
            openings.push(BundleOpening {
                index,
                cell: cell_bytes(index)?,
                path: path.siblings,
            });
        }
        Ok(Self {
            cells_root: Hex(root),
            shape: tree.shape().clone(),
            seed: Hex(*seed),
            n,
            openings,
        })
    }

    /// The challenged leaf indices, in the order drawn ([`select`] over the bundle's seed,
    /// `cells_root` and shape).
    ///
    /// Errors: [`CellError::TooMany`].
    pub fn challenge(&self) -> Result<Vec<u64>, CellError> {
        select(
            &self.seed.0,
            &self.cells_root.0,
            self.shape.n_cells(),
            self.n,
        )
    }

    /// Checks the bundle (module docs): every challenged cell in challenge order with its
    /// opening's result.
    ///
    /// The caller compares `cells_root` with the commitment it trusts and should draw the
    /// seed itself; this check only binds the openings to that root and seed.
    ///
    /// Errors: [`BundleError`] when the bundle is not an answer to its own challenge.
    pub fn check(&self) -> Result<Vec<ChallengedCell>, BundleError> {
        let chosen = self.challenge().map_err(BundleError::Challenge)?;
        let mut by_index: std::collections::HashMap<u64, &BundleOpening> =
            std::collections::HashMap::with_capacity(self.openings.len());
        for o in &self.openings {
            if !chosen.contains(&o.index) {
                return Err(BundleError::NotChallenged { index: o.index });
            }
            if by_index.insert(o.index, o).is_some() {
                return Err(BundleError::Duplicate { index: o.index });
            }
        }
        let root: Digest = self.cells_root.0;
        Ok(chosen
            .into_iter()
            .map(|index| {
                let (position, layer) = self.shape.cell_at(index).unwrap_or((0, 0));
                let opened = match by_index.get(&index) {
                    None => Err(CellError::NotOpened { index }),
                    Some(o) => verify_opening(
                        &self.shape,
                        &root,
                        &o.cell,
                        &CellPath {
                            index,
                            siblings: o.path.clone(),
                        },
                    ),
                };
                ChallengedCell {
                    index,
                    position,
                    layer,
                    opened,
                }
            })
            .collect())
    }
}

mod b64 {
    use base64::Engine as _;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let s = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(s.as_bytes())
            .map_err(|e| serde::de::Error::custom(format!("cell is not base64: {e}")))
    }
}
