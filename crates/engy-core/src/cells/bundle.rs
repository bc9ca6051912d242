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
//!
//! The auditor owns the challenge (specs/CELLS.md §7): [`CellAuditBundle::check_challenge`]
//! first requires the bundle's `cells_root`, shape, `seed` and `n` to be the auditor's own
//! [`Challenge`] (the commitment's root and shape, the shape the request's token ids and the
//! model give, the seed from the beacon, `n` from the auditor's policy); a bundle that is
//! not an answer to that challenge is a failed audit, never a neutral one. [`parse_bundle`]
//! reads at most [`MAX_BUNDLE_BYTES`]; every check is O(n) in the challenged cells.
use serde::{Deserialize, Serialize};

use super::tree::{verify_opening, CellPath, CellShape, CellTree};
use super::{select, Cell, CellError, MAX_CHALLENGE_CELLS};
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

/// Largest cell audit bundle an auditor reads (specs/CELLS.md §7): 256 Qwen3.6 openings are
/// about 3.3 MB and 256 GLM-5 openings about 8.5 MB of JSON.
pub const MAX_BUNDLE_BYTES: usize = 64 << 20;

/// Reads a bundle from its JSON bytes, refusing more than [`MAX_BUNDLE_BYTES`] before parsing.
///
/// Errors: [`BundleError::TooLarge`], [`BundleError::Malformed`] (not the JSON of §7, an
/// unknown key, a shape out of range, a cell that is not base64).
pub fn parse_bundle(bytes: &[u8]) -> Result<CellAuditBundle, BundleError> {
    if bytes.len() > MAX_BUNDLE_BYTES {
        return Err(BundleError::TooLarge { len: bytes.len() });
    }
    serde_json::from_slice(bytes).map_err(|e| BundleError::Malformed(e.to_string()))
}

/// The challenge an auditor issues for one request (specs/CELLS.md §5, §7): everything in it
/// comes from the auditor, none of it from the miner's bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    /// The `cells_root` of the commitment the auditor holds.
    pub cells_root: Digest,
    /// The request's shape as the auditor derives it: `n_positions` and `tokens_sha256` from
    /// the request's token ids, the MoE layers and sizes from the committed model config.
    pub shape: CellShape,
    /// The seed ([`super::production_seed`] of a beacon and the commitment's digest, or the
    /// auditor's own draw).
    pub seed: [u8; 32],
    /// Cells challenged ([`super::challenge_n`] of the auditor's policy).
    pub n: u64,
}

/// Why a bundle is not an answer to its own challenge (the bundle is refused as a whole), or
/// not an answer to the auditor's [`Challenge`]. Every variant is a failed audit when the
/// challenge was the auditor's (specs/CELLS.md §7).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BundleError {
    /// More than [`MAX_BUNDLE_BYTES`].
    #[error("bundle of {len} bytes, more than the {MAX_BUNDLE_BYTES} an auditor reads")]
    TooLarge {
        /// Bytes given.
        len: usize,
    },
    /// Not a cell audit bundle (specs/CELLS.md §7).
    #[error("not a cell audit bundle: {0}")]
    Malformed(String),
    /// The bundle's `cells_root` is not the commitment's.
    #[error("the bundle's cells_root {got} is not the commitment's {want}")]
    Root {
        /// The bundle's (hex).
        got: String,
        /// The commitment's (hex).
        want: String,
    },
    /// The bundle's shape is not the request's (other positions, tokens, layers or sizes).
    #[error("the bundle's shape is not the request's: {0}")]
    Shape(String),
    /// The bundle's seed is not the auditor's.
    #[error("the bundle's seed {got} is not the challenge's {want}")]
    Seed {
        /// The bundle's (hex).
        got: String,
        /// The auditor's (hex).
        want: String,
    },
    /// The bundle's `n` is not the auditor's.
    #[error("the bundle answers n = {got} cells, the challenge asked {want}")]
    N {
        /// The bundle's.
        got: u64,
        /// The auditor's.
        want: u64,
    },
    /// More openings than cells challenged, or `n` above [`MAX_CHALLENGE_CELLS`].
    #[error("{openings} openings for n = {n} (at most {MAX_CHALLENGE_CELLS} cells a challenge)")]
    TooManyOpenings {
        /// Openings given.
        openings: usize,
        /// The bundle's `n`.
        n: u64,
    },
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

    /// Checks that the bundle answers the auditor's `want` (its root, shape, seed and `n`
    /// equal), then the openings as [`CellAuditBundle::check`] does.
    ///
    /// Errors: [`BundleError::Root`], [`BundleError::Shape`], [`BundleError::Seed`],
    /// [`BundleError::N`] first, then those of [`CellAuditBundle::check`]. Each is a failed
    /// audit (the miner did not answer the challenge it was given).
    pub fn check_challenge(&self, want: &Challenge) -> Result<Vec<ChallengedCell>, BundleError> {
        if self.cells_root.0 != want.cells_root {
            return Err(BundleError::Root {
                got: self.cells_root.to_string(),
                want: hex::encode(want.cells_root),
            });
        }
        if self.shape != want.shape {
            let why = self
                .shape
                .request_mismatch(&want.shape)
                .unwrap_or_else(|| "logits_dtype differs from the commitment's".to_string());
            return Err(BundleError::Shape(why));
        }
        if self.seed.0 != want.seed {
            return Err(BundleError::Seed {
                got: self.seed.to_string(),
                want: hex::encode(want.seed),
            });
        }
        if self.n != want.n {
            return Err(BundleError::N {
                got: self.n,
                want: want.n,
            });
        }
        self.check()
    }

    /// Checks the bundle (module docs): every challenged cell in challenge order with its
    /// opening's result. O(n): at most [`MAX_CHALLENGE_CELLS`] cells, paths of at most
    /// [`super::MAX_PATH`] siblings.
    ///
    /// This check only binds the openings to the bundle's own root and seed; an auditor
    /// calls [`CellAuditBundle::check_challenge`] with its own challenge.
    ///
    /// Errors: [`BundleError`] when the bundle is not an answer to its own challenge.
    pub fn check(&self) -> Result<Vec<ChallengedCell>, BundleError> {
        if self.n > MAX_CHALLENGE_CELLS || self.openings.len() as u64 > self.n {
            return Err(BundleError::TooManyOpenings {
                openings: self.openings.len(),
                n: self.n,
            });
        }
        let chosen = self.challenge().map_err(BundleError::Challenge)?;
        let chosen_set: std::collections::HashSet<u64> = chosen.iter().copied().collect();
        let mut by_index: std::collections::HashMap<u64, &BundleOpening> =
            std::collections::HashMap::with_capacity(self.openings.len());
        for o in &self.openings {
            if !chosen_set.contains(&o.index) {
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
