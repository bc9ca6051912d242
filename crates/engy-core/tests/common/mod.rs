//! What the engy-core integration tests share, so that each fixture is read one way: the vector
//! folder (`$ENGY_VECTORS_DIR` or the shipped `tests/vectors`), its JSON files, and the hex
//! fields they carry.
// Not every test crate that includes this module uses every item.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::Value;

/// `$ENGY_VECTORS_DIR` when set and not empty, else the shipped `<workspace>/tests/vectors`.
pub fn vectors_dir() -> PathBuf {
    match std::env::var_os("ENGY_VECTORS_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => workspace().join("tests/vectors"),
    }
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The `*.json` files of [`vectors_dir`]`/sub`, sorted; panics naming the folder when it
/// cannot be read.
pub fn json_files(sub: &str) -> Vec<PathBuf> {
    let dir = vectors_dir().join(sub);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read vector dir {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
}

/// A JSON file; panics naming it when it cannot be read or parsed.
pub fn read_json(path: &Path) -> Value {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: bad JSON: {e}", path.display()))
}

/// 64 hex digits as 32 bytes.
pub fn hex32(s: &str) -> [u8; 32] {
    hex::decode(s).unwrap().try_into().unwrap()
}
