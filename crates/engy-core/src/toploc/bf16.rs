//! float32 ⇄ bfloat16 bit conversions as torch performs them.

/// The bfloat16 bit pattern torch produces for any float32 NaN (`c10::BFloat16`'s
/// `round_to_nearest_even`: a positive quiet NaN).
const BF16_CANONICAL_NAN: u16 = 0x7FC0;

/// Converts one float32 to bfloat16 bits, rounding to nearest, ties to even, as torch's
/// `c10::BFloat16(float)` does (`c10/util/BFloat16.h`, `round_to_nearest_even`).
///
/// * Finite values round to nearest even; values past the largest bfloat16 round to ±inf.
/// * ±inf stay ±inf, ±0 stay ±0, subnormals round like any other value (no flush to zero).
/// * Every NaN becomes `0x7FC0` (a NaN, sign and payload dropped), like torch's scalar path.
///   torch's vectorised CPU kernels may instead give `0xFFFF` or keep the sign; NaN rows
///   come only from a broken serve, and every choice still ranks first in top-k.
///
/// Used by the miner on the float32 hidden rows the serve returns (PROTOCOL.md §3 item 8).
#[inline]
pub fn f32_to_bf16_bits(value: f32) -> u16 {
    if value.is_nan() {
        return BF16_CANONICAL_NAN;
    }
    let bits = value.to_bits();
    let rounding_bias = ((bits >> 16) & 1) + 0x7FFF;
    // bits + bias cannot overflow u32 for non-NaN input: the largest non-NaN pattern is
    // 0xFF80_0000 (-inf), and 0xFF80_0000 + 0x8000 < 2^32.
    (bits.wrapping_add(rounding_bias) >> 16) as u16
}

/// Converts a slice of float32 values to bfloat16 bits with [`f32_to_bf16_bits`]
/// (one output per input, same order).
pub fn f32_to_bf16_bits_slice(values: &[f32]) -> Vec<u16> {
    values.iter().map(|&v| f32_to_bf16_bits(v)).collect()
}

/// Widens bfloat16 bits to the exactly equal float32 (bits shifted into the high half).
#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_cases() {
        assert_eq!(f32_to_bf16_bits(1.0), 0x3F80);
        assert_eq!(f32_to_bf16_bits(-1.0), 0xBF80);
        assert_eq!(f32_to_bf16_bits(-0.0), 0x8000);
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xFF80);
        assert_eq!(f32_to_bf16_bits(f32::NAN), 0x7FC0);
        assert_eq!(f32_to_bf16_bits(-f32::NAN), 0x7FC0);
        // Exactly halfway between 0x3F80 and 0x3F81: ties to even (0x3F80).
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F80_8000)), 0x3F80);
        // Halfway between 0x3F81 and 0x3F82: ties to even (0x3F82).
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F81_8000)), 0x3F82);
        // Just above halfway rounds up.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3F80_8001)), 0x3F81);
        // Largest float32 rounds to +inf.
        assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7F80);
        // Smallest subnormal float32 rounds to zero; a bf16-representable subnormal is kept.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(1)), 0x0000);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x0001_0000)), 0x0001);
        assert_eq!(bf16_bits_to_f32(0x3F80), 1.0);
    }

    #[test]
    fn matches_half_crate_on_non_nan() {
        // `half` implements the same round-to-nearest-even; compare on a sweep of patterns.
        let mut x: u32 = 0x1234_5678;
        for _ in 0..200_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let v = f32::from_bits(x);
            if v.is_nan() {
                continue;
            }
            assert_eq!(
                f32_to_bf16_bits(v),
                half::bf16::from_f32(v).to_bits(),
                "{x:#x}"
            );
        }
    }
}
