//! The TOPLOC proof of one request, built batch by batch as its rows arrive
//! (docs/PROTOCOL.md §3.8, §5).
use engy_core::toploc::{
    build_proofs_base64, null_proofs_like_reference, Dtype, Params, ProofPoly, ToplocError,
};

use crate::scan::RowSink;

/// Builds the TOPLOC proofs of a request batch by batch as its rows arrive (PROTOCOL.md
/// §3.8, skip_prefill: batches are groups of `decode_batching_size` rows from row 0), so a
/// request holds at most one batch of rows (32 × hidden × 2 bytes), never all of them. Each
/// batch's proof depends only on that batch's rows, so the proofs equal
/// `engy_core::toploc::build_proofs_base64` over every row at once (bf16 rows).
#[derive(Debug, Default)]
pub struct ProofAcc {
    params: Option<Params>,
    /// Rows of the batch being filled, concatenated.
    pending: Vec<u16>,
    /// End offset of each pending row in `pending`.
    ends: Vec<usize>,
    proofs: Vec<String>,
    /// Rows received in total.
    rows: usize,
    err: Option<ToplocError>,
}

impl ProofAcc {
    /// An empty accumulator for `params` (`skip_prefill` must be true, as engy uses).
    pub fn new(params: Params) -> Self {
        Self {
            params: Some(params),
            ..Self::default()
        }
    }

    /// Rows received so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Add the next row (bf16 bit patterns); proves the batch once it is full.
    pub fn push(&mut self, bits: &[u16]) {
        self.rows += 1;
        if self.err.is_some() {
            return;
        }
        self.pending.extend_from_slice(bits);
        self.ends.push(self.pending.len());
        let dbs = self.params.map_or(0, |p| p.decode_batching_size);
        if self.ends.len() >= dbs {
            self.prove_pending();
        }
    }

    fn prove_pending(&mut self) {
        if self.ends.is_empty() || self.err.is_some() {
            return;
        }
        let Some(params) = self.params else {
            self.err = Some(ToplocError::ZeroDecodeBatchingSize);
            return;
        };
        let mut start = 0;
        let elements: Vec<&[u16]> = self
            .ends
            .iter()
            .map(|&end| {
                let row = self.pending.get(start..end).unwrap_or(&[]);
                start = end;
                row
            })
            .collect();
        let batch = self.proofs.len();
        match build_proofs_base64(&elements, Dtype::Bf16, &params) {
            Ok(p) => self.proofs.extend(p),
            Err(mut e) => {
                // Report the batch's index in the whole request, as one build would.
                if let ToplocError::TopkExceedsBatch { batch: b, .. }
                | ToplocError::BatchTooLarge { batch: b, .. } = &mut e
                {
                    *b = batch;
                }
                self.err = Some(e);
            }
        }
        self.pending.clear();
        self.ends.clear();
    }

    /// Prove the last (short) batch and return every proof, as base64 wire strings.
    ///
    /// # Errors
    /// The first [`ToplocError`] of any batch (then no proof is returned, as the
    /// reference nulls every proof when one batch fails).
    pub fn finish(mut self) -> Result<Vec<String>, ToplocError> {
        self.prove_pending();
        match self.err {
            Some(e) => Err(e),
            None => Ok(self.proofs),
        }
    }
}

impl RowSink for ProofAcc {
    fn row(&mut self, _element: usize, bits: &[u16]) {
        self.push(bits);
    }
}

/// The proofs of a finished request.
#[derive(Debug)]
pub struct Proofs {
    /// One base64 proof per batch.
    pub proofs: Vec<String>,
    /// Why TOPLOC could not be built over the rows (then `proofs` are the reference's
    /// null proofs, which every verifier calls unproven, docs/PROTOCOL.md §5).
    pub unproven: Option<ToplocError>,
}

impl ProofAcc {
    /// [`ProofAcc::finish`], or the reference's null proofs when the rows cannot be proven
    /// (fewer values than `topk`): the completion still goes out (docs/PROTOCOL.md §5).
    ///
    /// # Errors
    /// Only when even null proofs cannot be sized (`decode_batching_size` 0).
    pub fn finish_or_null(self) -> Result<Proofs, ToplocError> {
        let rows = self.rows;
        let params = self.params;
        match self.finish() {
            Ok(proofs) => Ok(Proofs {
                proofs,
                unproven: None,
            }),
            Err(e) => {
                let params = params.ok_or(ToplocError::ZeroDecodeBatchingSize)?;
                let proofs = null_proofs_like_reference(rows, &params)?
                    .iter()
                    .map(ProofPoly::to_base64)
                    .collect();
                Ok(Proofs {
                    proofs,
                    unproven: Some(e),
                })
            }
        }
    }
}
