//! JSON decimal text → bf16 bits, the hot path of hidden-state ingest (issue 7).
//!
//! A hidden row is `hidden_size` decimals as sglang's orjson prints Python floats: the
//! shortest round-trip text of a float64 that holds a bf16 value (`-0.1640625`,
//! `0.0439453125`, `1.52587890625e-5`). The reference reads each with Python's `json`
//! (→ float64, correctly rounded), numpy casts to float32 and torch to bfloat16, both
//! round-to-nearest-even (PROTOCOL.md §3.8). [`parse_bf16`] gives exactly that result, or
//! `None` when its fast path cannot decide, and the caller then uses an exact parser
//! (`fast-float2`) on the same text. So the fast path changes speed, never results.
//!
//! The fast path reads the digits eight at a time from one little-endian `u64` (SWAR:
//! one mask finds where the digits stop, three multiplications give their value) and
//! rounds with Clinger's exact case: a significand `m ≤ 2^53` and a power of ten
//! `10^|e|` with `|e| ≤ 22` are both exact float64 values, so one IEEE multiplication or
//! division gives the correctly rounded float64. Every bf16 value orjson prints (≤ 17
//! significant digits, most ≤ 10) lands here except the few whose text needs more than
//! 2^53 as significand; those, and anything that is not a plain JSON number (leading
//! zeros, `1.`, `1e`, more than 19 digits, huge exponents), return `None`.

use engy_core::toploc::f32_to_bf16_bits;

/// `10^k` for `k` in `0..=22`: the powers of ten that are exact in float64.
const POW10: [f64; 23] = [
    1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16,
    1e17, 1e18, 1e19, 1e20, 1e21, 1e22,
];

/// `10^k` for `k` in `0..=17`, as integers.
const POW10_U64: [u64; 18] = [
    1,
    10,
    100,
    1_000,
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    100_000_000,
    1_000_000_000,
    10_000_000_000,
    100_000_000_000,
    1_000_000_000_000,
    10_000_000_000_000,
    100_000_000_000_000,
    1_000_000_000_000_000,
    10_000_000_000_000_000,
    100_000_000_000_000_000,
];

/// Eight ASCII `0` bytes.
const ZEROS: u64 = 0x3030_3030_3030_3030;

/// How close (in float64 ulps) an inexact float64 may come to a float32 rounding midpoint
/// before the fast path gives up (the error bound is 3 ulps; 8 covers a binade change).
const F32_GUARD_ULPS: u64 = 8;

/// `10^k` for `k` in `0..=8`, to append a run of `k` digits to a significand.
const SCALE: [u64; 9] = [
    1,
    10,
    100,
    1_000,
    10_000,
    100_000,
    1_000_000,
    10_000_000,
    100_000_000,
];

/// Up to 8 ASCII bytes at `b[at..]` as a little-endian word (the first byte lowest), with
/// bytes past the end of `b` read as `0x00` (never a digit).
#[inline(always)]
fn load8(b: &[u8], at: usize) -> u64 {
    match b.get(at..at + 8) {
        Some(w) => {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            u64::from_le_bytes(a)
        }
        None => {
            let mut a = [0u8; 8];
            if let Some(tail) = b.get(at..) {
                for (d, s) in a.iter_mut().zip(tail) {
                    *d = *s;
                }
            }
            u64::from_le_bytes(a)
        }
    }
}

/// How many of the word's bytes, from the first, are ASCII digits (0..=8).
#[inline(always)]
fn digit_run(x: u64) -> usize {
    const HI: u64 = 0x8080_8080_8080_8080;
    // A byte is not a digit when it is ≥ 0x80, ≥ b':' (adding 0x46 sets its high bit) or
    // < b'0' (subtracting 0x30 from it with its high bit forced on clears that bit). A
    // carry out of a byte ≥ 0xBA only disturbs later bytes, past the first non-digit.
    let above = x.wrapping_add(0x4646_4646_4646_4646);
    let below = !((x | HI).wrapping_sub(0x3030_3030_3030_3030));
    let not_digit = (x | above | below) & HI;
    (not_digit.trailing_zeros() / 8) as usize
}

/// How many of the word's bytes, from the first, are ASCII `0`.
#[inline(always)]
fn zero_run(x: u64) -> usize {
    ((x ^ ZEROS).trailing_zeros() / 8) as usize
}

/// The value of the first `n` (0..=8) digit bytes of `x`, the first most significant
/// (0 for `n = 0`).
#[inline(always)]
fn digits_value(x: u64, n: usize) -> u64 {
    // Move the n digits to the top of the word: the low (most significant) places become
    // 0x00 bytes, i.e. leading zero digits once 0x30 is taken off every digit byte. Two
    // shifts, so that n = 0 shifts everything out instead of overflowing the shift.
    let half = 4 * (8 - n as u32);
    let d = (x.wrapping_sub(ZEROS) << half) << half;
    // Pairs, then quads, then the eight-digit value (the classic SWAR reduction).
    let d = d.wrapping_mul(10).wrapping_add(d >> 8);
    let lo = (d & 0x0000_00FF_0000_00FF).wrapping_mul(100 + (1_000_000 << 32));
    let hi = ((d >> 16) & 0x0000_00FF_0000_00FF).wrapping_mul(1 + (10_000 << 32));
    lo.wrapping_add(hi) >> 32
}

/// Parse the JSON number at the start of `b` to bf16 bits, exactly as
/// float64 → float32 → bfloat16 round-to-nearest-even of the correctly rounded decimal.
///
/// Returns the bits and the number's length in bytes, or `None` when the text is not a
/// number this fast path decides (see the module docs); the caller must then parse the
/// same text with an exact parser. Never reads past `b`.
#[inline(always)]
pub fn parse_bf16(b: &[u8]) -> Option<(u16, usize)> {
    let neg = b.first() == Some(&b'-');
    let s = usize::from(neg);
    // The shape of nearly every hidden value: one integer digit, `.`, up to 17 fraction
    // digits (`-0.1640625`, `1.25`), read as one run of digits from two words (three for
    // 15 or more fraction digits) with the `.` taken as a `0` digit. No branch depends on how many digits there are (that
    // varies from value to value and would be mispredicted about every other value).
    let w1 = load8(b, s);
    if (w1 >> 8) & 0xFF == u64::from(b'.') {
        let w1 = (w1 & !0xFF00) | 0x3000;
        let n1 = digit_run(w1);
        let w2 = load8(b, s + 8);
        let n2 = if n1 == 8 { digit_run(w2) } else { 0 };
        // n1 ≥ 3: a digit, the `.` and at least one fraction digit; n2 < 8: ≤ 14 of them.
        if n1 >= 3 && n2 < 8 {
            let frac = n1 + n2 - 2;
            let m = digits_value(w1, n1) * SCALE[n2] + digits_value(w2, n2);
            // The integer digit was counted at 10^(frac+1) (the `.` as a digit below it):
            // move it to 10^frac. m < 10^15 < 2^53.
            let m = m - 9 * (w1 & 0x0F) * POW10_U64[frac];
            return finish(b, s + n1 + n2, m, -(frac as i32), neg);
        }
        if n2 == 8 {
            // 15..=17 fraction digits (small values: `0.00194549560546875`): a third word,
            // ≤ 19 digit bytes in all so m < 10^19.
            let w3 = load8(b, s + 16);
            let n3 = digit_run(w3);
            if n3 <= 3 {
                let frac = 14 + n3;
                let m = digits_value(w1, 8) * SCALE[8] + digits_value(w2, 8);
                let m = m * SCALE[n3] + digits_value(w3, n3);
                let m = m - 9 * (w1 & 0x0F) * POW10_U64[frac];
                return finish(b, s + 16 + n3, m, -(frac as i32), neg);
            }
        }
    }
    parse_general(b, neg)
}

/// [`parse_bf16`] for every other shape: `0`, integers, several integer digits, long
/// fractions (leading zeros do not count towards the 19 significant digits).
#[inline(never)]
fn parse_general(b: &[u8], neg: bool) -> Option<(u16, usize)> {
    let mut p = usize::from(neg);

    // Integer part: `0` or a digit run without a leading zero.
    let x = load8(b, p);
    let n = digit_run(x);
    if n == 0 || n == 8 || (n > 1 && x & 0xFF == u64::from(b'0')) {
        return None;
    }
    let mut m = digits_value(x, n);
    // Significant digits so far (leading zeros do not count): ≤ 19 keeps m < 10^19 < 2^64.
    let digits = if m == 0 { 0 } else { n };
    p += n;

    let mut e10: i32 = 0;
    if b.get(p) == Some(&b'.') {
        p += 1;
        // The fraction's digits from two words (three when there are 16 or more), with no
        // branch on their count: it varies from one value to the next and a branch on it
        // would be mispredicted about every other value.
        let x1 = load8(b, p);
        let x2 = load8(b, p + 8);
        let n1 = digit_run(x1);
        let n2 = if n1 == 8 { digit_run(x2) } else { 0 };
        let (x3, n3) = if n2 == 8 {
            let x3 = load8(b, p + 16);
            (x3, digit_run(x3))
        } else {
            (0, 0)
        };
        let frac = n1 + n2 + n3;
        if frac == 0 || n3 == 8 {
            return None;
        }
        if digits + frac > 19 {
            // Leading zeros of the fraction do not count while m is still 0.
            let lead = if m == 0 {
                let z1 = zero_run(x1).min(n1);
                let z2 = if z1 == 8 { zero_run(x2).min(n2) } else { 0 };
                let z3 = if z1 + z2 == 16 {
                    zero_run(x3).min(n3)
                } else {
                    0
                };
                z1 + z2 + z3
            } else {
                0
            };
            if digits + frac - lead > 19 {
                return None;
            }
        }
        // ≤ 19 significant digits: no step overflows.
        m = m * SCALE[n1] + digits_value(x1, n1);
        m = m * SCALE[n2] + digits_value(x2, n2);
        m = m * SCALE[n3] + digits_value(x3, n3);
        p += frac;
        e10 = -(frac as i32);
    }

    finish(b, p, m, e10, neg)
}

/// The end of a parse: an optional exponent at `b[p..]`, then the significand `m`
/// (< 10^19) times `10^e10` rounded as the reference rounds it, with the sign.
#[inline(always)]
fn finish(b: &[u8], mut p: usize, m: u64, mut e10: i32, neg: bool) -> Option<(u16, usize)> {
    if matches!(b.get(p), Some(b'e' | b'E')) {
        p += 1;
        let eneg = match b.get(p) {
            Some(b'-') => {
                p += 1;
                true
            }
            Some(b'+') => {
                p += 1;
                false
            }
            _ => false,
        };
        let x = load8(b, p);
        let n = digit_run(x);
        // Exponents of more than 3 digits are never in reach of the exact case.
        if n == 0 || n > 3 {
            return None;
        }
        let e = digits_value(x, n) as i32;
        p += n;
        e10 += if eneg { -e } else { e };
    }

    let k = e10.unsigned_abs() as usize;
    let scale = *POW10.get(k)?;
    // Clinger: with m ≤ 2^53 both operands are exact and one correctly rounded IEEE
    // operation gives the correctly rounded float64.
    let v = if e10 < 0 {
        m as f64 / scale
    } else {
        m as f64 * scale
    };
    if m > 1 << 53 {
        // `m as f64` rounds too: v is then within 2 ulps of the true value, 3 of the
        // correctly rounded float64. Both round to the same float32 unless a float32
        // rounding midpoint (low 29 bits = 2^28) lies that close; leave those, and the
        // float32 subnormal range (other boundaries), to the exact parser.
        if !(f64::from(f32::MIN_POSITIVE)..f64::from(f32::MAX)).contains(&v) {
            return None;
        }
        let low = v.to_bits() & ((1 << 29) - 1);
        if low.abs_diff(1 << 28) <= F32_GUARD_ULPS {
            return None;
        }
    }
    // The sign without a branch (it is a coin toss per value).
    let v = f64::from_bits(v.to_bits() | u64::from(neg) << 63);
    // numpy's float64 → float32 cast (round to nearest even; ±inf beyond f32::MAX).
    let v = v as f32;
    if !v.is_finite() {
        return None;
    }
    Some((f32_to_bf16_bits(v), p))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact path the fast path must agree with.
    fn exact(text: &str) -> Option<(u16, usize)> {
        let (v, n) = fast_float2::parse_partial::<f64, _>(text.as_bytes()).ok()?;
        let v = v as f32;
        v.is_finite().then(|| (f32_to_bf16_bits(v), n))
    }

    #[test]
    fn digit_runs_and_values() {
        for s in [
            "", "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678",
        ] {
            let text = format!("{s},9999999");
            let x = load8(text.as_bytes(), 0);
            assert_eq!(digit_run(x), s.len(), "{text}");
            if !s.is_empty() {
                assert_eq!(digits_value(x, s.len()), s.parse::<u64>().unwrap());
            }
        }
        // Bytes around the digit range, and non-ASCII bytes, end a run.
        for stop in [b'/', b':', b'.', b'e', 0x00, 0x7F, 0x80, 0xB9, 0xBA, 0xFF] {
            let mut w = *b"12345678";
            w[3] = stop;
            assert_eq!(digit_run(u64::from_le_bytes(w)), 3, "stop byte {stop:#x}");
        }
    }

    #[test]
    fn every_bf16_value_as_printed_agrees_with_the_exact_parser() {
        let (mut fast, mut usual, mut usual_fast) = (0, 0, 0);
        for bits in 0..=u16::MAX {
            let v = engy_core::toploc::bf16_bits_to_f32(bits);
            if !v.is_finite() {
                continue;
            }
            let text = serde_json::to_string(&f64::from(v)).unwrap();
            // Hidden states live here (post-norm activations and their outliers).
            let is_usual = v == 0.0 || (1e-4..1e4).contains(&v.abs());
            usual += usize::from(is_usual);
            if let Some(got) = parse_bf16(format!("{text},").as_bytes()) {
                assert_eq!(Some(got), exact(&text), "{text}");
                // -0.0 and 0.0 keep their sign bit.
                assert_eq!(got.0, bits, "{text}");
                fast += 1;
                usual_fast += usize::from(is_usual);
            }
        }
        // Every value of the usual range takes the fast path.
        assert_eq!(usual_fast, usual, "fast path taken by {fast} values in all");
    }

    #[test]
    fn odd_and_non_json_text_is_left_to_the_exact_parser() {
        for text in [
            "",
            "-",
            "01",
            "-01",
            "1.",
            "1.e5",
            ".5",
            "1e",
            "1e+",
            "1e-",
            "1e1234",
            "+1",
            "12345678901234567890",
            "0.12345678901234567890",
            "1e400",
            "1e23",
            "NaN",
            "inf",
            "3.4028236e38",
            "123456789012345678901",
        ] {
            assert_eq!(parse_bf16(text.as_bytes()), None, "{text:?}");
        }
    }

    #[test]
    fn lengths_stop_at_the_first_byte_after_the_number() {
        for (text, n) in [
            ("0,", 1),
            ("-0]", 2),
            ("1.5e-3,", 6),
            ("1.5E+3 ", 6),
            ("12.25e2x", 7),
            ("0.000118255615234375]", 20),
        ] {
            assert_eq!(parse_bf16(text.as_bytes()).map(|r| r.1), Some(n), "{text}");
            assert_eq!(parse_bf16(text.as_bytes()), exact(text), "{text}");
        }
    }

    /// SplitMix64, for reproducible generated text.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    fn agree(text: &str) -> bool {
        match parse_bf16(text.as_bytes()) {
            Some(got) => {
                assert_eq!(Some(got), exact(text), "{text:?}");
                true
            }
            None => false,
        }
    }

    #[test]
    fn decimals_next_to_float32_midpoints_agree_with_the_exact_parser() {
        // The double rounding decimal → float64 → float32 is decided at float32 midpoints:
        // print midpoints (exact in float64) with 16..19 significant digits and nudge the
        // last digit, so the fast path meets text on, just under and just over them.
        let mut rng = Rng(53);
        let mut fast = 0;
        for _ in 0..100_000 {
            let exp = 0x3A00_0000 + rng.below(0x0C00_0000) as u32; // |x| in ~[5e-4, 2e4)
            let x = f32::from_bits(exp & !0xFF | rng.below(256) as u32);
            let mid = (f64::from(x) + f64::from(f32::from_bits(x.to_bits() + 1))) / 2.0;
            let sig = 16 + rng.below(4) as usize;
            let text = format!("{:.*e}", sig - 1, mid);
            let (mant, e) = text.split_once('e').unwrap();
            let mut mant = mant.as_bytes().to_vec();
            let last = mant.len() - 1;
            mant[last] = match rng.below(3) {
                0 => mant[last].saturating_sub(1).max(b'0'),
                1 => mant[last],
                _ => (mant[last] + 1).min(b'9'),
            };
            let text = format!("{}e{e},", String::from_utf8(mant).unwrap());
            fast += usize::from(agree(&text));
        }
        // Both paths are exercised: ≤ 2^53 significands are exact (Clinger), longer text
        // this close to a midpoint is left to the exact parser.
        assert!(
            (10_000..90_000).contains(&fast),
            "fast path taken by {fast}"
        );
    }

    #[test]
    fn generated_json_numbers_agree_with_the_exact_parser() {
        let mut rng = Rng(0x5eed);
        for _ in 0..200_000 {
            let mut t = String::new();
            if rng.below(2) == 0 {
                t.push('-');
            }
            let int_digits = rng.below(9) as usize;
            for k in 0..int_digits.max(1) {
                let d = if int_digits == 0 || (k == 0 && rng.below(8) > 0) {
                    rng.below(int_digits.min(1) as u64 * 9 + 1) + u64::from(int_digits > 0)
                } else {
                    rng.below(10)
                };
                t.push(char::from(b'0' + d as u8));
            }
            if rng.below(4) > 0 {
                t.push('.');
                for _ in 0..rng.below(24) {
                    t.push(char::from(b'0' + rng.below(10) as u8));
                }
            }
            if rng.below(3) == 0 {
                t.push(if rng.below(2) == 0 { 'e' } else { 'E' });
                match rng.below(3) {
                    0 => t.push('-'),
                    1 => t.push('+'),
                    _ => {}
                }
                for _ in 0..rng.below(4) {
                    t.push(char::from(b'0' + rng.below(10) as u8));
                }
            }
            t.push([',', ']', ' ', 'x', '.', 'e'][rng.below(6) as usize]);
            agree(&t);
        }
    }
}
