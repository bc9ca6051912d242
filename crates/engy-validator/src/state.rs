//! The state file (PROTOCOL.md §7 step 9): what this validator last landed on chain.
//!
//! Written only after a successful submit, all fields together, atomically: a fixed temp
//! file `.<name>.tmp` in the same directory, `fsync`, `rename` over the old file, then
//! `fsync` of the directory. A kill -9 at any moment leaves either the old file or the new
//! one, never a torn one, and at most that one temp file (removed at the next start-up).
//! Read leniently: each field validates on its own (a wrong type, a bool where an integer
//! belongs, malformed weights → that field is absent); a missing, truncated or non-object
//! file reads as empty. Reading never fails.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// The validator's persisted anchors and cache. Every field is optional.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Epoch of the last successful submission.
    pub last_applied: Option<u64>,
    /// Block anchoring the last successful submission (positive).
    pub last_submit_block: Option<u64>,
    /// Unix seconds of the last successful submission.
    pub last_submit_ts: Option<u64>,
    /// The last vector actually landed from a payload: `(hotkey SS58, weight)` pairs.
    pub cached_weights: Option<Vec<(String, u16)>>,
    /// sha256 hex digest of the payload `cached_weights` came from.
    pub cached_digest: Option<String>,
}

/// Errors writing the state file.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Creating the parent directory, writing, syncing or renaming failed.
    #[error("state file {path}: {source}")]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl State {
    /// The schedule's view of this state.
    pub fn anchors(&self) -> crate::schedule::Anchors {
        crate::schedule::Anchors {
            last_applied: self.last_applied,
            last_submit_block: self.last_submit_block,
            last_submit_ts: self.last_submit_ts,
        }
    }

    /// Parses a state document; never fails (see the module docs).
    pub fn from_bytes(bytes: &[u8]) -> State {
        let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(bytes) else {
            return State::default();
        };
        State {
            last_applied: uint(&obj, "last_applied"),
            last_submit_block: uint(&obj, "last_submit_block").filter(|b| *b > 0),
            last_submit_ts: timestamp(&obj, "last_submit_ts"),
            cached_weights: obj.get("cached_weights").and_then(weights),
            cached_digest: obj
                .get("cached_digest")
                .and_then(Value::as_str)
                .filter(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
                .map(str::to_ascii_lowercase),
        }
    }

    /// The fields of a state document that are present (not `null`) but fail their own
    /// validation in [`State::from_bytes`] and so read as absent, in file order of the
    /// schema. Empty for a non-object document (that is [`damage`]'s case).
    pub fn dropped_fields(bytes: &[u8]) -> Vec<&'static str> {
        let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(bytes) else {
            return Vec::new();
        };
        let st = State::from_bytes(bytes);
        let kept = [
            ("last_applied", st.last_applied.is_some()),
            ("last_submit_block", st.last_submit_block.is_some()),
            ("last_submit_ts", st.last_submit_ts.is_some()),
            ("cached_weights", st.cached_weights.is_some()),
            ("cached_digest", st.cached_digest.is_some()),
        ];
        kept.into_iter()
            .filter(|(key, ok)| !ok && obj.get(*key).is_some_and(|v| !v.is_null()))
            .map(|(key, _)| key)
            .collect()
    }

    /// Serialises all fields (absent ones as `null`).
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "last_applied": self.last_applied,
            "last_submit_block": self.last_submit_block,
            "last_submit_ts": self.last_submit_ts,
            "cached_weights": self.cached_weights.as_ref().map(|ws| {
                ws.iter().map(|(h, w)| serde_json::json!([h, w])).collect::<Vec<_>>()
            }),
            "cached_digest": self.cached_digest,
        })
    }
}

/// Non-negative integer field; booleans, floats and strings are absent.
fn uint(obj: &Map<String, Value>, key: &str) -> Option<u64> {
    match obj.get(key)? {
        Value::Number(n) => n.as_u64(),
        _ => None,
    }
}

/// Unix-seconds field: an integer, or a finite non-negative float (files written by the
/// Python validator store `time.time()`), truncated to whole seconds.
fn timestamp(obj: &Map<String, Value>, key: &str) -> Option<u64> {
    match obj.get(key)? {
        Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && *f < 1.0e15)
                .map(|f| f as u64)
        }),
        _ => None,
    }
}

/// `[[hotkey: string, weight: integer 0..=65535], ...]`; any malformed entry voids the field.
fn weights(v: &Value) -> Option<Vec<(String, u16)>> {
    v.as_array()?
        .iter()
        .map(|pair| match pair.as_array().map(Vec::as_slice) {
            Some([Value::String(h), Value::Number(w)]) => {
                Some((h.clone(), u16::try_from(w.as_u64()?).ok()?))
            }
            _ => None,
        })
        .collect()
}

/// Reads the state file; a missing or unreadable file reads as empty.
pub fn read(path: &Path) -> State {
    std::fs::read(path)
        .map(|b| State::from_bytes(&b))
        .unwrap_or_default()
}

/// Start-up probe of a file the daemon writes (state or heartbeat): creates its directory
/// and a temp file in it (removed again), as [`write`] will. An error here means every
/// later write would fail too (read-only volume, wrong owner, a path under a regular file,
/// a directory where the file belongs). The two path shapes the OS only reports as "File
/// exists" / "Is a directory" are named: a regular file where a folder of the path should
/// be, and a directory at the file's own path.
pub fn probe_writable(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if path.is_dir() {
        return Err(std::io::Error::other(format!(
            "{} is a directory, not a file",
            path.display()
        )));
    }
    // the deepest folder of the path that exists must be a folder
    if let Some(blocker) = dir
        .ancestors()
        .find(|a| !a.as_os_str().is_empty() && a.symlink_metadata().is_ok())
        .filter(|a| !a.is_dir())
    {
        return Err(std::io::Error::other(format!(
            "{} is a regular file where a folder of the path should be",
            blocker.display()
        )));
    }
    std::fs::create_dir_all(&dir)?;
    tempfile::Builder::new()
        .prefix(".probe-")
        .tempfile_in(&dir)
        .map(drop)
}

/// Why an existing state file would read as empty (unreadable, not JSON, not a JSON
/// object), or `None` when it is absent or an object. Fields are still validated one by
/// one by [`read`]; this only names a whole-file loss for the start-up log.
pub fn damage(path: &Path) -> Option<String> {
    match std::fs::read(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!("unreadable ({e})")),
        Ok(bytes) => match serde_json::from_slice::<Value>(&bytes) {
            Ok(Value::Object(_)) => None,
            Ok(_) => Some("not a JSON object".to_owned()),
            Err(e) => Some(format!("not valid JSON ({e})")),
        },
    }
}

/// The fields of an existing state file that read as absent because their value is
/// malformed (see [`State::dropped_fields`]); empty when the file is absent, unreadable or
/// not an object ([`damage`] names those).
pub fn dropped_fields(path: &Path) -> Vec<&'static str> {
    std::fs::read(path)
        .map(|b| State::dropped_fields(&b))
        .unwrap_or_default()
}

/// The fixed temp file [`write`] uses for `path`: `.<file name>.tmp` in the same directory
/// (so the `rename` stays within one filesystem). Fixed, not random, so a SIGKILL between
/// create and rename leaves at most this one file, which the next write truncates and
/// [`remove_stale_temp`] deletes. It is never read: only the rename publishes its content.
/// Only one process may write a given state file (one validator per state directory).
pub fn temp_path(path: &Path) -> PathBuf {
    sibling(path, "tmp")
}

/// `.<file name>.<ext>` in the directory of `path`.
fn sibling(path: &Path, ext: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "state".to_owned());
    let tmp = format!(".{name}.{ext}");
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.join(tmp),
        _ => PathBuf::from(tmp),
    }
}

/// The lock file that makes one validator process the owner of `path`:
/// `.<file name>.lock` in the same directory. The daemon holds an exclusive `flock` on it
/// for its lifetime (the kernel drops it when the process dies, even by SIGKILL), so a
/// second daemon pointed at the same state file refuses to start instead of racing the
/// first on [`temp_path`].
pub fn lock_path(path: &Path) -> PathBuf {
    sibling(path, "lock")
}

/// Deletes the temp file a killed write of `path` left behind ([`temp_path`]); returns
/// whether there was one. Called at start-up; a missing file is not an error.
pub fn remove_stale_temp(path: &Path) -> std::io::Result<bool> {
    match std::fs::remove_file(temp_path(path)) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `bytes` to `path` atomically: [`temp_path`] opened with create + truncate (a stale
/// temp from a killed write is overwritten, never appended to), write, `fsync`, `rename`
/// over `path`, then `fsync` of the directory so the rename itself is durable. A kill at
/// any moment leaves `path` either old or new, and at most the one temp file. The parent
/// directory is created first.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir)?;
    let tmp = temp_path(path);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        // best effort: do not leave a partial temp behind after a failed write
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // Make the rename itself durable.
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes `state` atomically with [`write_atomic`] (creating the parent directory).
pub fn write(path: &Path, state: &State) -> Result<(), StateError> {
    let mut bytes = serde_json::to_vec_pretty(&state.to_json()).unwrap_or_default();
    bytes.push(b'\n');
    write_atomic(path, &bytes).map_err(|source| StateError::Io {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> State {
        State {
            last_applied: Some(7),
            last_submit_block: Some(1234),
            last_submit_ts: Some(1_700_000_000),
            cached_weights: Some(vec![("5Abc".into(), 65535), ("5Def".into(), 0)]),
            cached_digest: Some("ab".repeat(32)),
        }
    }

    #[test]
    fn probe_and_damage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/state.json");
        probe_writable(&path).unwrap();
        assert_eq!(std::fs::read_dir(dir.path().join("a")).unwrap().count(), 0);
        // A parent that is a regular file: no write can ever succeed there.
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, b"x").unwrap();
        let e = probe_writable(&blocker.join("deeper/state.json")).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("file is a regular file where a folder of the path should be"),
            "{e}"
        );
        // a directory at the file's own path
        let e = probe_writable(dir.path()).unwrap_err();
        assert!(e.to_string().ends_with("is a directory, not a file"), "{e}");

        assert_eq!(damage(&path), None);
        std::fs::write(&path, b"\x00\xffgarbage").unwrap();
        assert!(damage(&path).unwrap().starts_with("not valid JSON"));
        std::fs::write(&path, b"[1, 2]").unwrap();
        assert_eq!(damage(&path).as_deref(), Some("not a JSON object"));
        write(&path, &full()).unwrap();
        assert_eq!(damage(&path), None);
    }

    #[test]
    fn round_trip_and_parent_dir_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b/state.json");
        write(&path, &full()).unwrap();
        assert_eq!(read(&path), full());
        // overwrite keeps a single file and no temp files behind
        let mut s = full();
        s.last_applied = Some(8);
        write(&path, &s).unwrap();
        assert_eq!(read(&path), s);
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(names.len(), 1);
    }

    #[test]
    fn fixed_temp_is_truncated_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(temp_path(&path), dir.path().join(".state.json.tmp"));
        assert_eq!(lock_path(&path), dir.path().join(".state.json.lock"));
        assert_eq!(temp_path(Path::new("s.json")), PathBuf::from(".s.json.tmp"));
        assert!(!remove_stale_temp(&path).unwrap());
        // a killed write left a longer, torn temp: the next write truncates it, never appends
        std::fs::write(temp_path(&path), vec![b'x'; 100_000]).unwrap();
        write(&path, &full()).unwrap();
        assert_eq!(read(&path), full());
        assert!(!temp_path(&path).exists());
        std::fs::write(temp_path(&path), b"{").unwrap();
        assert!(remove_stale_temp(&path).unwrap());
        assert!(!temp_path(&path).exists());
        assert_eq!(read(&path), full());
        // a failed rename (the target is a non-empty directory) leaves no temp behind
        let blocked = dir.path().join("dir");
        std::fs::create_dir_all(blocked.join("inner")).unwrap();
        assert!(write(&blocked, &full()).is_err());
        assert!(!temp_path(&blocked).exists());
    }

    #[test]
    fn readers_never_see_a_torn_file() {
        // A writer alternates two states while a reader reads as fast as it can: every read
        // is exactly one of them (rename is atomic), never a mix or empty.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        let a = full();
        let mut b = full();
        b.last_applied = Some(99);
        b.cached_weights = Some(
            (0..500)
                .map(|i| (format!("5Hotkey{i}"), i as u16))
                .collect(),
        );
        write(&path, &a).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let writer = {
            let (path, a, b, stop) = (path.clone(), a.clone(), b.clone(), stop.clone());
            std::thread::spawn(move || {
                for i in 0..200 {
                    write(&path, if i % 2 == 0 { &b } else { &a }).unwrap();
                }
                stop.store(true, std::sync::atomic::Ordering::SeqCst);
            })
        };
        let mut reads = 0;
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let s = read(&path);
            assert!(s == a || s == b, "torn read: {s:?}");
            reads += 1;
        }
        writer.join().unwrap();
        assert!(reads > 0);
    }

    #[test]
    fn missing_truncated_or_non_object_reads_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        assert_eq!(read(&path), State::default());
        let good = serde_json::to_vec(&full().to_json()).unwrap();
        for cut in 0..good.len() {
            std::fs::write(&path, &good[..cut]).unwrap();
            // a truncated file never reads as anything but empty
            assert_eq!(read(&path), State::default(), "cut at {cut}");
        }
        for junk in ["[]", "3", "\"x\"", "null", "{"] {
            std::fs::write(&path, junk).unwrap();
            assert_eq!(read(&path), State::default());
        }
    }

    #[test]
    fn each_field_validates_on_its_own() {
        let s = State::from_bytes(
            br#"{"last_applied": true, "last_submit_block": 0, "last_submit_ts": 1700000000.75,
                "cached_weights": [["5A", 1], ["5B", 70000]], "cached_digest": "zz"}"#,
        );
        assert_eq!(
            s,
            State {
                last_submit_ts: Some(1_700_000_000),
                ..State::default()
            }
        );
        let s = State::from_bytes(
            br#"{"last_applied": 3, "last_submit_block": -5, "last_submit_ts": "now",
                "cached_weights": [["5A", true]]}"#,
        );
        assert_eq!(
            s,
            State {
                last_applied: Some(3),
                ..State::default()
            }
        );
        let s = State::from_bytes(
            br#"{"last_applied": 2.5, "cached_weights": [["5A", 1, 2]], "last_submit_ts": -1}"#,
        );
        assert_eq!(s, State::default());
        assert_eq!(
            State::dropped_fields(
                br#"{"last_applied": "x", "last_submit_block": null, "last_submit_ts": 5,
                    "cached_weights": [["5A", true]], "cached_digest": 7, "extra": 1}"#
            ),
            vec!["last_applied", "cached_weights", "cached_digest"]
        );
        assert!(State::dropped_fields(&serde_json::to_vec(&full().to_json()).unwrap()).is_empty());
        assert!(
            State::dropped_fields(&serde_json::to_vec(&State::default().to_json()).unwrap())
                .is_empty()
        );
        assert!(State::dropped_fields(b"[1]").is_empty());
        let s = State::from_bytes(br#"{"cached_weights": [], "cached_digest": "ABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABABAB"}"#);
        assert_eq!(s.cached_weights, Some(vec![]));
        assert_eq!(s.cached_digest, Some("ab".repeat(32)));
    }
}
