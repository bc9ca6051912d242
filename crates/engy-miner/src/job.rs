//! One gateway request's stop state ([`Job`]) and how a request ends without a reply
//! ([`JobError`]). The hub's registry holds the jobs; the request path checks them.
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

/// How a job ended without a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobError {
    /// The gateway cancelled it: nothing more goes on the wire.
    Cancelled,
    /// It failed; the string is the (≤ 300 char) error sent to the gateway.
    Failed(String),
}

pub(crate) fn fail(msg: impl Into<String>) -> JobError {
    JobError::Failed(msg.into())
}

/// Stop state of one gateway request (corr_id), shared by the leg that received it and the
/// task serving it. Registered before the task starts, so a `cancel` that arrives first is
/// honoured.
///
/// A job stops in one of two ways: the gateway's `cancel` ([`Job::cancel`]: nothing more
/// goes on the wire for it) or the miner's own abort ([`Job::abort`], e.g. a SIGTERM drain
/// that timed out: the request still gets its terminal `response`, with the reason as
/// `error`).
#[derive(Debug, Default)]
pub struct Job {
    token: CancellationToken,
    state: Mutex<JobState>,
}

#[derive(Debug, Default)]
struct JobState {
    cancelled: bool,
    aborted: Option<String>,
    /// (serve URL, rid) of every live serve call.
    rids: Vec<(String, String)>,
}

impl Job {
    /// A fresh, live job.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True once cancelled or aborted: the request path stops at its next check.
    pub fn is_cancelled(&self) -> bool {
        let st = self.state();
        st.cancelled || st.aborted.is_some()
    }

    /// The gateway cancelled it: mark it and return the live serve calls to abort.
    /// Idempotent (a second call returns nothing).
    pub fn cancel(&self) -> Vec<(String, String)> {
        let mut st = self.state();
        if st.cancelled {
            return Vec::new();
        }
        st.cancelled = true;
        self.token.cancel();
        std::mem::take(&mut st.rids)
    }

    /// The miner stops it for `why` (it still answers with an error `response`); returns
    /// the live serve calls to abort. Nothing happens to a job already cancelled or
    /// aborted.
    pub fn abort(&self, why: &str) -> Vec<(String, String)> {
        let mut st = self.state();
        if st.cancelled || st.aborted.is_some() {
            return Vec::new();
        }
        st.aborted = Some(why.to_string());
        self.token.cancel();
        std::mem::take(&mut st.rids)
    }

    /// Why the miner aborted it, if it did.
    pub fn abort_reason(&self) -> Option<String> {
        self.state().aborted.clone()
    }

    /// Run `f` unless the gateway cancelled the job, atomically with respect to
    /// [`Job::cancel`]: used to put a frame on the wire only while the gateway still
    /// waits for it.
    pub fn if_live<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        let st = self.state();
        if st.cancelled {
            None
        } else {
            Some(f())
        }
    }

    /// Resolves when cancelled or aborted.
    pub async fn cancelled(&self) {
        self.token.cancelled().await;
    }

    pub(crate) fn add_rid(&self, serve: &str, rid: &str) -> Result<(), JobError> {
        let mut st = self.state();
        if st.cancelled || st.aborted.is_some() {
            return Err(JobError::Cancelled);
        }
        st.rids.push((serve.to_string(), rid.to_string()));
        Ok(())
    }

    pub(crate) fn remove_rid(&self, rid: &str) {
        self.state().rids.retain(|(_, r)| r != rid);
    }
}
