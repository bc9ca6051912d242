//! [`ProofPoly`]: one TOPLOC proof, a polynomial over GF(65497) (toploc 0.1.6
//! `toploc/C/csrc/poly.cpp` and `ndd.cpp`).

use std::sync::OnceLock;

use base64::Engine as _;

use super::ToplocError;

/// The field prime of every proof polynomial (`MOD_N` in toploc's `ndd.cpp`). The
/// polynomial lives in GF(65497) whatever the proof's own `modulus` is.
pub const PRIME: u32 = 65497;

/// Largest modulus tried when interpolating (`from_points` tries 65497, 65496, …, 1).
const MAX_MODULUS: i64 = PRIME as i64;

/// One TOPLOC proof: the index modulus and the polynomial's coefficients.
///
/// * `modulus`: the `m` under which the batch's top-k flat indices are distinct; the
///   polynomial interpolates the points `(index mod m, bits mod 65497)`. 0 marks a *null*
///   proof ([`ProofPoly::null`]), which the reference emits when building failed.
/// * `coeffs`: ascending powers (`c0 + c1·x + …`), each 0..=65496 when built here; exactly
///   `topk` of them. Decoded proofs may hold any 16-bit value; evaluation reduces mod 65497.
///
/// Wire format (vectors README "Common encodings"): 2-byte big-endian `modulus`, then each
/// coefficient as 2-byte big-endian; on the wire, standard base64 with `=` padding.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProofPoly {
    /// Index modulus `m` (1..=65497), or 0 for a null proof.
    pub modulus: u16,
    /// Coefficients in ascending powers.
    pub coeffs: Vec<u16>,
}

/// `a⁻¹ mod 65497` for every `a` in 1..65497 (index 0 holds 0), built once.
fn inverse_table() -> &'static [u16] {
    static TABLE: OnceLock<Vec<u16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let p = PRIME as usize;
        let mut inv = vec![0u16; p];
        if let Some(one) = inv.get_mut(1) {
            *one = 1;
        }
        for a in 2..p {
            // inv[a] = -(p / a) * inv[p mod a]  (mod p)
            let q = (p / a) as u64;
            let r = u64::from(inv[p % a]);
            let v = (p as u64 - (q * r) % p as u64) % p as u64;
            inv[a] = v as u16;
        }
        inv
    })
}

/// Reduces any integer into 0..65497 (`safeMod` in `ndd.cpp`).
#[inline]
fn field(v: i64) -> u32 {
    v.rem_euclid(i64::from(PRIME)) as u32
}

impl ProofPoly {
    /// The null proof of `k` coefficients: modulus 0 and `k` zeros (`ProofPoly.null(k)`),
    /// `2 + 2k` zero bytes on the wire (vectors `poly.json`, kind `null`).
    pub fn null(k: usize) -> Self {
        Self {
            modulus: 0,
            coeffs: vec![0; k],
        }
    }

    /// Whether this is a null proof (modulus 0).
    pub fn is_null(&self) -> bool {
        self.modulus == 0
    }

    /// The wire bytes: 2-byte big-endian modulus, then each coefficient 2-byte big-endian
    /// (`2 + 2·coeffs.len()` bytes).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(2 + 2 * self.coeffs.len());
        out.extend_from_slice(&self.modulus.to_be_bytes());
        for c in &self.coeffs {
            out.extend_from_slice(&c.to_be_bytes());
        }
        out
    }

    /// Parses wire bytes as toploc's `ProofPoly::from_bytes`: the first 2 bytes are the
    /// modulus, then 2-byte coefficients; a trailing odd byte is ignored.
    ///
    /// # Errors
    /// [`ToplocError::ProofTooShort`] for fewer than 2 bytes ("Data too short").
    pub fn from_bytes(data: &[u8]) -> Result<Self, ToplocError> {
        let (head, rest) = match data {
            [a, b, rest @ ..] => ([*a, *b], rest),
            _ => return Err(ToplocError::ProofTooShort { len: data.len() }),
        };
        let coeffs = rest
            .chunks_exact(2)
            .map(|c| match c {
                [a, b] => u16::from_be_bytes([*a, *b]),
                _ => 0, // unreachable: chunks_exact(2)
            })
            .collect();
        Ok(Self {
            modulus: u16::from_be_bytes(head),
            coeffs,
        })
    }

    /// The wire string: standard-alphabet base64 of [`ProofPoly::to_bytes`] with `=` padding.
    pub fn to_base64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.to_bytes())
    }

    /// Parses a wire string as toploc's `ProofPoly::from_base64` (its own decoder in
    /// `poly.cpp`): decoding stops at the first `=` (anything after it is ignored), so
    /// unpadded input is accepted; a final group of 2 or 3 characters yields 1 or 2 bytes
    /// (unused low bits ignored), a lone final character yields nothing; then
    /// [`ProofPoly::from_bytes`].
    ///
    /// # Errors
    /// * [`ToplocError::InvalidBase64`] for a character outside `A–Z a–z 0–9 + /` before the
    ///   first `=` (the reference decodes such characters to garbage instead).
    /// * [`ToplocError::ProofTooShort`] when fewer than 2 bytes result.
    pub fn from_base64(text: &str) -> Result<Self, ToplocError> {
        Self::from_bytes(&decode_base64_like_reference(text)?)
    }

    /// Evaluates the polynomial at `x` with Horner's method in GF(65497), giving 0..=65496
    /// (toploc `evaluate_polynomial`, `ProofPoly.__call__`).
    ///
    /// The reference takes a C `int` x and keeps every intermediate in the field, so its
    /// result equals the polynomial at `x mod 65497` (Euclidean: -1 ≡ 65496); this is what
    /// is computed here for any i64 (vectors `poly.json` kind `evaluate`: negative x, x ≥
    /// modulus, ±2^31). The proof's own `modulus` is NOT applied here (reduce the index
    /// first, as verification does). An empty coefficient list is the zero polynomial
    /// (the reference reads past its vector: undefined behaviour).
    pub fn evaluate(&self, x: i64) -> u32 {
        evaluate_coeffs(&self.coeffs, field(x))
    }

    /// Interpolates the points `(x, y)` exactly as toploc's `ProofPoly::from_points`:
    ///
    /// 1. modulus `m`: the first of 65497, 65496, …, 1 under which all `x % m` (C remainder,
    ///    truncated toward zero) are distinct;
    /// 2. points `(x % m, y mod 65497)`;
    /// 3. Newton divided differences mod 65497 expanded to monomial form, giving exactly
    ///    `x.len()` coefficients.
    ///
    /// Point order does not change the result (the interpolant is unique; vectors
    /// `order_independent_a/b`).
    ///
    /// # Errors
    /// * [`ToplocError::PointCountMismatch`], [`ToplocError::NoPoints`];
    /// * [`ToplocError::PointOutOfRange`] for a value outside i32 (the reference's `int`);
    /// * [`ToplocError::NoInjectiveModulus`] (e.g. duplicate x);
    /// * [`ToplocError::NoModularInverse`] (two negative/positive x congruent mod 65497).
    pub fn from_points(x: &[i64], y: &[i64]) -> Result<Self, ToplocError> {
        if x.len() != y.len() {
            return Err(ToplocError::PointCountMismatch {
                x_len: x.len(),
                y_len: y.len(),
            });
        }
        for &v in x.iter().chain(y) {
            if i32::try_from(v).is_err() {
                return Err(ToplocError::PointOutOfRange { value: v });
            }
        }
        let modulus = injective_modulus(x)?;
        // C++ `val % modulus` truncates toward zero (negative x keep a negative residue).
        let x_mod: Vec<i64> = x.iter().map(|&v| v % modulus).collect();
        let ys: Vec<u32> = y.iter().map(|&v| field(v)).collect();
        let coeffs = newton_coefficients(&x_mod, &ys)?;
        Ok(Self {
            modulus: modulus as u16,
            coeffs,
        })
    }
}

// Field arithmetic in u32: for a, b < 65497 and c <= 65535, a·b + c <= 65496² + 65535
// = 4_289_791_551 < 2^32, so every product-plus-addend below fits without widening.

/// Horner in GF(65497) at a point already reduced into 0..65497.
#[inline]
pub(crate) fn evaluate_coeffs(coeffs: &[u16], x: u32) -> u32 {
    let mut acc: u32 = 0;
    for &c in coeffs.iter().rev() {
        acc = (acc * x + u32::from(c)) % PRIME;
    }
    acc
}

/// Points evaluated side by side in [`evaluate_many`] (independent Horner chains keep the
/// multiplier busy instead of waiting on one chain's latency).
const LANES: usize = 8;

/// Evaluates the polynomial at every point of `xs` (each already in 0..65497), appending
/// the values to `out` in order; same results as [`evaluate_coeffs`] per point.
pub(crate) fn evaluate_many(coeffs: &[u16], xs: &[u32], out: &mut Vec<u32>) {
    let mut chunks = xs.chunks_exact(LANES);
    for chunk in &mut chunks {
        let mut x = [0u32; LANES];
        x.copy_from_slice(chunk);
        let mut acc = [0u32; LANES];
        for &c in coeffs.iter().rev() {
            let c = u32::from(c);
            for (a, xi) in acc.iter_mut().zip(&x) {
                *a = (*a * xi + c) % PRIME;
            }
        }
        out.extend_from_slice(&acc);
    }
    out.extend(
        chunks
            .remainder()
            .iter()
            .map(|&x| evaluate_coeffs(coeffs, x)),
    );
}

/// The reference's modulus search: first m in 65497..=1 with all `x % m` distinct.
pub(crate) fn injective_modulus(x: &[i64]) -> Result<i64, ToplocError> {
    // Fast path: all x in 0..65497 and distinct → 65497 (the usual case).
    // General path: a bitset over the residue range (-m, m).
    let span = 2 * MAX_MODULUS as usize;
    let mut seen = vec![0u64; span.div_ceil(64)];
    for m in (1..=MAX_MODULUS).rev() {
        let mut injective = true;
        let mut marked = 0usize;
        for &v in x {
            let slot = (v % m + MAX_MODULUS) as usize;
            let (word, bit) = (slot / 64, 1u64 << (slot % 64));
            let Some(w) = seen.get_mut(word) else {
                injective = false;
                break;
            };
            if *w & bit != 0 {
                injective = false;
                break;
            }
            *w |= bit;
            marked += 1;
        }
        // Clear exactly the bits this round set (x[..marked]).
        for &v in x.iter().take(marked) {
            let slot = (v % m + MAX_MODULUS) as usize;
            if let Some(w) = seen.get_mut(slot / 64) {
                *w &= !(1u64 << (slot % 64));
            }
        }
        if injective {
            return Ok(m);
        }
    }
    Err(ToplocError::NoInjectiveModulus)
}

/// Newton divided differences mod 65497, expanded to monomial coefficients
/// (`compute_newton_coefficients` in `ndd.cpp`). `x` are the reduced x values (|x| < 65497),
/// `y` already in 0..65497.
pub(crate) fn newton_coefficients(x: &[i64], y: &[u32]) -> Result<Vec<u16>, ToplocError> {
    let n = x.len();
    if n == 0 || y.len() != n {
        return Err(ToplocError::NoPoints);
    }
    let p = PRIME;
    let inv = inverse_table();
    let xs: Vec<u32> = x.iter().map(|&v| field(v)).collect();

    // In-place divided differences: dd[i] = (dd[i] - dd[i-1]) / (x[i] - x[i-k]).
    let mut dd: Vec<u32> = y.to_vec();
    for k in 1..n {
        for i in (k..n).rev() {
            let num = (dd[i] + p - dd[i - 1]) % p;
            let den = (xs[i] + p - xs[i - k]) % p;
            let inv_den = u32::from(inv.get(den as usize).copied().unwrap_or(0));
            if inv_den == 0 {
                return Err(ToplocError::NoModularInverse);
            }
            dd[i] = num * inv_den % p;
        }
    }

    // coeffs += dd[i] · Π_{j<i} (x - x_j), with the product kept as `factor`.
    let mut coeffs = vec![0u32; n];
    let mut factor = vec![0u32; n];
    factor[0] = 1;
    for i in 0..n {
        let d = dd[i];
        for (c, f) in coeffs.iter_mut().zip(&factor).take(i + 1) {
            *c = (*c + d * f) % p;
        }
        if i + 1 < n {
            let minus_xi = (p - xs[i]) % p;
            let mut prev = factor[0];
            factor[0] = prev * minus_xi % p;
            for f in factor.iter_mut().take(i + 2).skip(1) {
                let old = *f;
                *f = (prev + old * minus_xi) % p;
                prev = old;
            }
        }
    }
    Ok(coeffs.into_iter().map(|c| c as u16).collect())
}

/// toploc's own base64 decoder (`base64_decode` in `poly.cpp`), strict about the alphabet.
fn decode_base64_like_reference(text: &str) -> Result<Vec<u8>, ToplocError> {
    let bytes = text.as_bytes();
    let end = bytes.iter().position(|&b| b == b'=').unwrap_or(bytes.len());
    let mut sextets = Vec::with_capacity(end);
    for (position, &byte) in bytes.iter().take(end).enumerate() {
        let v = match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(ToplocError::InvalidBase64 { position, byte }),
        };
        sextets.push(v);
    }
    let mut out = Vec::with_capacity(sextets.len() / 4 * 3 + 2);
    for group in sextets.chunks(4) {
        let g = |i: usize| group.get(i).copied().unwrap_or(0);
        let b0 = (g(0) << 2) | ((g(1) & 0x30) >> 4);
        let b1 = ((g(1) & 0x0F) << 4) | ((g(2) & 0x3C) >> 2);
        let b2 = ((g(2) & 0x03) << 6) | g(3);
        // A group of i characters yields i - 1 bytes (4 → 3, 3 → 2, 2 → 1, 1 → 0).
        out.extend_from_slice(&[b0, b1, b2][..group.len() - 1]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_table_is_correct() {
        let inv = inverse_table();
        for a in 1..PRIME {
            assert_eq!(
                u64::from(a) * u64::from(inv[a as usize]) % u64::from(PRIME),
                1
            );
        }
    }

    #[test]
    fn base64_decoder_matches_standard_on_padded_input() {
        for len in 0..20u8 {
            let data: Vec<u8> = (0..len)
                .map(|i| i.wrapping_mul(37).wrapping_add(5))
                .collect();
            let text = base64::engine::general_purpose::STANDARD.encode(&data);
            assert_eq!(decode_base64_like_reference(&text).unwrap(), data);
            let unpadded = text.trim_end_matches('=');
            assert_eq!(decode_base64_like_reference(unpadded).unwrap(), data);
        }
        assert!(matches!(
            decode_base64_like_reference("AA A"),
            Err(ToplocError::InvalidBase64 {
                position: 2,
                byte: b' '
            })
        ));
        // Everything after the first '=' is ignored.
        assert_eq!(
            decode_base64_like_reference("/9k=garbage!").unwrap(),
            vec![0xFF, 0xD9]
        );
    }

    #[test]
    fn interpolation_hits_points() {
        let x = [5i64, 9, 2, 70000];
        let y = [16384i64, 49152, 16256, 1];
        let p = ProofPoly::from_points(&x, &y).unwrap();
        assert_eq!(p.modulus, 65497);
        for (&xi, &yi) in x.iter().zip(&y) {
            assert_eq!(i64::from(p.evaluate(xi % 65497)), yi);
        }
    }

    #[test]
    fn evaluate_many_matches_single() {
        let coeffs: Vec<u16> = (0..37u32).map(|i| (i * 7919 % 65536) as u16).collect();
        let xs: Vec<u32> = (0..29u32).map(|i| i * 2311 % PRIME).collect();
        let mut out = Vec::new();
        evaluate_many(&coeffs, &xs, &mut out);
        let single: Vec<u32> = xs.iter().map(|&x| evaluate_coeffs(&coeffs, x)).collect();
        assert_eq!(out, single);
    }

    #[test]
    fn empty_coeffs_evaluate_to_zero() {
        assert_eq!(ProofPoly::null(0).evaluate(5), 0);
    }
}
