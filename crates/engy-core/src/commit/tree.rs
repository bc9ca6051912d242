//! Hash primitives of the `engy-commit/v1` scheme: domain-separated SHA-256 leaves and
//! nodes, the RFC 6962 Merkle tree hash (MTH) and its inclusion proofs (RFC 9162 §2.1.3).
//!
//! * leaf: `SHA-256(0x00 || payload)`; node: `SHA-256(0x01 || left || right)`.
//! * `MTH([])` = `SHA-256("")`, `MTH([d])` = `d` (the input is already a hash),
//!   `MTH(D[0..n])` = `node(MTH(D[0..k]), MTH(D[k..n]))` with `k` the largest power of two
//!   `< n`. Equivalently: build level by level, pairing left to right; a lone last node
//!   is carried up unchanged (never duplicated, never rehashed).
use sha2::{Digest as _, Sha256};

/// A SHA-256 digest (32 bytes).
pub type Digest = [u8; 32];

/// Prefix byte of a leaf hash (RFC 6962 §2.1).
pub const LEAF_PREFIX: u8 = 0x00;
/// Prefix byte of an interior node hash (RFC 6962 §2.1).
pub const NODE_PREFIX: u8 = 0x01;

/// `SHA-256("")`: the root of an empty list (a unit with no tensors, e.g. no shared expert).
pub fn empty_root() -> Digest {
    Sha256::digest([]).into()
}

/// `SHA-256(0x01 || left || right)`.
pub fn node(left: &Digest, right: &Digest) -> Digest {
    let mut h = Sha256::new();
    h.update([NODE_PREFIX]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// Appends `u64le(len(bytes)) || bytes` (a length-prefixed field) to a hasher.
pub(crate) fn update_lp(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Largest power of two strictly less than `n` (`n >= 2`).
fn split_point(n: usize) -> usize {
    let mut k = 1usize;
    while k.saturating_mul(2) < n {
        k *= 2;
    }
    k
}

/// The Merkle tree hash of a list of digests (RFC 6962 §2.1 over already-hashed leaves).
pub fn mth(items: &[Digest]) -> Digest {
    match items {
        [] => empty_root(),
        [one] => *one,
        _ => {
            let k = split_point(items.len());
            let (l, r) = items.split_at(k);
            node(&mth(l), &mth(r))
        }
    }
}

/// The audit path (siblings, bottom-up) of `items[index]` (RFC 9162 §2.1.3.1 PATH).
/// Returns `None` when `index >= items.len()`.
pub fn inclusion_path(items: &[Digest], index: usize) -> Option<Vec<Digest>> {
    if index >= items.len() {
        return None;
    }
    let mut path = Vec::new();
    path_rec(items, index, &mut path);
    Some(path)
}

fn path_rec(items: &[Digest], m: usize, out: &mut Vec<Digest>) {
    if items.len() <= 1 {
        return;
    }
    let k = split_point(items.len());
    let (l, r) = items.split_at(k);
    if m < k {
        path_rec(l, m, out);
        out.push(mth(r));
    } else {
        path_rec(r, m - k, out);
        out.push(mth(l));
    }
}

/// Recomputes the root from a leaf digest, its index, the tree size and the audit path
/// (RFC 9162 §2.1.3.2). Returns `None` when the path length does not fit `index`/`size`.
pub fn root_from_path(leaf: &Digest, index: u64, size: u64, path: &[Digest]) -> Option<Digest> {
    if index >= size {
        return None;
    }
    let mut fn_ = index;
    let mut sn = size - 1;
    let mut r = *leaf;
    for p in path {
        if sn == 0 {
            return None;
        }
        if fn_ & 1 == 1 || fn_ == sn {
            r = node(p, &r);
            if fn_ & 1 == 0 {
                while fn_ & 1 == 0 && fn_ != 0 {
                    fn_ >>= 1;
                    sn >>= 1;
                }
            }
        } else {
            r = node(&r, p);
        }
        fn_ >>= 1;
        sn >>= 1;
    }
    if sn != 0 {
        return None;
    }
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(n: usize) -> Vec<Digest> {
        (0..n)
            .map(|i| {
                let mut h = Sha256::new();
                h.update([LEAF_PREFIX]);
                h.update((i as u64).to_le_bytes());
                h.finalize().into()
            })
            .collect()
    }

    /// Level-by-level construction with the lone last node carried up.
    fn levelwise(items: &[Digest]) -> Digest {
        if items.is_empty() {
            return empty_root();
        }
        let mut level = items.to_vec();
        while level.len() > 1 {
            level = level
                .chunks(2)
                .map(|c| {
                    if c.len() == 2 {
                        node(&c[0], &c[1])
                    } else {
                        c[0]
                    }
                })
                .collect();
        }
        level[0]
    }

    #[test]
    fn mth_equals_levelwise_carry_up() {
        for n in 0..40 {
            let d = leaves(n);
            assert_eq!(mth(&d), levelwise(&d), "n={n}");
        }
    }

    #[test]
    fn every_path_verifies_and_wrong_index_fails() {
        for n in 1..35 {
            let d = leaves(n);
            let root = mth(&d);
            for i in 0..n {
                let p = inclusion_path(&d, i).unwrap();
                assert_eq!(root_from_path(&d[i], i as u64, n as u64, &p), Some(root));
                if n > 1 {
                    let j = (i + 1) % n;
                    assert_ne!(root_from_path(&d[i], j as u64, n as u64, &p), Some(root));
                }
            }
            assert!(inclusion_path(&d, n).is_none());
        }
    }
}
