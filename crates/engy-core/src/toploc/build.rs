//! Building proofs (toploc 0.1.6 `toploc/poly.py::build_proofs`).

use std::ops::Range;

use super::poly::{injective_modulus, newton_coefficients, ProofPoly, PRIME};
use super::topk::{topk_algorithm, topk_into, TopkAlgorithm, TopkScratch};
use super::{Dtype, Params, ToplocError};

/// One built proof with the top-k it commits to (what the conformance vectors record per
/// batch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchProof {
    /// The proof polynomial.
    pub proof: ProofPoly,
    /// Number of values in the flattened batch.
    pub flat_len: usize,
    /// The libstdc++ path torch takes for this batch.
    pub algorithm: TopkAlgorithm,
    /// `flat.abs().topk(topk).indices`, in torch's order (flat indices within the batch).
    pub topk_indices: Vec<u32>,
    /// `flat[topk_indices]`: the signed bit patterns, same order.
    pub topk_value_bits: Vec<u16>,
}

/// The element ranges forming each batch, in proof order (vectors README "Batching").
///
/// * `skip_prefill = false`: batch 0 is element 0 alone; then groups of
///   `decode_batching_size` consecutive elements starting at element 1.
/// * `skip_prefill = true`: groups of `decode_batching_size` starting at element 0.
///
/// The last group may be short. `n_elements = 0` with skip_prefill gives no batches.
///
/// # Errors
/// [`ToplocError::ZeroDecodeBatchingSize`]; [`ToplocError::NoPrefillElement`] when
/// skip_prefill is false and `n_elements = 0`.
pub fn batch_ranges(n_elements: usize, params: &Params) -> Result<Vec<Range<usize>>, ToplocError> {
    let dbs = params.decode_batching_size;
    if dbs == 0 {
        return Err(ToplocError::ZeroDecodeBatchingSize);
    }
    let mut ranges = Vec::with_capacity(n_elements / dbs + 2);
    let mut start = 0;
    if !params.skip_prefill {
        if n_elements == 0 {
            return Err(ToplocError::NoPrefillElement);
        }
        ranges.push(0..1);
        start = 1;
    }
    while start < n_elements {
        let end = start.saturating_add(dbs).min(n_elements);
        ranges.push(start..end);
        start = end;
    }
    Ok(ranges)
}

/// One batch: its elements (concatenated in order) and their total length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlannedBatch<'a> {
    /// The elements of the batch.
    pub parts: &'a [&'a [u16]],
    /// Total number of values (flat length).
    pub len: usize,
}

/// Checks the parameters and batch sizes the way the reference fails, before any work.
pub(crate) fn plan<'a>(
    elements: &'a [&'a [u16]],
    params: &Params,
) -> Result<Vec<PlannedBatch<'a>>, ToplocError> {
    let ranges = batch_ranges(elements.len(), params)?;
    if ranges.is_empty() {
        return Ok(Vec::new());
    }
    if params.topk == 0 {
        return Err(ToplocError::TopkZero);
    }
    let mut batches = Vec::with_capacity(ranges.len());
    for (batch, range) in ranges.into_iter().enumerate() {
        let parts = elements.get(range).unwrap_or(&[]);
        let batch_len: usize = parts.iter().map(|p| p.len()).sum();
        if batch_len > i32::MAX as usize {
            return Err(ToplocError::BatchTooLarge { batch, batch_len });
        }
        if params.topk > batch_len {
            return Err(ToplocError::TopkExceedsBatch {
                batch,
                batch_len,
                topk: params.topk,
            });
        }
        batches.push(PlannedBatch {
            parts,
            len: batch_len,
        });
    }
    Ok(batches)
}

/// The proof for one batch; `scratch` holds the top-k buffers between batches.
fn prove_batch(
    parts: &[&[u16]],
    batch_len: usize,
    dtype: Dtype,
    topk: usize,
    scratch: &mut TopkScratch,
    record: Option<&mut Vec<BatchProof>>,
) -> Result<ProofPoly, ToplocError> {
    let selected = topk_into(parts, batch_len, dtype, topk, scratch);
    let max_idx = selected.iter().map(|e| e.idx).max().unwrap_or(0);
    let xs: Vec<i64> = selected.iter().map(|e| i64::from(e.idx)).collect();
    // Top-k indices are distinct, so below 65497 they are distinct mod 65497 too.
    let modulus = if max_idx < PRIME {
        i64::from(PRIME)
    } else {
        injective_modulus(&xs)?
    };
    let x_mod: Vec<i64> = xs.iter().map(|&x| x % modulus).collect();
    // y = the 16-bit pattern mod 65497 (patterns 0xFFD9..=0xFFFF, all negative NaNs,
    // become 0..=38: vectors README "Building the polynomial" item 4).
    let ys: Vec<u32> = selected.iter().map(|e| u32::from(e.bits) % PRIME).collect();
    let proof = ProofPoly {
        modulus: modulus as u16,
        coeffs: newton_coefficients(&x_mod, &ys)?,
    };
    if let Some(out) = record {
        out.push(BatchProof {
            proof: proof.clone(),
            flat_len: batch_len,
            algorithm: topk_algorithm(topk, batch_len),
            topk_indices: selected.iter().map(|e| e.idx).collect(),
            topk_value_bits: selected.iter().map(|e| e.bits).collect(),
        });
    }
    Ok(proof)
}

/// Builds one proof per batch, as toploc 0.1.6 `build_proofs(activations,
/// decode_batching_size, topk, skip_prefill)` when it succeeds.
///
/// * `elements`: the activation list, each element a flat row-major slice of 16-bit
///   patterns of `dtype` (a 2-D prefill block flattened, or one decode row). Elements of a
///   batch are concatenated in order; flat indices count from 0 within the batch.
/// * returns one [`ProofPoly`] per batch ([`batch_ranges`]) with `params.topk`
///   coefficients each; `[]` for no elements with skip_prefill.
///
/// Per batch: `idx = flat.abs().topk(topk).indices` (torch's tie order, [`select_topk`]),
/// `y = flat[idx]` (signed bits), then [`ProofPoly::from_points`]`(idx, y)`.
///
/// # Errors
/// Where the reference logs "Error building proofs" and returns null proofs (vectors
/// `fallback_to_null`), this returns the cause instead (no proof is built at all, as one
/// failing batch nulls every proof in the reference):
/// [`ToplocError::TopkZero`], [`ToplocError::TopkExceedsBatch`] (also an empty prefill
/// block), [`ToplocError::NoPrefillElement`], [`ToplocError::BatchTooLarge`],
/// [`ToplocError::NoInjectiveModulus`]; and [`ToplocError::ZeroDecodeBatchingSize`] where
/// the reference raises. See [`null_proofs_like_reference`] for the reference's fallback.
///
/// [`select_topk`]: super::select_topk
pub fn build_proofs(
    elements: &[&[u16]],
    dtype: Dtype,
    params: &Params,
) -> Result<Vec<ProofPoly>, ToplocError> {
    let batches = plan(elements, params)?;
    let mut scratch = TopkScratch::default();
    let mut proofs = Vec::with_capacity(batches.len());
    for b in batches {
        proofs.push(prove_batch(
            b.parts,
            b.len,
            dtype,
            params.topk,
            &mut scratch,
            None,
        )?);
    }
    Ok(proofs)
}

/// [`build_proofs`] with each proof as its wire string ([`ProofPoly::to_base64`]), as
/// toploc's `build_proofs_base64`. Same errors.
pub fn build_proofs_base64(
    elements: &[&[u16]],
    dtype: Dtype,
    params: &Params,
) -> Result<Vec<String>, ToplocError> {
    Ok(build_proofs(elements, dtype, params)?
        .iter()
        .map(ProofPoly::to_base64)
        .collect())
}

/// [`build_proofs`] that also returns each batch's top-k indices and values (for
/// conformance checks and diagnostics). Same errors.
pub fn build_proofs_detailed(
    elements: &[&[u16]],
    dtype: Dtype,
    params: &Params,
) -> Result<Vec<BatchProof>, ToplocError> {
    let batches = plan(elements, params)?;
    let mut scratch = TopkScratch::default();
    let mut out = Vec::with_capacity(batches.len());
    for b in batches {
        prove_batch(
            b.parts,
            b.len,
            dtype,
            params.topk,
            &mut scratch,
            Some(&mut out),
        )?;
    }
    Ok(out)
}

/// The null proofs toploc 0.1.6 returns when building fails:
/// `[ProofPoly.null(topk)] * (1 + (len(activations) - 1 + dbs) // dbs)`.
///
/// The count ignores skip_prefill (so with skip_prefill it can be one more than the number
/// of batches: 5 elements, dbs 2 → 4), and is 1 for no elements. Only for wire
/// compatibility with peers that expect the reference's output (vectors README
/// "Null-proof fallback").
///
/// # Errors
/// [`ToplocError::ZeroDecodeBatchingSize`] (the reference raises `ZeroDivisionError`).
pub fn null_proofs_like_reference(
    n_elements: usize,
    params: &Params,
) -> Result<Vec<ProofPoly>, ToplocError> {
    let dbs = params.decode_batching_size;
    if dbs == 0 {
        return Err(ToplocError::ZeroDecodeBatchingSize);
    }
    // Python floor division; n_elements - 1 + dbs >= 0 because dbs >= 1.
    let count = 1 + (n_elements.saturating_add(dbs) - 1) / dbs;
    Ok(vec![ProofPoly::null(params.topk); count])
}
