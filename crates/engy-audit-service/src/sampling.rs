//! Which requests are audited (docs/PROTOCOL.md §11.2).
//!
//! A miner must not be able to tell, when it answers a request, whether that request will
//! be audited: if it could, it would serve the audited ones honestly. So nothing about the
//! decision exists before the miner's commitment does:
//!
//! 1. the intake stores each report with the chain head it saw when the report arrived
//!    ([`Beacon::head`]);
//! 2. once the next block exists, its hash is the request's `beacon`
//!    ([`Beacon::hash_of`]`(head + 1)`), and `seed = production_seed(beacon,
//!    commitment_digest)` (specs/CELLS.md §5; `engy_core::cells::production_seed`);
//! 3. the request is sampled when `u64le(seed[0..8]) / 2^64 < rate` ([`sampled_by_rate`]);
//! 4. the floor: when a window has ended, every (model, miner) of that window with fewer than
//!    K sampled requests has its not-yet-sampled requests of lowest seed sampled until K are
//!    ([`crate::store::Store::top_up_floor`]). Taking "the first K of the window" instead
//!    would let a miner serve its first K requests honestly and cheat on the rest.
//!
//! The same seed is the cell challenge's seed (the gateway's `open_cells.seed`).
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::store::{now_ms, Store};

/// A boxed future (the beacon trait is object-safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why the beacon could not be read.
#[derive(Debug, thiserror::Error)]
#[error("beacon: {0}")]
pub struct BeaconError(pub String);

/// The source of the sampling beacon: block numbers and their hashes.
pub trait Beacon: Send + Sync {
    /// The number of the newest block now.
    fn head(&self) -> BoxFuture<'_, Result<u64, BeaconError>>;
    /// The hash of block `number`, `None` while it does not exist yet.
    fn hash_of(&self, number: u64) -> BoxFuture<'_, Result<Option<[u8; 32]>, BeaconError>>;
}

/// A beacon whose every block hash is one fixed value (tests and the devnet: a miner who
/// knows the value predicts every decision).
#[derive(Debug, Clone, Copy)]
pub struct FixedBeacon(pub [u8; 32]);

impl Beacon for FixedBeacon {
    fn head(&self) -> BoxFuture<'_, Result<u64, BeaconError>> {
        Box::pin(async { Ok(0) })
    }
    fn hash_of(&self, _number: u64) -> BoxFuture<'_, Result<Option<[u8; 32]>, BeaconError>> {
        let b = self.0;
        Box::pin(async move { Ok(Some(b)) })
    }
}

/// Whether `seed` samples its request at `rate`: `u64le(seed[0..8]) / 2^64 < rate`, and
/// always at rate 1.
pub fn sampled_by_rate(seed: &[u8; 32], rate: f64) -> bool {
    let mut b = [0u8; 8];
    b.copy_from_slice(&seed[..8]);
    let u = u64::from_le_bytes(b) as f64 / 18_446_744_073_709_551_616.0;
    // u rounds to 1.0 for the largest values: at rate 1 every request is sampled.
    rate >= 1.0 || u < rate
}

/// The start (ms) of the window holding `t_ms`.
pub fn window_start(t_ms: i64, window_ms: i64) -> i64 {
    t_ms - t_ms.rem_euclid(window_ms.max(1))
}

/// What the sampler needs.
pub struct Sampler {
    /// The database.
    pub store: Store,
    /// The beacon.
    pub beacon: Arc<dyn Beacon>,
    /// Sampling rate.
    pub rate: f64,
    /// The floor K.
    pub floor: u64,
    /// Window length, ms.
    pub window_ms: i64,
}

/// How long after a window's end its floor is topped up (reports still being stored).
const FLOOR_GRACE_MS: i64 = 5_000;

impl Sampler {
    /// One pass: decides every undecided request whose beacon block exists, then tops up
    /// the floor of ended windows. Returns the requests newly sampled.
    ///
    /// # Errors
    /// A database or beacon error (the pass is retried on the next tick).
    pub async fn tick(&self) -> anyhow::Result<u64> {
        let mut sampled = 0;
        loop {
            let batch = self.store.undecided(256).await?;
            let n = batch.len();
            let mut decided = 0;
            for r in batch {
                let next = u64::try_from(r.head_block).unwrap_or(0).saturating_add(1);
                let Some(beacon) = self.beacon.hash_of(next).await? else {
                    continue;
                };
                let Ok(digest) = engy_core::commit::parse_digest(&r.digest) else {
                    continue;
                };
                let seed = engy_core::cells::production_seed(&beacon, &digest);
                let take = sampled_by_rate(&seed, self.rate);
                self.store
                    .decide(
                        &r.digest,
                        &r.model,
                        &hex::encode(beacon),
                        &hex::encode(seed),
                        take.then_some("rate"),
                    )
                    .await?;
                decided += 1;
                sampled += u64::from(take);
            }
            if n < 256 || decided == 0 {
                break;
            }
        }
        let now = now_ms();
        // windows whose end (start + length) is at least the grace before now
        let ended_before = now - FLOOR_GRACE_MS - self.window_ms + 1;
        let since = ended_before - 4 * self.window_ms;
        let k = i64::try_from(self.floor).unwrap_or(i64::MAX);
        if k > 0 {
            sampled += self.store.top_up_floor(since, ended_before, k).await?;
        }
        Ok(sampled)
    }

    /// Runs [`Sampler::tick`] every `every` until `stop` fires; errors are logged and retried.
    pub async fn run(self, every: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            match self.tick().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(sampled = n, "sampling decided"),
                Err(e) => tracing::warn!(
                    error = %engy_telemetry::cli::error_line(e.as_ref()),
                    "sampling pass failed; retrying"
                ),
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_splits_seeds_by_their_first_eight_bytes() {
        let mut seed = [0u8; 32];
        assert!(sampled_by_rate(&seed, 0.01));
        assert!(!sampled_by_rate(&seed, 0.0));
        seed[7] = 0x80; // u = 0.5
        assert!(!sampled_by_rate(&seed, 0.5));
        assert!(sampled_by_rate(&seed, 0.5000001));
        assert!(sampled_by_rate(&[0xff; 32], 1.0));
    }

    #[test]
    fn windows_start_on_multiples_of_their_length() {
        assert_eq!(window_start(12_345, 1_000), 12_000);
        assert_eq!(window_start(12_000, 1_000), 12_000);
    }
}
