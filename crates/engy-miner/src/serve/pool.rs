//! The configured sglang serves and their in-flight counts: each generation goes to the
//! least-loaded serve (docs/PROTOCOL.md §3.3).
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// One configured serve and its in-flight count.
#[derive(Debug)]
struct ServeSlot {
    url: String,
    inflight: AtomicUsize,
}

/// The serves of this miner.
#[derive(Debug)]
pub struct Pool {
    slots: Vec<ServeSlot>,
    pick: Mutex<()>,
}

/// A serve taken for one request; released when dropped (always, on every exit path).
pub struct SlotGuard<'a> {
    slot: &'a ServeSlot,
}

impl SlotGuard<'_> {
    /// The serve's base URL.
    pub fn url(&self) -> &str {
        &self.slot.url
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.slot.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Pool {
    /// A pool over `urls` (base URLs, no trailing path).
    pub fn new(urls: &[String]) -> Self {
        Self {
            slots: urls
                .iter()
                .map(|u| ServeSlot {
                    url: u.clone(),
                    inflight: AtomicUsize::new(0),
                })
                .collect(),
            pick: Mutex::new(()),
        }
    }

    /// Every serve's base URL, in configuration order.
    pub fn urls(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.url.clone()).collect()
    }

    /// Least-in-flight serve (§3.3); the guard releases it. `None` for an empty pool.
    pub fn pick(&self) -> Option<SlotGuard<'_>> {
        let _g = self.pick.lock().unwrap_or_else(|p| p.into_inner());
        let slot = self
            .slots
            .iter()
            .min_by_key(|s| s.inflight.load(Ordering::SeqCst))?;
        slot.inflight.fetch_add(1, Ordering::SeqCst);
        Some(SlotGuard { slot })
    }
}
