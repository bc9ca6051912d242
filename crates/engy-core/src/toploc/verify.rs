//! Verifying proofs against recomputed activations, with the semantics of toploc 0.1.6's
//! C++ tensor path (`verify_proofs` in `toploc/C/csrc/poly.cpp`).

use super::build::{batch_ranges, plan};
use super::poly::{evaluate_many, ProofPoly, PRIME};
use super::topk::{topk_into, TopkScratch};
use super::{Dtype, Params, ToplocError};

/// `2^64`: both mantissa statistics when no exponent matched (the reference's
/// `std::pow(2, 64)`, written `1.8446744073709552e+19` in the vectors).
pub const NO_EXPONENT_MATCH: f64 = 18_446_744_073_709_551_616.0;

/// The comparison of one proof with one recomputed batch (toploc `VerificationResult`).
///
/// Errors grow with distance from the proof: an honest recomputation gives
/// `(0, 0.0, 0.0)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VerifyResult {
    /// Number of top-k positions whose bfloat16 exponent field (bits 14..7) differs between
    /// the proof's value and the activation (0..=topk).
    pub exp_mismatches: u64,
    /// Mean of |mantissa field difference| (bits 6..0, so each 0..=127) over the positions
    /// whose exponents match, `sum / n` in f64; [`NO_EXPONENT_MATCH`] if there are none.
    pub mant_err_mean: f64,
    /// Upper median of the same errors, `sorted[n / 2]`; [`NO_EXPONENT_MATCH`] if none.
    pub mant_err_median: f64,
}

/// Verifies one proof per batch against recomputed activations.
///
/// * `elements`, `dtype`, `params`: as for [`build_proofs`](super::build_proofs); batches
///   are formed the same way ([`batch_ranges`](super::batch_ranges)).
/// * `proofs`: one per batch, in order.
/// * returns one [`VerifyResult`] per batch.
///
/// Per batch (toploc's C++ tensor path, used by the reference for a stacked tensor with
/// skip_prefill; applied here to every input, prefill and ragged included):
/// `idx = flat.abs().topk(topk)` (torch order); for each of the `topk` positions the proof
/// side is `y = proof(idx % proof.modulus)` (Horner in GF(65497)) read as bfloat16 bits,
/// the activation side is `flat[idx]`; exponent fields `(bits >> 7) & 0xFF` and mantissa
/// fields `bits & 0x7F` are compared, **sign ignored** on both sides. The proof's
/// coefficient count is not checked (the reference does not either).
///
/// This differs from toploc's Python list path (used for lists and prefill) in two ways
/// (vectors README "Verification: the two paths differ"): the list path evaluates at the
/// raw index (wrong when the proof modulus is below 65497) and takes the mean of the two
/// middle values as median for an even count.
///
/// # Errors
/// * [`ToplocError::UnsupportedDtype`] for [`Dtype::F16`] (the reference's `get_fp_parts`
///   accepts only bfloat16/float32 and raises).
/// * [`ToplocError::ProofCountMismatch`] when `proofs.len()` differs from the number of
///   batches (the reference silently checks only the shorter list, or crashes).
/// * [`ToplocError::NullProof`] for a proof with modulus 0 (the reference's tensor path
///   dies of SIGFPE; vectors `v_null_proofs`).
/// * [`ToplocError::TopkZero`], [`ToplocError::TopkExceedsBatch`],
///   [`ToplocError::BatchTooLarge`], [`ToplocError::ZeroDecodeBatchingSize`],
///   [`ToplocError::NoPrefillElement`] as for building.
pub fn verify_proofs(
    elements: &[&[u16]],
    dtype: Dtype,
    proofs: &[ProofPoly],
    params: &Params,
) -> Result<Vec<VerifyResult>, ToplocError> {
    if dtype != Dtype::Bf16 {
        return Err(ToplocError::UnsupportedDtype {
            dtype: dtype.torch_name().to_string(),
            operation: "verify",
        });
    }
    let n_batches = batch_ranges(elements.len(), params)?.len();
    if n_batches != proofs.len() {
        return Err(ToplocError::ProofCountMismatch {
            proofs: proofs.len(),
            batches: n_batches,
        });
    }
    if let Some(index) = proofs.iter().position(ProofPoly::is_null) {
        return Err(ToplocError::NullProof { index });
    }
    let topk = params.topk;
    let batches = plan(elements, params)?;

    let mut scratch = TopkScratch::default();
    let mut mant_errs: Vec<u32> = Vec::with_capacity(topk);
    let mut xs: Vec<u32> = Vec::with_capacity(topk);
    let mut ys: Vec<u32> = Vec::with_capacity(topk);
    let mut results = Vec::with_capacity(batches.len());
    for (batch, proof) in batches.into_iter().zip(proofs) {
        let selected = topk_into(batch.parts, batch.len, dtype, topk, &mut scratch);
        let modulus = u32::from(proof.modulus);
        xs.clear();
        // modulus != 0: null proofs were refused above.
        xs.extend(
            selected
                .iter()
                .map(|e| e.idx.checked_rem(modulus).unwrap_or(e.idx) % PRIME),
        );
        ys.clear();
        evaluate_many(&proof.coeffs, &xs, &mut ys);
        mant_errs.clear();
        let mut exp_mismatches: u64 = 0;
        for (e, &y) in selected.iter().zip(&ys) {
            let proof_exp = (y >> 7) & 0xFF;
            let proof_mant = y & 0x7F;
            let act_exp = (u32::from(e.bits) >> 7) & 0xFF;
            let act_mant = u32::from(e.bits) & 0x7F;
            if proof_exp == act_exp {
                mant_errs.push(proof_mant.abs_diff(act_mant));
            } else {
                exp_mismatches += 1;
            }
        }
        results.push(summarise(exp_mismatches, &mut mant_errs));
    }
    Ok(results)
}

/// Mean (sum / n in f64) and upper median (`sorted[n / 2]`) of the mantissa errors.
fn summarise(exp_mismatches: u64, mant_errs: &mut [u32]) -> VerifyResult {
    if mant_errs.is_empty() {
        return VerifyResult {
            exp_mismatches,
            mant_err_mean: NO_EXPONENT_MATCH,
            mant_err_median: NO_EXPONENT_MATCH,
        };
    }
    let sum: u64 = mant_errs.iter().map(|&v| u64::from(v)).sum();
    let mean = sum as f64 / mant_errs.len() as f64;
    mant_errs.sort_unstable();
    let median = mant_errs
        .get(mant_errs.len() / 2)
        .copied()
        .map_or(NO_EXPONENT_MATCH, f64::from);
    VerifyResult {
        exp_mismatches,
        mant_err_mean: mean,
        mant_err_median: median,
    }
}

/// [`verify_proofs`] with the proofs as wire strings ([`ProofPoly::from_base64`]), as
/// toploc's `verify_proofs_base64`.
///
/// # Errors
/// Those of [`ProofPoly::from_base64`] for the first undecodable proof, then those of
/// [`verify_proofs`].
pub fn verify_proofs_base64<S: AsRef<str>>(
    elements: &[&[u16]],
    dtype: Dtype,
    proofs_base64: &[S],
    params: &Params,
) -> Result<Vec<VerifyResult>, ToplocError> {
    let proofs = proofs_base64
        .iter()
        .map(|s| ProofPoly::from_base64(s.as_ref()))
        .collect::<Result<Vec<_>, _>>()?;
    verify_proofs(elements, dtype, &proofs, params)
}
