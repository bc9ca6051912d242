//! The cheap checkpoint identity `model_root` (PROTOCOL.md §4, first bullet).
//!
//! `model_root` = lowercase hex sha256 over: the bytes of `<checkpoint>/config.json` (or the
//! two bytes `{}` when it is absent), then for each `*.safetensors` entry directly in the
//! checkpoint folder, in sorted order, its file name (UTF-8) followed by its size in bytes as
//! decimal ASCII. It names which checkpoint a worker pinned; it is not a weight proof (the
//! recompute and the Merkle commitments in [`crate::commit`] are).
//!
//! Matching the reference's `sorted(glob.glob(os.path.join(dir, "*.safetensors")))`: names
//! starting with `.` are skipped (glob does not match them), sizes follow symlinks, and the
//! order is by file name bytes (equal to Python's code-point order of the full paths, which
//! share the folder prefix).

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// Why `model_root` could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The checkpoint path is not a directory.
    #[error("checkpoint {path} is not a directory")]
    NotADirectory {
        /// The path given.
        path: PathBuf,
    },
    /// Reading the folder, `config.json` or a shard's metadata failed.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file or folder involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A `*.safetensors` file name is not UTF-8, so it has no protocol encoding.
    #[error("checkpoint shard name {path:?} is not UTF-8")]
    NonUtf8Name {
        /// The offending entry.
        path: PathBuf,
    },
}

/// Compute `model_root` for the checkpoint folder `checkpoint_dir` (§4). See the module docs.
pub fn model_root(checkpoint_dir: &Path) -> Result<String, IdentityError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| IdentityError::Io { path, source }
    };
    let meta = std::fs::metadata(checkpoint_dir).map_err(io(checkpoint_dir))?;
    if !meta.is_dir() {
        return Err(IdentityError::NotADirectory {
            path: checkpoint_dir.to_path_buf(),
        });
    }
    let mut h = Sha256::new();
    let cfg = checkpoint_dir.join("config.json");
    match std::fs::read(&cfg) {
        Ok(bytes) => h.update(&bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => h.update(b"{}"),
        Err(e) => return Err(io(&cfg)(e)),
    }

    let mut shards: Vec<(String, PathBuf)> = Vec::new();
    for entry in std::fs::read_dir(checkpoint_dir).map_err(io(checkpoint_dir))? {
        let entry = entry.map_err(io(checkpoint_dir))?;
        let path = entry.path();
        let name = entry.file_name();
        let Some(name) = name.to_str() else {
            if name.as_encoded_bytes().ends_with(b".safetensors") {
                return Err(IdentityError::NonUtf8Name { path });
            }
            continue;
        };
        if name.starts_with('.') || !name.ends_with(".safetensors") {
            continue;
        }
        shards.push((name.to_string(), path));
    }
    shards.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    for (name, path) in shards {
        let size = std::fs::metadata(&path).map_err(io(&path))?.len();
        h.update(name.as_bytes());
        h.update(size.to_string().as_bytes());
    }
    Ok(hex::encode(h.finalize()))
}
