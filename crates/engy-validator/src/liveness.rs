//! Liveness (PROTOCOL.md §7 "Liveness"): the heartbeat file every tick stamps, the watchdog
//! that turns a wedged loop into an exit, and the `health` check the container runs.
//!
//! The heartbeat records "the loop completed a tick", not "weights were applied": most
//! ticks legitimately skip (the resubmit interval spans several polls), and fetch failures
//! and rejected payloads are healthy.

use std::path::Path;
use std::time::Duration;

/// Floor of the stall limit in seconds (§7: max(3 × POLL_S, 900 s)).
pub const MIN_STALL_S: u64 = 900;

/// How far in the future (seconds, by this host's clock) a timestamp may lie and still be
/// taken as written just now: room for an NTP step between the write and the read. Beyond
/// it a timestamp is invalid (a clock that went backwards, a file written on another host
/// or by hand) and counts as stale, never as "age 0 s".
pub const FUTURE_TOLERANCE_S: u64 = 60;

/// How often the watchdog looks at the heartbeat file.
pub const WATCHDOG_EVERY: Duration = Duration::from_secs(30);

/// Seconds without a completed tick that count as a stall: `max(3 × poll_s, 900)`.
pub fn stall_limit(poll_s: u64) -> u64 {
    poll_s.saturating_mul(3).max(MIN_STALL_S)
}

/// Writes `{"ts": now}` to the heartbeat file with [`crate::state::write_atomic`] (parent
/// directory created; fixed temp `.<name>.tmp` + fsync + rename, so `health` never reads a
/// half-written file and a SIGKILL leaves at most that one temp file).
pub fn stamp(path: &Path, now: u64) -> std::io::Result<()> {
    crate::state::write_atomic(
        path,
        serde_json::json!({ "ts": now }).to_string().as_bytes(),
    )
}

/// What the last tick knew of this validator's landings, kept in the heartbeat file beside
/// `ts` for `health --landing` (issue 21 item 3): `{"ts": …, "landing": {"blocks_since": N,
/// "activity_cutoff": C, "refused": "replay"}}`, each field absent when unknown.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Landing {
    /// Blocks since the chain last took this validator's weights (head − `LastUpdate`, or
    /// by the wall clock from the state file when the chain was not read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks_since: Option<u64>,
    /// The subnet's `activity_cutoff` as last read from the chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activity_cutoff: Option<u64>,
    /// Set when the state file refuses every vector: `replay` (its `last_applied` epoch is
    /// ahead of the provider's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// The landing verdict of `health --landing` (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LandingHealth {
    /// The last landing is within half of `activity_cutoff`.
    Ok {
        /// Blocks since the last landing.
        blocks_since: u64,
        /// The cutoff.
        activity_cutoff: u64,
    },
    /// Not known yet (no tick has read the chain or found a landing in the state file).
    Unknown,
    /// The last landing is older than half of `activity_cutoff`.
    Stale {
        /// Blocks since the last landing.
        blocks_since: u64,
        /// The cutoff.
        activity_cutoff: u64,
    },
    /// The state file refuses every vector (the replay guard).
    Refused,
}

impl LandingHealth {
    /// True for the verdicts `health --landing` exits non-zero on.
    pub fn failing(&self) -> bool {
        matches!(self, LandingHealth::Stale { .. } | LandingHealth::Refused)
    }

    /// The verdict in words (one clause of `health`'s line).
    pub fn describe(&self) -> String {
        match self {
            LandingHealth::Ok { blocks_since, activity_cutoff } => format!(
                "landing ok: last landing {blocks_since} blocks ago (alarm above half of activity_cutoff {activity_cutoff})"
            ),
            LandingHealth::Unknown => {
                "landing unknown: no tick has read the chain's LastUpdate or found a landing in the state file yet".to_owned()
            }
            LandingHealth::Stale { blocks_since, activity_cutoff } => format!(
                "NOTHING LANDED for {blocks_since} blocks, more than half of activity_cutoff {activity_cutoff}: the validator drops out of consensus at {activity_cutoff}"
            ),
            LandingHealth::Refused => {
                "NOTHING LANDS: the state file refuses every vector (replay guard: its last_applied epoch is ahead of the provider's; see the log for the fix)".to_owned()
            }
        }
    }
}

/// Judges the landing record of the heartbeat file: refused first, then the age of the last
/// landing against half of the cutoff (subtensor's default when none was read).
pub fn judge_landing(l: Option<&Landing>) -> LandingHealth {
    let Some(l) = l else {
        return LandingHealth::Unknown;
    };
    if l.refused.is_some() {
        return LandingHealth::Refused;
    }
    let Some(blocks_since) = l.blocks_since else {
        return LandingHealth::Unknown;
    };
    let activity_cutoff = l
        .activity_cutoff
        .unwrap_or(u64::from(crate::chain_rules::DEFAULT_ACTIVITY_CUTOFF));
    let a = crate::chain_rules::Activity {
        since: blocks_since,
        cutoff: activity_cutoff,
    };
    if a.alarming() {
        LandingHealth::Stale {
            blocks_since,
            activity_cutoff,
        }
    } else {
        LandingHealth::Ok {
            blocks_since,
            activity_cutoff,
        }
    }
}

/// [`stamp`] with the landing record of the last tick.
pub fn stamp_with(path: &Path, now: u64, landing: &Landing) -> std::io::Result<()> {
    crate::state::write_atomic(
        path,
        serde_json::json!({ "ts": now, "landing": landing })
            .to_string()
            .as_bytes(),
    )
}

/// The landing record of the heartbeat file, `None` when absent or invalid.
pub fn read_landing(path: &Path) -> Option<Landing> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    serde_json::from_value(v.get("landing")?.clone()).ok()
}

/// The heartbeat's timestamp (unix seconds), or `None` when the file is missing or invalid.
/// Integers and finite non-negative floats are accepted; booleans are not.
pub fn read_ts(path: &Path) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path).ok()?).ok()?;
    match v.get("ts")? {
        serde_json::Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0)
                .map(|f| f as u64)
        }),
        _ => None,
    }
}

/// Health verdict of a heartbeat timestamp (pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// No heartbeat yet (or unreadable).
    Missing,
    /// Last tick `age` seconds ago, within the limit.
    Fresh {
        /// Seconds since the last completed tick (0 if the clock went backwards).
        age: u64,
    },
    /// Last tick `age` seconds ago, past `limit`.
    Stale {
        /// Seconds since the last completed tick.
        age: u64,
        /// The stall limit.
        limit: u64,
    },
    /// The timestamp lies more than [`FUTURE_TOLERANCE_S`] in the future: invalid, and
    /// treated as stale (it proves no recent tick).
    Future {
        /// Seconds the timestamp is ahead of `now`.
        ahead: u64,
    },
}

/// Seconds `ts` lies ahead of `now` when that is more than [`FUTURE_TOLERANCE_S`]
/// (an invalid, future timestamp), else `None`.
pub fn future_by(ts: u64, now: u64) -> Option<u64> {
    let ahead = ts.saturating_sub(now);
    (ahead > FUTURE_TOLERANCE_S).then_some(ahead)
}

/// Judges a heartbeat timestamp against `stall_limit(poll_s)`; a timestamp in the future
/// ([`future_by`]) is [`Health::Future`].
pub fn judge(ts: Option<u64>, now: u64, poll_s: u64) -> Health {
    let Some(ts) = ts else {
        return Health::Missing;
    };
    if let Some(ahead) = future_by(ts, now) {
        return Health::Future { ahead };
    }
    let age = now.saturating_sub(ts);
    let limit = stall_limit(poll_s);
    if age > limit {
        Health::Stale { age, limit }
    } else {
        Health::Fresh { age }
    }
}

/// Current unix time in seconds (0 if the clock is before 1970).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The watchdog's verdict (pure): like [`judge`], but a heartbeat older than the process
/// (`started_at`, left by a previous run) counts from the start instead, so a restart after
/// a long stop is not mistaken for a stall. A future timestamp ([`future_by`]) proves no
/// tick either and counts from the start the same way: the watchdog fires once this
/// process has gone a stall limit without stamping a valid one.
pub fn watchdog_judge(ts: Option<u64>, started_at: u64, now: u64, poll_s: u64) -> Health {
    let ts = ts.map(|t| match future_by(t, now) {
        Some(_) => started_at,
        None => t.max(started_at),
    });
    judge(ts, now, poll_s)
}

/// Starts the watchdog thread: every [`WATCHDOG_EVERY`] it exits the process with code 1
/// when the heartbeat is stale. A missing heartbeat (start-up) is not a stall, and neither
/// is one left by a previous run ([`watchdog_judge`]). It runs on its own OS thread so a
/// wedged async runtime cannot stop it.
pub fn spawn_watchdog(path: std::path::PathBuf, poll_s: u64) -> std::io::Result<()> {
    let started_at = unix_now();
    std::thread::Builder::new()
        .name("watchdog".into())
        .spawn(move || {
            let mut warned = false;
            loop {
            std::thread::sleep(WATCHDOG_EVERY);
            let (ts, now) = (read_ts(&path), unix_now());
            if let Some(ahead) = ts.and_then(|t| future_by(t, now)).filter(|_| !warned) {
                warned = true;
                tracing::warn!(
                    "watchdog: heartbeat file {} has a timestamp {ahead} s in the future (invalid: the clock went backwards or the file was written elsewhere); treated as stale, counting from this process's start",
                    path.display()
                );
            }
            let verdict = watchdog_judge(ts, started_at, now, poll_s);
            if let Health::Stale { age, limit } = verdict {
                tracing::error!(
                    "watchdog: no completed tick in {age} s (limit {limit} s); exiting 1 so the restart policy recovers the validator"
                );
                std::process::exit(1);
            }
            }
        })
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stall_limit_floor() {
        assert_eq!(stall_limit(300), 900);
        assert_eq!(stall_limit(10), 900);
        assert_eq!(stall_limit(301), 903);
        assert_eq!(stall_limit(u64::MAX), u64::MAX);
    }

    #[test]
    fn judge_cases() {
        assert_eq!(judge(None, 100, 300), Health::Missing);
        assert_eq!(judge(Some(100), 1000, 300), Health::Fresh { age: 900 });
        assert_eq!(
            judge(Some(100), 1001, 300),
            Health::Stale {
                age: 901,
                limit: 900
            }
        );
        // a clock step inside the tolerance still reads as just now
        assert_eq!(judge(Some(1060), 1000, 300), Health::Fresh { age: 0 });
        assert_eq!(judge(Some(2000), 1000, 300), Health::Future { ahead: 1000 });
    }

    #[test]
    fn watchdog_ignores_a_previous_runs_heartbeat() {
        // heartbeat from a run that stopped long ago; this process started at 10_000
        assert_eq!(
            watchdog_judge(Some(5), 10_000, 10_100, 300),
            Health::Fresh { age: 100 }
        );
        assert_eq!(
            watchdog_judge(Some(5), 10_000, 10_901, 300),
            Health::Stale {
                age: 901,
                limit: 900
            }
        );
        assert_eq!(watchdog_judge(None, 10_000, 99_999, 300), Health::Missing);
        // a future heartbeat counts from the start, like a previous run's
        assert_eq!(
            watchdog_judge(Some(99_999), 10_000, 10_100, 300),
            Health::Fresh { age: 100 }
        );
        assert_eq!(
            watchdog_judge(Some(99_999), 10_000, 10_901, 300),
            Health::Stale {
                age: 901,
                limit: 900
            }
        );
        // a heartbeat of this process counts as is
        assert_eq!(
            watchdog_judge(Some(10_500), 10_000, 11_000, 300),
            Health::Fresh { age: 500 }
        );
    }

    #[test]
    fn landing_verdicts() {
        assert_eq!(judge_landing(None), LandingHealth::Unknown);
        let l = |since: Option<u64>, cutoff: Option<u64>, refused: Option<&str>| Landing {
            blocks_since: since,
            activity_cutoff: cutoff,
            refused: refused.map(str::to_owned),
        };
        assert!(!judge_landing(Some(&l(Some(100), Some(1000), None))).failing());
        assert!(!judge_landing(Some(&l(Some(500), Some(1000), None))).failing());
        assert!(judge_landing(Some(&l(Some(501), Some(1000), None))).failing());
        assert!(judge_landing(Some(&l(Some(1), Some(1000), Some("replay")))).failing());
        assert_eq!(
            judge_landing(Some(&l(None, Some(1000), None))),
            LandingHealth::Unknown
        );
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("hb.json");
        stamp_with(&p, 77, &l(Some(3), Some(9), None)).unwrap();
        assert_eq!(read_ts(&p), Some(77));
        assert_eq!(read_landing(&p), Some(l(Some(3), Some(9), None)));
    }

    #[test]
    fn stamp_and_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x/heartbeat.json");
        assert_eq!(read_ts(&p), None);
        stamp(&p, 1234).unwrap();
        assert_eq!(read_ts(&p), Some(1234));
        std::fs::write(&p, r#"{"ts": true}"#).unwrap();
        assert_eq!(read_ts(&p), None);
        std::fs::write(&p, r#"{"ts": 12.9}"#).unwrap();
        assert_eq!(read_ts(&p), Some(12));
        std::fs::write(&p, "{").unwrap();
        assert_eq!(read_ts(&p), None);
    }
}
