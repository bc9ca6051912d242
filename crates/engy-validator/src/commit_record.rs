//! The record of the last timelocked commit (commit-reveal v4), kept apart from the state
//! file: a commit is not a landing. Its weights reach the chain only when the chain reveals
//! it, one or more epochs later, so the commit is written here when it is included and
//! checked against chain storage once its reveal block plus [`REVEAL_MARGIN_BLOCKS`] has
//! passed (see [`crate::daemon`]).
//!
//! File: `<state file stem>.commit.json` beside the state file, written atomically like
//! the state file. Read leniently: a missing or malformed file is no record.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Blocks after the reveal block before the reveal is checked (the chain retries a reveal
/// every block of the reveal epoch while the drand pulse is missing).
pub const REVEAL_MARGIN_BLOCKS: u64 = 10;

/// One timelocked commit this validator made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitRecord {
    /// The provider epoch of the committed vector.
    pub epoch: u64,
    /// The chain epoch the commit is keyed by (`TimelockedWeightCommits` key).
    pub commit_epoch: u64,
    /// The chain epoch it reveals in.
    pub reveal_epoch: u64,
    /// The drand round it is locked to.
    pub reveal_round: u64,
    /// The block it was included in.
    pub commit_block: u64,
    /// The first block the chain tries the reveal.
    pub reveal_block: u64,
    /// sha256 hex of the SCALE plaintext (`WeightsTlockPayload`).
    pub payload_sha256: String,
    /// The committed dest uids (the `Weights` row has these after the reveal).
    pub uids: Vec<u16>,
    /// True once the reveal was checked (either way).
    #[serde(default)]
    pub checked: bool,
}

impl CommitRecord {
    /// The block from which the reveal is checked.
    pub fn check_from(&self) -> u64 {
        self.reveal_block.saturating_add(REVEAL_MARGIN_BLOCKS)
    }
}

/// The record file beside `state_file`: `state.json` → `state.commit.json`.
pub fn path_for(state_file: &Path) -> PathBuf {
    let stem = state_file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "state".into());
    state_file.with_file_name(format!("{stem}.commit.json"))
}

/// The record, `None` when absent or unreadable.
pub fn read(state_file: &Path) -> Option<CommitRecord> {
    let bytes = std::fs::read(path_for(state_file)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Writes the record atomically.
pub fn write(state_file: &Path, record: &CommitRecord) -> std::io::Result<()> {
    let mut bytes = serde_json::to_vec_pretty(record).map_err(std::io::Error::other)?;
    bytes.push(b'\n');
    crate::state::write_atomic(&path_for(state_file), &bytes)
}

/// What the chain shows for a commit after its reveal block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RevealCheck {
    /// Left the queue and the `Weights` row has the committed uids.
    Revealed,
    /// Still queued: the chain has no pulse for its round yet.
    StillQueued {
        /// `Drand.LastStoredRound` now.
        last_stored_round: Option<u64>,
    },
    /// Left the queue without the row changing: the chain dropped it at reveal.
    Dropped {
        /// The dest uids the row has now.
        row_uids: Vec<u16>,
    },
}

/// Judges a commit from chain storage: `still_queued` (found in
/// `TimelockedWeightCommits`), the `Weights` row's dest uids, and `LastStoredRound`.
pub fn judge(
    record: &CommitRecord,
    still_queued: bool,
    row_uids: &[u16],
    last_stored_round: Option<u64>,
) -> RevealCheck {
    if still_queued {
        return RevealCheck::StillQueued { last_stored_round };
    }
    let mut want = record.uids.clone();
    want.sort_unstable();
    let mut have = row_uids.to_vec();
    have.sort_unstable();
    if want == have {
        RevealCheck::Revealed
    } else {
        RevealCheck::Dropped { row_uids: have }
    }
}

/// The one log fragment for a checked commit, and whether it is an ERROR.
pub fn describe(record: &CommitRecord, check: &RevealCheck) -> (bool, String) {
    let what = format!(
        "commit of epoch {} (chain epoch {}, drand round {}, block #{}, payload sha256 {}…)",
        record.epoch,
        record.commit_epoch,
        record.reveal_round,
        record.commit_block,
        record
            .payload_sha256
            .get(..12)
            .unwrap_or(&record.payload_sha256)
    );
    match check {
        RevealCheck::Revealed => (
            false,
            format!(
                "{what} revealed: Weights row has its {} uids",
                record.uids.len()
            ),
        ),
        RevealCheck::StillQueued { last_stored_round } => (
            true,
            format!(
                "ERROR {what} NOT revealed by block #{}: still queued; likely cause: the chain has no drand pulse for round {} yet (Drand.LastStoredRound {}): the chain's drand feed lags",
                record.check_from(),
                record.reveal_round,
                last_stored_round.map_or("absent".into(), |r| r.to_string())
            ),
        ),
        RevealCheck::Dropped { row_uids } => (
            true,
            format!(
                "ERROR {what} NOT revealed: it left the queue but the Weights row has {} other uids; likely cause: the reveal's set_weights checks failed (version key, validator permit, uids no longer registered) or a later commit replaced it",
                row_uids.len()
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> CommitRecord {
        CommitRecord {
            epoch: 12,
            commit_epoch: 50,
            reveal_epoch: 51,
            reveal_round: 1000,
            commit_block: 1011,
            reveal_block: 1360,
            payload_sha256: "ab".repeat(32),
            uids: vec![3, 1],
            checked: false,
        }
    }

    #[test]
    fn commit_reveal_record_round_trips_beside_the_state_file() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        assert_eq!(path_for(&state), dir.path().join("state.commit.json"));
        assert_eq!(read(&state), None);
        write(&state, &record()).unwrap();
        assert_eq!(read(&state), Some(record()));
        std::fs::write(path_for(&state), b"{not json").unwrap();
        assert_eq!(read(&state), None);
        assert_eq!(record().check_from(), 1370);
    }

    #[test]
    fn commit_reveal_check_tells_revealed_from_unrevealed() {
        let r = record();
        assert_eq!(judge(&r, false, &[1, 3], Some(5)), RevealCheck::Revealed);
        let (err, line) = describe(&r, &RevealCheck::Revealed);
        assert!(!err && line.contains("revealed"), "{line}");
        let queued = judge(&r, true, &[1, 3], Some(990));
        assert_eq!(
            queued,
            RevealCheck::StillQueued {
                last_stored_round: Some(990)
            }
        );
        let (err, line) = describe(&r, &queued);
        assert!(
            err && line.starts_with("ERROR") && line.contains("990"),
            "{line}"
        );
        let dropped = judge(&r, false, &[1, 2], None);
        assert_eq!(
            dropped,
            RevealCheck::Dropped {
                row_uids: vec![1, 2]
            }
        );
        let (err, line) = describe(&r, &dropped);
        assert!(err && line.contains("likely cause"), "{line}");
    }
}
