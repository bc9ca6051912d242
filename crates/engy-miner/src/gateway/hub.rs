//! What every leg shares ([`Hub`]): identity, the request path, the one registry of
//! running jobs, and the memory of cancels that came before their serve (docs/PROTOCOL.md §2.5).
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::Identity;
use crate::job::Job;
use crate::metrics::Metrics;
use crate::serve::Engine;

/// Shared state of all legs.
pub struct Hub {
    /// Identity and capacity.
    pub id: Identity,
    /// The request path.
    pub engine: Arc<Engine>,
    /// The one registry of running jobs, all legs: cancel, leg teardown, the SIGTERM drain
    /// and the heartbeats' `inflight` all read it.
    jobs: Mutex<Jobs>,
    /// corr_ids cancelled before their serve arrived (bounded).
    early_cancels: Mutex<EarlyCancels>,
    /// Set on SIGTERM: new serves are refused.
    pub draining: AtomicBool,
    /// Wakes [`Hub::wait_idle`] when the registry empties.
    idle: tokio::sync::Notify,
    /// Source of leg ids ([`Hub::new_leg`]).
    next_leg: AtomicU64,
    /// The Prometheus metrics (docs/MINER.md "Metrics").
    pub metrics: Arc<Metrics>,
}

/// Running jobs by registration number (a corr_id served again while its first job still
/// runs is a second entry, so nothing is lost from the count).
#[derive(Default)]
struct Jobs {
    next: u64,
    running: HashMap<u64, Entry>,
}

struct Entry {
    corr_id: String,
    leg: u64,
    job: Arc<Job>,
}

/// A job's place in the registry, held by its request task; [`Hub::finish`] gives it back.
pub(crate) struct Ticket {
    id: u64,
    /// The job's stop state.
    pub(crate) job: Arc<Job>,
}

impl Hub {
    /// New hub.
    pub fn new(id: Identity, engine: Arc<Engine>, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            id,
            engine,
            jobs: Mutex::new(Jobs::default()),
            early_cancels: Mutex::new(EarlyCancels::default()),
            draining: AtomicBool::new(false),
            idle: tokio::sync::Notify::new(),
            next_leg: AtomicU64::new(0),
            metrics,
        })
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, Jobs> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh id for a leg session (its jobs are registered under it).
    pub(crate) fn new_leg(&self) -> u64 {
        self.next_leg.fetch_add(1, Ordering::SeqCst)
    }

    /// Register the job of a `serve` that arrived on `leg`. Called BEFORE its task runs: a
    /// cancel may arrive before the task starts.
    pub(crate) fn register(&self, corr_id: &str, leg: u64) -> Ticket {
        let job = Job::new();
        let mut jobs = self.jobs();
        let id = jobs.next;
        jobs.next += 1;
        jobs.running.insert(
            id,
            Entry {
                corr_id: corr_id.to_string(),
                leg,
                job: Arc::clone(&job),
            },
        );
        self.metrics.set_inflight(jobs.running.len());
        Ticket { id, job }
    }

    /// The job ended (its terminal frame, if any, is sent): unregister it.
    pub(crate) fn finish(&self, ticket: &Ticket) {
        let empty = {
            let mut jobs = self.jobs();
            jobs.running.remove(&ticket.id);
            self.metrics.set_inflight(jobs.running.len());
            jobs.running.is_empty()
        };
        if empty {
            self.idle.notify_waiters();
        }
    }

    /// Requests being served, all legs.
    pub fn inflight(&self) -> usize {
        self.jobs().running.len()
    }

    /// Requests being served on `leg`.
    pub(crate) fn leg_inflight(&self, leg: u64) -> usize {
        self.jobs()
            .running
            .values()
            .filter(|e| e.leg == leg)
            .count()
    }

    /// The running jobs that `pick` selects, as (corr_id, job).
    fn select(&self, pick: impl Fn(&Entry) -> bool) -> Vec<(String, Arc<Job>)> {
        self.jobs()
            .running
            .values()
            .filter(|e| pick(e))
            .map(|e| (e.corr_id.clone(), Arc::clone(&e.job)))
            .collect()
    }

    /// The gateway's `cancel`: stop every running job of `corr_id` and abort its live serve
    /// calls on the dedicated client. A cancel for a corr_id not running here is remembered
    /// for [`EARLY_CANCEL_WINDOW`] (its serve may still be on the way).
    pub fn cancel(&self, corr_id: &str, why: &str) {
        let found = self.select(|e| e.corr_id == corr_id);
        if found.is_empty() {
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
        for (corr_id, job) in found {
            self.cancel_job(&corr_id, &job, why);
        }
    }

    /// Cancel every job of `leg` (its socket is gone: they can no longer be answered).
    pub(crate) fn cancel_leg(&self, leg: u64, why: &str) {
        for (corr_id, job) in self.select(|e| e.leg == leg) {
            self.cancel_job(&corr_id, &job, why);
        }
    }

    fn cancel_job(&self, corr_id: &str, job: &Job, why: &str) {
        let rids = job.cancel();
        tracing::info!(corr_id, aborting = rids.len(), why, "cancelled");
        self.engine.abort_rids(rids);
    }

    /// Abort every job for `why` (a SIGTERM drain that timed out): each still answers
    /// with an error `response` (docs/PROTOCOL.md §2.6: one terminal frame per serve).
    pub fn abort_all(&self, why: &str) {
        for (corr_id, job) in self.select(|_| true) {
            let rids = job.abort(why);
            tracing::info!(%corr_id, aborting = rids.len(), why, "aborted");
            self.engine.abort_rids(rids);
        }
    }

    /// Whether a cancel for `corr_id` arrived within [`EARLY_CANCEL_WINDOW`] before its
    /// `serve` (docs/PROTOCOL.md §2.5); consumes it.
    pub(crate) fn take_early_cancel(&self, corr_id: &str) -> bool {
        self.early_cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(corr_id, Instant::now())
    }

    /// Wait until no request is in flight; false at `deadline`.
    pub async fn wait_idle(&self, deadline: tokio::time::Instant) -> bool {
        loop {
            let wait = self.idle.notified();
            tokio::pin!(wait);
            // Registered before the check: a notify between the check and the await is kept.
            wait.as_mut().enable();
            if self.inflight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, wait).await.is_err() {
                return self.inflight() == 0;
            }
        }
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
