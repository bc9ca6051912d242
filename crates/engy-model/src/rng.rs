//! A small, portable, seedable random source for the generated checkpoint.
//!
//! The devnet model must be byte-identical for a given seed on every machine and with every
//! version of our dependencies, so the generator does not use `rand`'s `StdRng` (whose
//! algorithm may change between `rand` releases). Instead each tensor gets its own SplitMix64
//! stream seeded from `sha256(seed ‖ label)`; SplitMix64 is Steele, Lea & Flood (2014), the
//! seeding generator of `xoshiro` and Java's `SplittableRandom`.
use sha2::{Digest, Sha256};

/// SplitMix64 state with a Box–Muller normal sampler.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A stream for `label` under `seed`: the state is the first 8 bytes (little endian) of
    /// `sha256(seed as 8 LE bytes ‖ label)`, so streams for different labels are independent
    /// and the order in which tensors are generated does not matter.
    pub(crate) fn for_label(seed: u64, label: &str) -> Self {
        let mut h = Sha256::new();
        h.update(seed.to_le_bytes());
        h.update(label.as_bytes());
        let d = h.finalize();
        let mut b = [0u8; 8];
        b.copy_from_slice(&d[..8]);
        Self {
            state: u64::from_le_bytes(b),
        }
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[-1, 1)` as f32 (24 random bits), for synthetic weights and test inputs.
    pub(crate) fn signed_unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// Uniform integer in `0..n` (`n > 0`; returns 0 when `n == 0`).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        (self.uniform() * n as f64) as usize % n
    }

    /// A standard normal sample (Box–Muller, one of the pair).
    pub(crate) fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_reproducible_and_label_dependent() {
        let a: Vec<u64> = {
            let mut r = SplitMix64::for_label(7, "x");
            (0..4).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = SplitMix64::for_label(7, "x");
            (0..4).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = SplitMix64::for_label(7, "y");
            (0..4).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn normal_has_unit_variance() {
        let mut r = SplitMix64::for_label(1, "n");
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03, "mean {mean}");
        assert!((var - 1.0).abs() < 0.05, "var {var}");
    }
}
