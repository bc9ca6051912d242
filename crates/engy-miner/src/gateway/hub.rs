//! What every leg shares ([`Hub`]): identity, the request path, the registry of running
//! jobs, and the memory of cancels that came before their serve (docs/PROTOCOL.md §2.5).
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Identity;
use crate::job::Job;
use crate::serve::Engine;

/// Shared state of all legs.
pub struct Hub {
    /// Identity and capacity.
    pub id: Identity,
    /// The request path.
    pub engine: Arc<Engine>,
    /// corr_id → job, for cancel.
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    /// corr_ids cancelled before their serve arrived (bounded).
    early_cancels: Mutex<EarlyCancels>,
    /// Requests being served, all legs.
    pub inflight: AtomicUsize,
    /// Set on SIGTERM: new serves are refused.
    pub draining: AtomicBool,
    /// Wakes the drain wait.
    pub idle: tokio::sync::Notify,
}

impl Hub {
    /// New hub.
    pub fn new(id: Identity, engine: Arc<Engine>) -> Arc<Self> {
        Arc::new(Self {
            id,
            engine,
            jobs: Mutex::new(HashMap::new()),
            early_cancels: Mutex::new(EarlyCancels::default()),
            inflight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            idle: tokio::sync::Notify::new(),
        })
    }

    pub(crate) fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cancel one job: mark it, then abort its live serve calls on the dedicated client.
    pub fn cancel(&self, corr_id: &str, why: &str) {
        let job = self.jobs().get(corr_id).cloned();
        match job {
            Some(job) => self.cancel_job(corr_id, &job, why),
            None => {
                self.early_cancels
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(corr_id, Instant::now());
                let shown = corr_id
                    .char_indices()
                    .nth(64)
                    .and_then(|(i, _)| corr_id.get(..i))
                    .unwrap_or(corr_id);
                tracing::info!(
                    corr_id = shown,
                    why,
                    window_s = EARLY_CANCEL_WINDOW.as_secs(),
                    "cancel for a request not running here; a serve of it within the window is answered as cancelled"
                );
            }
        }
    }

    pub(crate) fn cancel_job(&self, corr_id: &str, job: &Job, why: &str) {
        let rids = job.cancel();
        tracing::info!(corr_id, aborting = rids.len(), why, "cancelled");
        self.engine.abort_rids(rids);
    }

    /// Unregister `job` when it ended, unless `corr_id` was served again meanwhile (a
    /// corr_id served again after its cancel is a new job, and stays cancellable).
    pub(crate) fn forget(&self, corr_id: &str, job: &Arc<Job>) {
        let mut jobs = self.jobs();
        if jobs.get(corr_id).is_some_and(|j| Arc::ptr_eq(j, job)) {
            jobs.remove(corr_id);
        }
    }

    /// Abort every job for `why` (a SIGTERM drain that timed out): each still answers
    /// with an error `response` (docs/PROTOCOL.md §2.6: one terminal frame per serve).
    pub fn abort_all(&self, why: &str) {
        let jobs: Vec<(String, Arc<Job>)> = self
            .jobs()
            .iter()
            .map(|(c, j)| (c.clone(), Arc::clone(j)))
            .collect();
        for (corr_id, job) in jobs {
            let rids = job.abort(why);
            tracing::info!(%corr_id, aborting = rids.len(), why, "aborted");
            self.engine.abort_rids(rids);
        }
    }

    /// Whether a cancel for `corr_id` arrived within [`EARLY_CANCEL_WINDOW`] before its
    /// `serve` (docs/PROTOCOL.md §2.5);
    /// consumes it.
    pub(crate) fn take_early_cancel(&self, corr_id: &str) -> bool {
        self.early_cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(corr_id, Instant::now())
    }
}

/// How long a cancel for a request the miner is not running is remembered: a `serve` of
/// that corr_id arriving within this window is answered as cancelled (docs/PROTOCOL.md
/// §2.5); after it the memory is gone and a serve is served.
pub const EARLY_CANCEL_WINDOW: Duration = Duration::from_secs(5);

/// Cancels for corr_ids not (yet) served, bounded in time ([`EARLY_CANCEL_WINDOW`]),
/// entries ([`EARLY_CANCELS`]) and bytes ([`EARLY_CANCEL_BYTES`]): a gateway cannot grow
/// it, and a corr_id reused later is not swallowed.
#[derive(Debug, Default)]
pub struct EarlyCancels {
    q: VecDeque<(String, Instant)>,
    bytes: usize,
}

impl EarlyCancels {
    /// Remember a cancel of `corr_id` received at `now` (a corr_id longer than
    /// [`EARLY_CANCEL_BYTES`] is not kept).
    pub fn insert(&mut self, corr_id: &str, now: Instant) {
        self.expire(now);
        if corr_id.len() > EARLY_CANCEL_BYTES {
            return;
        }
        self.q.push_back((corr_id.to_string(), now));
        self.bytes += corr_id.len();
        while self.q.len() > EARLY_CANCELS || self.bytes > EARLY_CANCEL_BYTES {
            self.pop();
        }
    }

    /// Whether a cancel of `corr_id` is remembered at `now`; forgets it.
    pub fn take(&mut self, corr_id: &str, now: Instant) -> bool {
        self.expire(now);
        match self.q.iter().position(|(c, _)| c == corr_id) {
            Some(i) => {
                if let Some((c, _)) = self.q.remove(i) {
                    self.bytes -= c.len();
                }
                true
            }
            None => false,
        }
    }

    /// Entries remembered.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// No entry remembered.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    pub(crate) fn pop(&mut self) {
        if let Some((c, _)) = self.q.pop_front() {
            self.bytes -= c.len();
        }
    }

    pub(crate) fn expire(&mut self, now: Instant) {
        while self
            .q
            .front()
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= EARLY_CANCEL_WINDOW)
        {
            self.pop();
        }
    }
}

/// Cancels kept for requests not (yet) served, at most this many …
pub const EARLY_CANCELS: usize = 1024;
/// … and this many bytes of corr_ids in all (a longer corr_id is not kept).
pub const EARLY_CANCEL_BYTES: usize = 64 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_cancels_expire_and_are_consumed() {
        let t0 = Instant::now();
        let mut q = EarlyCancels::default();
        q.insert("a", t0);
        assert!(q.take("a", t0 + Duration::from_secs(1)));
        assert!(!q.take("a", t0 + Duration::from_secs(1)), "consumed");
        q.insert("b", t0);
        assert!(!q.take("b", t0 + EARLY_CANCEL_WINDOW), "expired");
        assert!(q.is_empty());
        for i in 0..EARLY_CANCELS + 10 {
            q.insert(&i.to_string(), t0);
        }
        assert_eq!(q.len(), EARLY_CANCELS);
        q.insert(&"x".repeat(EARLY_CANCEL_BYTES + 1), t0);
        assert_eq!(q.len(), EARLY_CANCELS);
    }
}
