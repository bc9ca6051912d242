//! The challenge (specs/CELLS.md §5): a 32-byte seed that exists only after the
//! commitment, mixed with `cells_root`, selects `n` distinct cells.
//!
//! Stream: block `i` (`i = 0, 1, …`) is `SHA-256(lp(CHALLENGE_TAG) || seed || cells_root ||
//! u64le(i))`; each block gives four candidates, its bytes `8j..8j+8` read as `u64le`
//! (`j = 0..4`). A candidate `v` is used only when `v < 2^64 − (2^64 mod n_cells)` (rejection
//! sampling: every index is equally likely, no modulo bias); its index is `v mod n_cells`,
//! skipped when already chosen. The first `n` distinct indices, in the order drawn, are
//! the challenge.
//!
//! Where the seed comes from ([`production_seed`]): in production a beacon that did not
//! exist when the miner committed (a later block hash, a drand round's randomness) mixed
//! with the digest of the commitment it challenges, `SHA-256(lp(SEED_TAG) || beacon ||
//! commitment_digest)`; in the devnet the auditor draws 32 random bytes.
use sha2::{Digest as _, Sha256};

use super::{CellError, CHALLENGE_TAG, SEED_TAG};
use crate::commit::tree::{self as mtree, Digest};

/// Cells an auditor challenges per request unless its policy says more (specs/CELLS.md §5
/// "How many cells").
pub const DEFAULT_CHALLENGE_CELLS: u64 = 32;
/// Fewest cells an auditor's policy may challenge per request (fewer only when the request
/// has fewer cells): a cheat that shows in a fraction `f` of cells escapes `n` challenged
/// cells with probability `(1 − f)^n`, 0.034 for `f` = 0.1 at 32.
pub const MIN_CHALLENGE_CELLS: u64 = 32;
/// Most cells one challenge may ask for (the wire's `open_cells` limit,
/// [`crate::wire::MAX_OPEN_CELLS`]).
pub const MAX_CHALLENGE_CELLS: u64 = crate::wire::MAX_OPEN_CELLS;

/// The `n` an auditor challenges in a request of `n_cells` cells when its policy asks for
/// `policy_n` (at least [`MIN_CHALLENGE_CELLS`], checked by the caller): `min(policy_n,
/// n_cells, MAX_CHALLENGE_CELLS)`, at least 1 (a shape has at least one cell).
pub fn challenge_n(policy_n: u64, n_cells: u64) -> u64 {
    policy_n.min(n_cells).clamp(1, MAX_CHALLENGE_CELLS)
}

/// The index a candidate `v` gives among `n_cells >= 1`, or `None` when rejection
/// sampling drops it (`v >= 2^64 − (2^64 mod n_cells)`).
fn accept(v: u64, n_cells: u64) -> Option<u64> {
    let limit = (1u128 << 64) - ((1u128 << 64) % u128::from(n_cells));
    (u128::from(v) < limit).then(|| v % n_cells)
}

/// The `n` distinct leaf indices (each `< n_cells`) that `seed` selects in the tree of
/// `cells_root`, in the order drawn. Deterministic: the same inputs give the same list.
/// Map an index to (position, layer) with [`super::CellShape::cell_at`].
///
/// Errors: [`CellError::TooMany`] when `n > n_cells`.
pub fn select(
    seed: &[u8; 32],
    cells_root: &Digest,
    n_cells: u64,
    n: u64,
) -> Result<Vec<u64>, CellError> {
    if n > n_cells {
        return Err(CellError::TooMany { n, n_cells });
    }
    let cap = usize::try_from(n).unwrap_or(usize::MAX).min(1 << 16);
    let mut chosen: Vec<u64> = Vec::with_capacity(cap);
    let mut seen = std::collections::HashSet::with_capacity(cap);
    let mut counter = 0u64;
    while (chosen.len() as u64) < n {
        let mut h = Sha256::new();
        mtree::update_lp(&mut h, CHALLENGE_TAG.as_bytes());
        h.update(seed);
        h.update(cells_root);
        h.update(counter.to_le_bytes());
        let block: [u8; 32] = h.finalize().into();
        counter += 1;
        for c in block.chunks_exact(8) {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            let Some(index) = accept(u64::from_le_bytes(b), n_cells) else {
                continue;
            };
            if seen.insert(index) {
                chosen.push(index);
                if chosen.len() as u64 == n {
                    break;
                }
            }
        }
    }
    Ok(chosen)
}

/// The commitment digest the production seed mixes in (specs/CELLS.md §5): SHA-256 of the
/// `commitment` JSON value's bytes exactly as the miner's `response` frame carried them.
pub fn commitment_digest(commitment_json: &[u8]) -> [u8; 32] {
    Sha256::digest(commitment_json).into()
}

/// The production challenge seed (specs/CELLS.md §5): `SHA-256(lp(SEED_TAG) || beacon ||
/// commitment_digest)`, `SEED_TAG = "engy-cells/v2/seed"`.
///
/// * `beacon`: 32 bytes that exist only after the commitment: the hash of a block produced
///   after the miner's `response` (or a drand round's randomness), chosen by the rule of
///   the party that challenges, never by the miner.
/// * `commitment_digest`: SHA-256 of the `commitment` value exactly as the miner's
///   `response` frame carried it (its UTF-8 bytes), so one beacon gives every request its
///   own seed.
///
/// The gateway sends the result as `open_cells.seed`; the miner answers with
/// [`select`]`(seed, cells_root, n_cells, n)`.
pub fn production_seed(beacon: &[u8; 32], commitment_digest: &[u8; 32]) -> [u8; 32] {
    let mut h = Sha256::new();
    mtree::update_lp(&mut h, SEED_TAG.as_bytes());
    h.update(beacon);
    h.update(commitment_digest);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::{accept, production_seed};

    #[test]
    fn production_seed_is_the_specified_hash() {
        // Computed with Python's hashlib: sha256(u64le(18) + b"engy-cells/v2/seed" +
        // bytes(range(32)) + b"\xab" * 32).
        let beacon: [u8; 32] = std::array::from_fn(|i| i as u8);
        assert_eq!(
            hex::encode(production_seed(&beacon, &[0xab; 32])),
            "6381e10fb54897419ea1efb1219300ae5d1610adeb3001181663e313ce1c67ba"
        );
        assert_ne!(
            production_seed(&beacon, &[0xab; 32]),
            production_seed(&beacon, &[0xac; 32])
        );
    }

    #[test]
    fn rejection_drops_exactly_the_biased_tail() {
        // 2^64 mod 3 = 1: only u64::MAX is dropped; 2^64 mod 2^k = 0: nothing is.
        assert_eq!(accept(u64::MAX, 3), None);
        assert_eq!(accept(u64::MAX - 1, 3), Some((u64::MAX - 1) % 3));
        assert_eq!(accept(u64::MAX, 1 << 10), Some(1023));
        // 2^64 mod 10 = 6: the last six values are dropped.
        assert_eq!(accept(u64::MAX - 5, 10), None);
        assert_eq!(accept(u64::MAX - 6, 10), Some(9));
        assert_eq!(accept(0, 1), Some(0));
        assert_eq!(accept(u64::MAX, 1), Some(0));
    }
}
