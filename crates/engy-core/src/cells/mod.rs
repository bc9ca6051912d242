//! Activation cells and their Merkle commitment, scheme `engy-cells/v2` (specs/CELLS.md;
//! docs/PROTOCOL.md §10). `engy-cells/v1` (whose root bound neither the request's tokens nor
//! a cap on its sizes) is retired: nothing here reads it.
//!
//! A **cell** is one (token position, MoE layer) of a teacher-forced pass: the MoE block's
//! input `x` (after the post-attention norm), the router logits, the routed expert ids the
//! serve used, and the block's output `y` (routed + shared experts). A request's cells are
//! committed to one 32-byte `cells_root`; a seed drawn after the commitment selects cells
//! ([`select`]) that the miner opens with inclusion paths ([`CellTree::open`],
//! [`verify_opening`]).
//!
//! * this file: [`Cell`], its canonical bytes ([`Cell::encode`], [`Cell::decode`],
//!   [`Cell::decode_prefix`]) and [`cell_leaf`];
//! * [`tree`]: [`CellShape`] (the shape leaf, leaf order), [`CellTree`], [`CellPath`],
//!   [`verify_opening`];
//! * [`challenge`]: [`select`], the seeded choice of distinct cells;
//! * [`bundle`]: [`CellAuditBundle`], the JSON a miner answers a challenge with, its
//!   check against the auditor's own [`Challenge`] ([`CellAuditBundle::check_challenge`]),
//!   and its size cap ([`bundle::parse_bundle`]);
//! * [`spool`]: a request the sglang hook package (`integrations/sglang`) spooled, read back
//!   and rechecked.
//!
//! Hashing reuses `engy-commit/v1`'s RFC 6962 primitives ([`crate::commit::tree`]).
use half::bf16;
use sha2::{Digest as _, Sha256};

use crate::commit::tree::{self as mtree, Digest};

pub mod bundle;
pub mod challenge;
pub mod spool;
pub mod tree;

pub use bundle::{
    parse_bundle, BundleError, BundleOpening, CellAuditBundle, Challenge, ChallengedCell,
    MAX_BUNDLE_BYTES,
};
pub use challenge::{
    challenge_n, commitment_digest, production_seed, select, DEFAULT_CHALLENGE_CELLS,
    MAX_CHALLENGE_CELLS, MIN_CHALLENGE_CELLS,
};
pub use tree::{verify_opening, CellPath, CellShape, CellTree};

/// The scheme's version tag.
pub const SCHEME: &str = "engy-cells/v2";
/// Domain tag of a cell leaf.
pub const CELL_TAG: &str = "engy-cells/v2/cell";
/// Domain tag of the shape leaf.
pub const SHAPE_TAG: &str = "engy-cells/v2/shape";
/// Domain tag of the challenge stream.
pub const CHALLENGE_TAG: &str = "engy-cells/v2/challenge";
/// Domain tag of the production seed ([`challenge::production_seed`]).
pub const SEED_TAG: &str = "engy-cells/v2/seed";

/// Bytes of the fixed cell header: six `u32le` fields.
pub const HEADER_LEN: usize = 24;
/// Largest `hidden` accepted (specs/CELLS.md §2: every served MoE is far below it, GLM-5's
/// 6 144 the largest; guards allocations sized by a header).
pub const MAX_HIDDEN: u32 = 1 << 16;
/// Largest `n_experts` accepted (specs/CELLS.md §2: 256 for Qwen3.6 and GLM-5, 512 for the
/// largest served MoE).
pub const MAX_EXPERTS: u32 = 1 << 13;
/// Largest number of MoE layers in a shape (specs/CELLS.md §3).
pub const MAX_LAYERS: usize = 1 << 10;
/// Most siblings an inclusion path may hold (specs/CELLS.md §4: a tree of `n_cells < 2^64`
/// leaves has paths of at most 64).
pub const MAX_PATH: usize = 64;
/// Seconds after a `response` during which the miner must answer `open_cells` for its
/// request (docs/PROTOCOL.md §10 "Retention"): inside this window `unknown_request`,
/// `bad_challenge` on a valid challenge, or no answer is a failed audit.
pub const RETENTION_WINDOW_S: u64 = 600;

/// SHA-256 of a request's token ids (`prompt_ids ++ output_token_ids`, the teacher-forced
/// sequence), each as `u32le`, back to back (specs/CELLS.md §3): the `tokens_sha256` of the
/// shape, bound into `cells_root`.
pub fn tokens_sha256(ids: &[u32]) -> Digest {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    h.finalize().into()
}

/// Why cell bytes, a cell or an opening were rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CellError {
    /// Fewer bytes than the header or the header's sizes need.
    #[error("cell truncated: {need} bytes needed, {have} present")]
    Truncated {
        /// Bytes the header implies (or [`HEADER_LEN`]).
        need: usize,
        /// Bytes given.
        have: usize,
    },
    /// Bytes left over after one cell where exactly one was expected.
    #[error("{extra} trailing bytes after the cell")]
    Trailing {
        /// Extra bytes.
        extra: usize,
    },
    /// A header size out of range (`hidden` or `n_experts` 0 or above the limits,
    /// `top_k` 0 or above `n_experts`).
    #[error("bad cell size: {0}")]
    BadSize(String),
    /// A value of `x`, the router logits or `y` is NaN or infinite (specs/CELLS.md §2: a
    /// serve's activations are finite; a NaN would compare false with every tolerance).
    #[error("cell holds a non-finite {field} value at {at}")]
    NonFinite {
        /// `x`, `router_logits` or `y`.
        field: &'static str,
        /// Element index.
        at: usize,
    },
    /// The logits dtype code is neither 1 (BF16) nor 2 (F32).
    #[error("unknown router logits dtype code {0} (1 = BF16, 2 = F32)")]
    BadDtype(u32),
    /// Expert ids not strictly ascending or not below `n_experts`.
    #[error("expert ids {ids:?} are not strictly ascending ids below {n_experts}")]
    BadExpertIds {
        /// The ids.
        ids: Vec<u32>,
        /// Experts of the layer.
        n_experts: u32,
    },
    /// Vector lengths of a [`Cell`] disagree (`x` and `y` of unequal length).
    #[error("inconsistent cell: {0}")]
    Inconsistent(String),
    /// A cell's header disagrees with the request's [`CellShape`], or sits at another
    /// place than the one opened.
    #[error("cell does not fit the committed shape: {0}")]
    ShapeMismatch(String),
    /// A shape that commits nothing or is out of range.
    #[error("bad cell shape: {0}")]
    BadShape(String),
    /// A leaf index outside the tree.
    #[error("no cell at index {index} of {n_cells}")]
    NoSuchCell {
        /// The index asked for.
        index: u64,
        /// Cells in the tree.
        n_cells: u64,
    },
    /// An inclusion path of the wrong length for its index.
    #[error("inclusion path has {len} siblings, wrong for index {index} of {n_cells}")]
    BadPath {
        /// Siblings given.
        len: usize,
        /// Leaf index.
        index: u64,
        /// Cells in the tree.
        n_cells: u64,
    },
    /// The cell and its path lead to another root than the committed one.
    #[error("cell {index}: path leads to cells_root {computed}, committed {committed}")]
    RootMismatch {
        /// Leaf index.
        index: u64,
        /// Root recomputed from the cell and the path (hex).
        computed: String,
        /// The committed root (hex).
        committed: String,
    },
    /// A challenged cell the miner did not open.
    #[error("cell {index} was challenged but not opened")]
    NotOpened {
        /// Leaf index.
        index: u64,
    },
    /// More cells asked of [`select`] than the tree holds.
    #[error("cannot select {n} distinct cells of {n_cells}")]
    TooMany {
        /// Cells asked for.
        n: u64,
        /// Cells in the tree.
        n_cells: u64,
    },
}

/// Element type of the router logits as the serve computed them (header field
/// `logits_dtype`). A bf16 serve's Qwen MoE router is a bf16 `F.linear`, so its logits are
/// BF16; routers computed in f32 (GLM's sigmoid router) are committed as F32. Both widen
/// to f32 exactly ([`RouterLogits::to_f32`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LogitsDtype {
    /// bfloat16, 2 bytes little-endian (code 1).
    Bf16,
    /// IEEE-754 binary32, 4 bytes little-endian (code 2).
    F32,
}

impl LogitsDtype {
    /// The header code.
    pub const fn code(self) -> u32 {
        match self {
            LogitsDtype::Bf16 => 1,
            LogitsDtype::F32 => 2,
        }
    }

    /// The dtype of a header code. Errors: [`CellError::BadDtype`].
    pub const fn from_code(code: u32) -> Result<Self, CellError> {
        match code {
            1 => Ok(LogitsDtype::Bf16),
            2 => Ok(LogitsDtype::F32),
            c => Err(CellError::BadDtype(c)),
        }
    }

    /// Bytes per element.
    pub const fn width(self) -> usize {
        match self {
            LogitsDtype::Bf16 => 2,
            LogitsDtype::F32 => 4,
        }
    }
}

/// The router logits of one token at one layer, `[n_experts]`, in the serve's dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum RouterLogits {
    /// BF16 logits.
    Bf16(Vec<bf16>),
    /// F32 logits.
    F32(Vec<f32>),
}

impl RouterLogits {
    /// The element type.
    pub fn dtype(&self) -> LogitsDtype {
        match self {
            RouterLogits::Bf16(_) => LogitsDtype::Bf16,
            RouterLogits::F32(_) => LogitsDtype::F32,
        }
    }

    /// `n_experts`.
    pub fn len(&self) -> usize {
        match self {
            RouterLogits::Bf16(v) => v.len(),
            RouterLogits::F32(v) => v.len(),
        }
    }

    /// True when there are no logits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The logits widened to f32 (exact for both dtypes).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            RouterLogits::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            RouterLogits::F32(v) => v.clone(),
        }
    }
}

/// One cell: (position, layer) of a request and what the MoE block saw and produced there.
///
/// Built with [`Cell::new`] or [`Cell::decode`], so every `Cell` satisfies the encoding's
/// rules: `x` and `y` of equal length `hidden` in `1..=MAX_HIDDEN`, `n_experts` logits in
/// `1..=MAX_EXPERTS`, `1..=n_experts` expert ids strictly ascending and below `n_experts`.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    position: u32,
    layer: u32,
    x: Vec<bf16>,
    router_logits: RouterLogits,
    expert_ids: Vec<u32>,
    y: Vec<bf16>,
}

fn check_sizes(hidden: u64, n_experts: u64, top_k: u64) -> Result<(), CellError> {
    if hidden == 0 || hidden > u64::from(MAX_HIDDEN) {
        return Err(CellError::BadSize(format!(
            "hidden {hidden} not in 1..={MAX_HIDDEN}"
        )));
    }
    if n_experts == 0 || n_experts > u64::from(MAX_EXPERTS) {
        return Err(CellError::BadSize(format!(
            "n_experts {n_experts} not in 1..={MAX_EXPERTS}"
        )));
    }
    if top_k == 0 || top_k > n_experts {
        return Err(CellError::BadSize(format!(
            "top_k {top_k} not in 1..=n_experts ({n_experts})"
        )));
    }
    Ok(())
}

fn check_finite(x: &[bf16], logits: &RouterLogits, y: &[bf16]) -> Result<(), CellError> {
    let bad = |field, at| Err(CellError::NonFinite { field, at });
    if let Some(at) = x.iter().position(|v| !v.is_finite()) {
        return bad("x", at);
    }
    let at = match logits {
        RouterLogits::Bf16(v) => v.iter().position(|v| !v.is_finite()),
        RouterLogits::F32(v) => v.iter().position(|v| !v.is_finite()),
    };
    if let Some(at) = at {
        return bad("router_logits", at);
    }
    if let Some(at) = y.iter().position(|v| !v.is_finite()) {
        return bad("y", at);
    }
    Ok(())
}

fn check_ids(ids: &[u32], n_experts: u32) -> Result<(), CellError> {
    let ascending = ids.windows(2).all(|w| w[0] < w[1]);
    if !ascending || ids.iter().any(|&e| e >= n_experts) {
        return Err(CellError::BadExpertIds {
            ids: ids.to_vec(),
            n_experts,
        });
    }
    Ok(())
}

impl Cell {
    /// A cell from its parts. `expert_ids` may come in any order (a serve reports them by
    /// score); they are stored ascending, as the encoding requires.
    ///
    /// Errors: [`CellError::Inconsistent`] (`x`, `y` lengths differ), [`CellError::BadSize`],
    /// [`CellError::BadExpertIds`] (a repeated id or one `>= n_experts`),
    /// [`CellError::NonFinite`].
    pub fn new(
        position: u32,
        layer: u32,
        x: Vec<bf16>,
        router_logits: RouterLogits,
        mut expert_ids: Vec<u32>,
        y: Vec<bf16>,
    ) -> Result<Self, CellError> {
        if x.len() != y.len() {
            return Err(CellError::Inconsistent(format!(
                "x has {} values, y {}",
                x.len(),
                y.len()
            )));
        }
        check_sizes(
            x.len() as u64,
            router_logits.len() as u64,
            expert_ids.len() as u64,
        )?;
        expert_ids.sort_unstable();
        check_ids(&expert_ids, router_logits.len() as u32)?;
        check_finite(&x, &router_logits, &y)?;
        Ok(Self {
            position,
            layer,
            x,
            router_logits,
            expert_ids,
            y,
        })
    }

    /// Token position in the request (0 = first prompt token).
    pub fn position(&self) -> u32 {
        self.position
    }
    /// Decoder layer index (as in the checkpoint's `model.layers.{i}`).
    pub fn layer(&self) -> u32 {
        self.layer
    }
    /// The MoE block's input, `[hidden]`.
    pub fn x(&self) -> &[bf16] {
        &self.x
    }
    /// The router logits, `[n_experts]`.
    pub fn router_logits(&self) -> &RouterLogits {
        &self.router_logits
    }
    /// The routed expert ids, `[top_k]`, strictly ascending.
    pub fn expert_ids(&self) -> &[u32] {
        &self.expert_ids
    }
    /// The MoE block's output (routed + shared experts), `[hidden]`.
    pub fn y(&self) -> &[bf16] {
        &self.y
    }
    /// `hidden`.
    pub fn hidden(&self) -> u32 {
        self.x.len() as u32
    }
    /// `n_experts`.
    pub fn n_experts(&self) -> u32 {
        self.router_logits.len() as u32
    }
    /// `top_k`.
    pub fn top_k(&self) -> u32 {
        self.expert_ids.len() as u32
    }

    /// Encoded length of a cell of these sizes: `24 + 4·hidden + width·n_experts + 4·top_k`.
    pub fn encoded_len(hidden: u32, n_experts: u32, top_k: u32, dtype: LogitsDtype) -> usize {
        HEADER_LEN + 4 * hidden as usize + dtype.width() * n_experts as usize + 4 * top_k as usize
    }

    /// The canonical bytes (specs/CELLS.md §2): header `position, layer, hidden, n_experts,
    /// top_k, logits_dtype` as `u32le`, then `x` (bf16 LE), the logits (bf16 or f32 LE),
    /// the expert ids (`u32le`, ascending), `y` (bf16 LE).
    pub fn encode(&self) -> Vec<u8> {
        let dtype = self.router_logits.dtype();
        let mut out = Vec::with_capacity(Self::encoded_len(
            self.hidden(),
            self.n_experts(),
            self.top_k(),
            dtype,
        ));
        for v in [
            self.position,
            self.layer,
            self.hidden(),
            self.n_experts(),
            self.top_k(),
            dtype.code(),
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend(self.x.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        match &self.router_logits {
            RouterLogits::Bf16(v) => out.extend(v.iter().flat_map(|v| v.to_bits().to_le_bytes())),
            RouterLogits::F32(v) => out.extend(v.iter().flat_map(|v| v.to_bits().to_le_bytes())),
        }
        out.extend(self.expert_ids.iter().flat_map(|v| v.to_le_bytes()));
        out.extend(self.y.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        out
    }

    /// Decodes exactly one cell.
    ///
    /// Errors: those of [`Cell::decode_prefix`], and [`CellError::Trailing`] when bytes
    /// remain after the cell.
    pub fn decode(bytes: &[u8]) -> Result<Self, CellError> {
        let (cell, used) = Self::decode_prefix(bytes)?;
        if used != bytes.len() {
            return Err(CellError::Trailing {
                extra: bytes.len() - used,
            });
        }
        Ok(cell)
    }

    /// Decodes the cell at the start of `bytes` (a spool file is cells back to back) and
    /// returns it with its encoded length.
    ///
    /// Errors: [`CellError::Truncated`], [`CellError::BadSize`], [`CellError::BadDtype`],
    /// [`CellError::BadExpertIds`], [`CellError::NonFinite`].
    pub fn decode_prefix(bytes: &[u8]) -> Result<(Self, usize), CellError> {
        let head = bytes.get(..HEADER_LEN).ok_or(CellError::Truncated {
            need: HEADER_LEN,
            have: bytes.len(),
        })?;
        let field = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&head[4 * i..4 * i + 4]);
            u32::from_le_bytes(b)
        };
        let (position, layer, hidden, n_experts, top_k) =
            (field(0), field(1), field(2), field(3), field(4));
        let dtype = LogitsDtype::from_code(field(5))?;
        check_sizes(hidden.into(), n_experts.into(), top_k.into())?;
        let need = Self::encoded_len(hidden, n_experts, top_k, dtype);
        let body = bytes.get(HEADER_LEN..need).ok_or(CellError::Truncated {
            need,
            have: bytes.len(),
        })?;
        let (x, rest) = body.split_at(2 * hidden as usize);
        let (logits, rest) = rest.split_at(dtype.width() * n_experts as usize);
        let (ids, y) = rest.split_at(4 * top_k as usize);
        let bf16s = |b: &[u8]| -> Vec<bf16> {
            b.chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect()
        };
        let u32s = |b: &[u8]| -> Vec<u32> {
            b.chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let router_logits = match dtype {
            LogitsDtype::Bf16 => RouterLogits::Bf16(bf16s(logits)),
            LogitsDtype::F32 => {
                RouterLogits::F32(u32s(logits).into_iter().map(f32::from_bits).collect())
            }
        };
        let expert_ids = u32s(ids);
        check_ids(&expert_ids, n_experts)?;
        let (x, y) = (bf16s(x), bf16s(y));
        check_finite(&x, &router_logits, &y)?;
        Ok((
            Self {
                position,
                layer,
                x,
                router_logits,
                expert_ids,
                y,
            },
            need,
        ))
    }

    /// [`cell_leaf`] of this cell's canonical bytes.
    pub fn leaf(&self) -> Digest {
        cell_leaf(&self.encode())
    }
}

/// Splits a spool file (cells back to back) into cells. Errors: the first
/// [`Cell::decode_prefix`] error.
pub fn decode_all(mut bytes: &[u8]) -> Result<Vec<Cell>, CellError> {
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let (cell, used) = Cell::decode_prefix(bytes)?;
        out.push(cell);
        bytes = &bytes[used..];
    }
    Ok(out)
}

/// The cell leaf (specs/CELLS.md §3): `SHA-256(0x00 || lp(CELL_TAG) || lp(cell_bytes))`,
/// `lp(b) = u64le(len(b)) || b`. It hashes whatever bytes it is given; decode first to
/// know they are a cell.
pub fn cell_leaf(cell_bytes: &[u8]) -> Digest {
    let mut h = Sha256::new();
    h.update([mtree::LEAF_PREFIX]);
    mtree::update_lp(&mut h, CELL_TAG.as_bytes());
    mtree::update_lp(&mut h, cell_bytes);
    h.finalize().into()
}
