//! The retention store of committed cells (docs/PROTOCOL.md §10, docs/MINER.md "Cells"): for
//! every request whose commitment carried `cells`, its [`CellTree`] and the cells' canonical
//! bytes, by `request_id`, until a challenge (`open_cells`) may no longer come.
//!
//! Bounded twice: an entry older than `max_age` (`ENGY_CELLS_RETAIN_S`) is evicted
//! (`reason="age"`), and while the entries' bytes exceed `max_bytes` (`ENGY_CELLS_RETAIN_MB`)
//! the oldest is evicted (`reason="size"`); oldest first in both cases. A request larger than
//! the whole budget is refused at [`CellStore::insert`], so its commitment goes out without
//! cells (a root the miner could not open is never committed).
//!
//! [`CellStore::open`] answers `open_cells`: the cells [`engy_core::cells::select`] draws for
//! the gateway's seed, each with its inclusion path, or `cells_error` with the reason.
//! Metrics: `engy_miner_cells_retained_{requests,bytes}`, `engy_miner_cells_evictions_total
//! {reason}`, `engy_miner_cells_openings_total{outcome}`.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use engy_core::cells::{select, Cell, CellTree};
use engy_core::commit::spec::Hex;
use engy_core::wire::{
    short_error, CellChallenge, CellOpening, CellsError, CellsOpened, CellsRefusal, MinerFrame,
};
use serde_json::Value;

use crate::metrics::Metrics;

/// The store's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest a request's cells are kept (`ENGY_CELLS_RETAIN_S`).
    pub max_age: Duration,
    /// Most bytes kept over all requests (`ENGY_CELLS_RETAIN_MB` × 2^20).
    pub max_bytes: u64,
}

/// Why [`CellStore::insert`] kept nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RetainError {
    /// The request alone is larger than the whole budget.
    #[error("the request's cells take {size} bytes, more than the whole retention budget of {max} bytes (ENGY_CELLS_RETAIN_MB)")]
    TooLarge {
        /// Bytes the request would take.
        size: u64,
        /// The budget.
        max: u64,
    },
    /// The cell bytes do not fit the tree's shape (`n_cells` cells of one encoded length).
    #[error("{0}")]
    Inconsistent(String),
}

/// One request's retained cells.
struct Entry {
    seq: u64,
    at: Instant,
    size: u64,
    tree: Arc<CellTree>,
    bytes: Arc<Vec<u8>>,
    cell_len: usize,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Entry>,
    /// `(seq, key)` in insertion order; a key re-inserted leaves a stale pair, skipped.
    order: VecDeque<(u64, String)>,
    bytes: u64,
    next_seq: u64,
}

/// Committed cells by `request_id`, bounded by age and size (module docs).
pub struct CellStore {
    limits: Limits,
    inner: Mutex<Inner>,
    metrics: Arc<Metrics>,
}

/// The store key of a `request_id`: its JSON text (`"r-1"` and `1` are different requests,
/// as the gateway sees them).
fn key(request_id: &Value) -> String {
    request_id.to_string()
}

/// Bytes an entry is counted as: the cell bytes plus the tree (two digests per leaf).
fn entry_size(tree: &CellTree, bytes: &[u8]) -> u64 {
    (bytes.len() as u64).saturating_add((tree.leaves().len() as u64).saturating_mul(64))
}

impl CellStore {
    /// An empty store; its gauges read 0.
    pub fn new(limits: Limits, metrics: Arc<Metrics>) -> Self {
        metrics.cells_retained(0, 0);
        Self {
            limits,
            inner: Mutex::new(Inner::default()),
            metrics,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keep `request_id`'s cells: `tree` and `bytes` (the cells back to back in leaf order,
    /// as the spool's `cells.bin`). Evicts by age, then the oldest until the budget holds.
    /// A `request_id` already held is replaced.
    ///
    /// # Errors
    /// [`RetainError`]; nothing is kept and nothing is evicted.
    pub fn insert(
        &self,
        request_id: &Value,
        tree: CellTree,
        bytes: Vec<u8>,
    ) -> Result<(), RetainError> {
        self.insert_at(Instant::now(), request_id, tree, bytes)
    }

    /// [`CellStore::insert`] at the clock reading `now`.
    ///
    /// # Errors
    /// As [`CellStore::insert`].
    pub fn insert_at(
        &self,
        now: Instant,
        request_id: &Value,
        tree: CellTree,
        bytes: Vec<u8>,
    ) -> Result<(), RetainError> {
        let n_cells = tree.leaves().len();
        let cell_len = bytes.len().checked_div(n_cells).unwrap_or(0);
        if n_cells == 0 || cell_len * n_cells != bytes.len() {
            return Err(RetainError::Inconsistent(format!(
                "{} bytes are not {n_cells} cells of one length",
                bytes.len()
            )));
        }
        let size = entry_size(&tree, &bytes);
        if size > self.limits.max_bytes {
            return Err(RetainError::TooLarge {
                size,
                max: self.limits.max_bytes,
            });
        }
        let k = key(request_id);
        let mut g = self.lock();
        if let Some(old) = g.by_id.remove(&k) {
            g.bytes -= old.size;
        }
        self.evict_aged(&mut g, now);
        while g.bytes + size > self.limits.max_bytes {
            if !self.evict_oldest(&mut g, "size") {
                break;
            }
        }
        let seq = g.next_seq;
        g.next_seq += 1;
        g.order.push_back((seq, k.clone()));
        g.bytes += size;
        g.by_id.insert(
            k,
            Entry {
                seq,
                at: now,
                size,
                tree: Arc::new(tree),
                bytes: Arc::new(bytes),
                cell_len,
            },
        );
        self.metrics.cells_retained(g.by_id.len(), g.bytes);
        Ok(())
    }

    /// Evict what is older than `max_age` (a periodic sweep keeps the gauges true between
    /// requests).
    pub fn sweep(&self) {
        self.sweep_at(Instant::now());
    }

    /// [`CellStore::sweep`] at `now`.
    pub fn sweep_at(&self, now: Instant) {
        let mut g = self.lock();
        self.evict_aged(&mut g, now);
        self.metrics.cells_retained(g.by_id.len(), g.bytes);
    }

    /// Whether `request_id`'s cells are held (after evicting by age at `now`).
    pub fn contains_at(&self, now: Instant, request_id: &Value) -> bool {
        let mut g = self.lock();
        self.evict_aged(&mut g, now);
        self.metrics.cells_retained(g.by_id.len(), g.bytes);
        g.by_id.contains_key(&key(request_id))
    }

    /// `(requests, bytes)` held.
    pub fn usage(&self) -> (usize, u64) {
        let g = self.lock();
        (g.by_id.len(), g.bytes)
    }

    fn evict_aged(&self, g: &mut Inner, now: Instant) {
        while let Some((seq, k)) = g.order.front().cloned() {
            match g.by_id.get(&k) {
                Some(e) if e.seq == seq => {
                    if now.saturating_duration_since(e.at) < self.limits.max_age {
                        return;
                    }
                    self.evict_oldest(g, "age");
                }
                _ => {
                    g.order.pop_front();
                }
            }
        }
    }

    /// Evict the oldest live entry; false when there is none.
    fn evict_oldest(&self, g: &mut Inner, reason: &'static str) -> bool {
        while let Some((seq, k)) = g.order.pop_front() {
            if g.by_id.get(&k).is_some_and(|e| e.seq == seq) {
                if let Some(e) = g.by_id.remove(&k) {
                    g.bytes -= e.size;
                    self.metrics.cells_evicted(reason);
                    tracing::debug!(request_id = %k, reason, bytes = e.size, "cells evicted from the retention store");
                }
                return true;
            }
        }
        false
    }

    /// Answer `open_cells {request_id, seed, n}`: a `cells` frame with the challenged cells
    /// (in the order [`select`] draws them) and their paths, or `cells_error` saying why
    /// not. Counted in `engy_miner_cells_openings_total{outcome}`.
    pub fn open(
        &self,
        request_id: &Value,
        challenge: &Result<CellChallenge, String>,
    ) -> MinerFrame {
        self.open_at(Instant::now(), request_id, challenge)
    }

    /// [`CellStore::open`] at `now`.
    pub fn open_at(
        &self,
        now: Instant,
        request_id: &Value,
        challenge: &Result<CellChallenge, String>,
    ) -> MinerFrame {
        let refuse = |reason: CellsRefusal, error: String| {
            self.metrics.cells_opening(match reason {
                CellsRefusal::UnknownRequest => "unknown_request",
                CellsRefusal::BadChallenge => "bad_challenge",
            });
            MinerFrame::CellsError(CellsError {
                request_id: request_id.clone(),
                reason,
                error: short_error(&error),
            })
        };
        let c = match challenge {
            Ok(c) => *c,
            Err(e) => return refuse(CellsRefusal::BadChallenge, e.clone()),
        };
        let held = {
            let mut g = self.lock();
            self.evict_aged(&mut g, now);
            self.metrics.cells_retained(g.by_id.len(), g.bytes);
            g.by_id
                .get(&key(request_id))
                .map(|e| (Arc::clone(&e.tree), Arc::clone(&e.bytes), e.cell_len))
        };
        let Some((tree, bytes, cell_len)) = held else {
            return refuse(
                CellsRefusal::UnknownRequest,
                format!("no cells held for request_id {request_id}: never committed, evicted (ENGY_CELLS_RETAIN_S / ENGY_CELLS_RETAIN_MB), or cells are off"),
            );
        };
        let root = tree.root();
        let n_cells = tree.leaves().len() as u64;
        let indices = match select(&c.seed, &root, n_cells, c.n) {
            Ok(i) => i,
            Err(e) => return refuse(CellsRefusal::BadChallenge, e.to_string()),
        };
        let mut openings = Vec::with_capacity(indices.len());
        for index in indices {
            let at = index as usize * cell_len;
            let (Some(cell), Ok(path)) = (bytes.get(at..at + cell_len), tree.open(index)) else {
                return refuse(
                    CellsRefusal::UnknownRequest,
                    format!("cell {index} of request_id {request_id} is not held"),
                );
            };
            debug_assert!(Cell::decode(cell).is_ok());
            openings.push(CellOpening {
                index,
                cell: base64::engine::general_purpose::STANDARD.encode(cell),
                path: path.siblings,
            });
        }
        self.metrics.cells_opening("ok");
        MinerFrame::Cells(CellsOpened {
            request_id: request_id.clone(),
            root: Hex(root),
            openings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engy_core::cells::{verify_opening, CellPath, CellShape, LogitsDtype, RouterLogits};
    use half::bf16;
    use serde_json::json;

    /// A request of `positions` positions × one layer of 4-wide cells (60 bytes a cell).
    fn request(positions: u32, salt: f32) -> (CellTree, Vec<u8>) {
        let shape = CellShape::new(
            positions,
            vec![1],
            4,
            4,
            1,
            LogitsDtype::Bf16,
            [salt as u8; 32],
        )
        .unwrap();
        let cells: Vec<Cell> = (0..positions)
            .map(|p| {
                let v = |k: f32| vec![bf16::from_f32(p as f32 + k + salt); 4];
                Cell::new(p, 1, v(0.0), RouterLogits::Bf16(v(1.0)), vec![2], v(2.0)).unwrap()
            })
            .collect();
        let bytes: Vec<u8> = cells.iter().flat_map(Cell::encode).collect();
        (CellTree::from_cells(shape, &cells).unwrap(), bytes)
    }

    /// Bytes one request of `positions` positions is counted as.
    fn size(positions: u32) -> u64 {
        let (t, b) = request(positions, 0.0);
        entry_size(&t, &b)
    }

    fn store(max_age_s: u64, max_bytes: u64) -> (CellStore, Arc<Metrics>) {
        let m = Arc::new(Metrics::new());
        let limits = Limits {
            max_age: Duration::from_secs(max_age_s),
            max_bytes,
        };
        (CellStore::new(limits, Arc::clone(&m)), m)
    }

    fn challenge(n: u64) -> Result<CellChallenge, String> {
        Ok(CellChallenge { seed: [7; 32], n })
    }

    fn refusal(f: &MinerFrame) -> Option<CellsRefusal> {
        match f {
            MinerFrame::CellsError(e) => Some(e.reason),
            _ => None,
        }
    }

    #[test]
    fn entries_older_than_max_age_are_evicted_oldest_first() {
        let (s, m) = store(60, 1 << 20);
        let t0 = Instant::now();
        for (i, at) in [0u64, 30, 50].into_iter().enumerate() {
            let (t, b) = request(4, i as f32);
            s.insert_at(t0 + Duration::from_secs(at), &json!(i), t, b)
                .unwrap();
        }
        // At 61 s the first (inserted at 0) is over 60 s old; the others are not.
        let now = t0 + Duration::from_secs(61);
        assert!(!s.contains_at(now, &json!(0)));
        assert!(s.contains_at(now, &json!(1)));
        assert!(s.contains_at(now, &json!(2)));
        assert_eq!(s.usage(), (2, 2 * size(4)));
        assert_eq!(m.cells_evictions("age"), 1);
        assert_eq!(m.cells_evictions("size"), 0);
        let f = s.open_at(t0 + Duration::from_secs(91), &json!(1), &challenge(1));
        assert_eq!(refusal(&f), Some(CellsRefusal::UnknownRequest));
        assert_eq!(m.cells_evictions("age"), 2);
    }

    #[test]
    fn the_oldest_entries_make_room_when_the_size_budget_is_exceeded() {
        // Room for exactly two 4-position requests.
        let (s, m) = store(3600, 2 * size(4));
        let t0 = Instant::now();
        for i in 0..3u64 {
            let (t, b) = request(4, i as f32);
            s.insert_at(t0 + Duration::from_secs(i), &json!(i), t, b)
                .unwrap();
        }
        let now = t0 + Duration::from_secs(3);
        assert!(!s.contains_at(now, &json!(0)), "the oldest made room");
        assert!(s.contains_at(now, &json!(1)) && s.contains_at(now, &json!(2)));
        assert_eq!(s.usage(), (2, 2 * size(4)));
        assert_eq!(m.cells_evictions("size"), 1);
        // A request larger than the whole budget is refused and evicts nothing.
        let (t, b) = request(9, 0.0);
        assert!(matches!(
            s.insert_at(now, &json!("big"), t, b),
            Err(RetainError::TooLarge { .. })
        ));
        assert_eq!(s.usage(), (2, 2 * size(4)));
        // Re-inserting a held id replaces it without counting an eviction.
        let (t, b) = request(4, 9.0);
        s.insert_at(now, &json!(1), t, b).unwrap();
        assert_eq!(s.usage(), (2, 2 * size(4)));
        assert_eq!(m.cells_evictions("size"), 1);
        // The replaced entry is now the newest: the next insert evicts 2, not 1.
        let (t, b) = request(4, 3.0);
        s.insert_at(now, &json!(3), t, b).unwrap();
        assert!(!s.contains_at(now, &json!(2)));
        assert!(s.contains_at(now, &json!(1)));
    }

    #[test]
    fn openings_verify_against_the_root_and_bad_challenges_are_refused() {
        let (s, m) = store(3600, 1 << 20);
        let (t, b) = request(5, 0.0);
        let (root, shape) = (t.root(), t.shape().clone());
        s.insert(&json!("r"), t, b).unwrap();
        let MinerFrame::Cells(c) = s.open(&json!("r"), &challenge(3)) else {
            panic!("no cells")
        };
        assert_eq!(c.root.0, root);
        let want = select(&[7; 32], &root, 5, 3).unwrap();
        assert_eq!(c.openings.iter().map(|o| o.index).collect::<Vec<_>>(), want);
        for o in &c.openings {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(&o.cell)
                .unwrap();
            let path = CellPath {
                index: o.index,
                siblings: o.path.clone(),
            };
            verify_opening(&shape, &root, &bytes, &path).unwrap();
        }
        let too_many = s.open(&json!("r"), &challenge(6));
        assert_eq!(refusal(&too_many), Some(CellsRefusal::BadChallenge));
        let bad_seed = s.open(&json!("r"), &Err("seed must be 64 hex characters".into()));
        assert_eq!(refusal(&bad_seed), Some(CellsRefusal::BadChallenge));
        let unknown = s.open(&json!("other"), &challenge(1));
        assert_eq!(refusal(&unknown), Some(CellsRefusal::UnknownRequest));
        assert_eq!(
            (
                m.cells_openings("ok"),
                m.cells_openings("bad_challenge"),
                m.cells_openings("unknown_request")
            ),
            (1, 2, 1)
        );
    }
}
