//! One request of the hook package's spool directory (integrations/sglang/README.md: a
//! commit pass writes `SPOOL/req-NNNNNN/{cells.bin, manifest.json}` and names the newest in
//! `SPOOL/latest`), read back and rechecked: every cell decodes and sits where the shape
//! puts it, and the recomputed `cells_root` is the manifest's.
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::{CellError, CellShape, CellTree, SCHEME};
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

#[derive(Deserialize)]
struct Manifest {
    scheme: String,
    shape: CellShape,
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
    /// SHA-256 of the pass's token ids as `u32le`, when the hooks saw them.
    pub tokens_sha256: Option<Digest>,
    /// Forward passes the request took (more than one: a chunked prefill).
    pub passes: u64,
    /// `cells.bin` as read: the cells' canonical bytes back to back in leaf order, each
    /// `Cell::encoded_len` of the shape's sizes (what a miner keeps to open cells).
    pub cells: Vec<u8>,
}

impl SpoolRequest {
    /// True when the spooled pass ran exactly `ids` (the miner's prompt + output ids):
    /// the manifest's `tokens_sha256` is SHA-256 of them as `u32le`. False when it differs
    /// or the hooks saw no ids.
    pub fn ran_tokens(&self, ids: &[u32]) -> bool {
        let mut h = Sha256::new();
        for id in ids {
            h.update(id.to_le_bytes());
        }
        let want: Digest = h.finalize().into();
        self.tokens_sha256 == Some(want)
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
/// another scheme, no `cells_root`), [`SpoolError::CaptureFailed`], [`SpoolError::Cells`],
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
    let tokens_sha256 = match m.tokens_sha256 {
        None => None,
        Some(h) => {
            Some(crate::commit::parse_digest(&h).map_err(|e| bad(format!("tokens_sha256: {e}")))?)
        }
    };
    let (cpath, cbytes) = read(dir.join("cells.bin"))?;
    let tree = CellTree::from_bytes(m.shape, &cbytes).map_err(|source| SpoolError::Cells {
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
