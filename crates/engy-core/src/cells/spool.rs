//! One request of the hook package's spool directory (integrations/sglang/README.md: a
//! commit pass writes `SPOOL/req-NNNNNN/{cells.bin, manifest.json}` and names the newest in
//! `SPOOL/latest`), read back and rechecked: every cell decodes and sits where the shape
//! puts it, and the recomputed `cells_root` is the manifest's.
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{CellError, CellShape, CellTree, LogitsDtype, SCHEME};
use crate::commit::tree::Digest;

/// Why a spooled request cannot be committed. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `manifest.json` or `latest` is not what the hook package writes.
    #[error("{path}: {reason}")]
    Manifest {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The hooks recorded an error for this request (its cells are incomplete or wrong).
    #[error("{path}: the capture failed: {error}")]
    CaptureFailed {
        /// The manifest.
        path: PathBuf,
        /// The hook's message.
        error: String,
    },
    /// `cells.bin` does not decode or does not fit the manifest's shape.
    #[error("{path}: {source}")]
    Cells {
        /// `cells.bin`.
        path: PathBuf,
        /// The first problem.
        #[source]
        source: CellError,
    },
    /// The cells hash to another root than the manifest says.
    #[error("{path}: cells hash to cells_root {computed}, the manifest says {manifest}")]
    RootMismatch {
        /// The manifest.
        path: PathBuf,
        /// The manifest's `cells_root`.
        manifest: String,
        /// Recomputed.
        computed: String,
    },
}

/// The manifest's `shape`: the shape's sizes; its `tokens_sha256` is the manifest's own
/// (the hooks hash the ids as the passes run).
#[derive(Deserialize)]
struct ManifestShape {
    n_positions: u32,
    layers: Vec<u32>,
    hidden: u32,
    n_experts: u32,
    top_k: u32,
    logits_dtype: u32,
}

#[derive(Deserialize)]
struct Manifest {
    scheme: String,
    shape: ManifestShape,
    #[serde(default)]
    cells_root: Option<String>,
    #[serde(default)]
    tokens_sha256: Option<String>,
    #[serde(default)]
    passes: u64,
    #[serde(default)]
    error: Option<String>,
}

/// A spooled request, checked.
#[derive(Debug, Clone)]
pub struct SpoolRequest {
    /// The request's directory.
    pub dir: PathBuf,
    /// Its cell tree (shape from the manifest, leaves from `cells.bin`).
    pub tree: CellTree,
    /// SHA-256 of the pass's token ids as `u32le` (bound into the shape and `cells_root`).
    pub tokens_sha256: Digest,
    /// Forward passes the request took (more than one: a chunked prefill).
    pub passes: u64,
    /// `cells.bin` as read: the cells' canonical bytes back to back in leaf order, each
    /// `Cell::encoded_len` of the shape's sizes (what a miner keeps to open cells).
    pub cells: Vec<u8>,
}

impl SpoolRequest {
    /// True when the spooled pass ran exactly `ids` (the miner's prompt + output ids):
    /// the manifest's `tokens_sha256` is [`super::tokens_sha256`] of them and the shape
    /// covers as many positions.
    pub fn ran_tokens(&self, ids: &[u32]) -> bool {
        self.tokens_sha256 == super::tokens_sha256(ids)
            && self.tree.shape().n_positions() as usize == ids.len()
    }
}

fn read(path: PathBuf) -> Result<(PathBuf, Vec<u8>), SpoolError> {
    match std::fs::read(&path) {
        Ok(b) => Ok((path, b)),
        Err(source) => Err(SpoolError::Io { path, source }),
    }
}

/// The newest request directory of a spool (`SPOOL/latest` names it).
///
/// Errors: [`SpoolError::Io`], [`SpoolError::Manifest`] when `latest` does not name a
/// `req-…` directory of the spool.
pub fn latest(spool: &Path) -> Result<PathBuf, SpoolError> {
    let (path, bytes) = read(spool.join("latest"))?;
    let name = String::from_utf8_lossy(&bytes).trim().to_string();
    let ok =
        name.starts_with("req-") && name.len() > 4 && name[4..].bytes().all(|b| b.is_ascii_digit());
    if !ok {
        return Err(SpoolError::Manifest {
            path,
            reason: format!("{name:?} is not a request directory name (req-NNNNNN)"),
        });
    }
    Ok(spool.join(name))
}

/// Reads and rechecks one request directory.
///
/// Errors: [`SpoolError::Io`], [`SpoolError::Manifest`] (not JSON of the expected shape,
/// another scheme (`engy-cells/v1` is retired), no `cells_root`, no `tokens_sha256`: the
/// hooks did not see the pass's ids), [`SpoolError::CaptureFailed`], [`SpoolError::Cells`],
/// [`SpoolError::RootMismatch`].
pub fn read_request(dir: &Path) -> Result<SpoolRequest, SpoolError> {
    let (mpath, mbytes) = read(dir.join("manifest.json"))?;
    let bad = |reason: String| SpoolError::Manifest {
        path: mpath.clone(),
        reason,
    };
    let m: Manifest =
        serde_json::from_slice(&mbytes).map_err(|e| bad(format!("not a cells manifest: {e}")))?;
    if m.scheme != SCHEME {
        return Err(bad(format!("scheme {:?}, want {SCHEME:?}", m.scheme)));
    }
    if let Some(error) = m.error {
        return Err(SpoolError::CaptureFailed { path: mpath, error });
    }
    let claimed = m.cells_root.ok_or_else(|| bad("no cells_root".into()))?;
    let tokens = m.tokens_sha256.ok_or_else(|| {
        bad("no tokens_sha256 (the hooks saw no input ids: is the `tokens` hook on the token embedding?)".into())
    })?;
    let tokens_sha256 =
        crate::commit::parse_digest(&tokens).map_err(|e| bad(format!("tokens_sha256: {e}")))?;
    let s = m.shape;
    let dtype = LogitsDtype::from_code(s.logits_dtype).map_err(|e| bad(format!("shape: {e}")))?;
    let shape = CellShape::new(
        s.n_positions,
        s.layers,
        s.hidden,
        s.n_experts,
        s.top_k,
        dtype,
        tokens_sha256,
    )
    .map_err(|e| bad(format!("shape: {e}")))?;
    let (cpath, cbytes) = read(dir.join("cells.bin"))?;
    let tree = CellTree::from_bytes(shape, &cbytes).map_err(|source| SpoolError::Cells {
        path: cpath,
        source,
    })?;
    let computed = hex::encode(tree.root());
    if !computed.eq_ignore_ascii_case(&claimed) {
        return Err(SpoolError::RootMismatch {
            path: mpath,
            manifest: claimed,
            computed,
        });
    }
    Ok(SpoolRequest {
        dir: dir.to_path_buf(),
        tree,
        tokens_sha256,
        passes: m.passes,
        cells: cbytes,
    })
}
