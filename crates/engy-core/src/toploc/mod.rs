//! TOPLOC activation proofs, byte-compatible with PyPI `toploc` 0.1.6 (PROTOCOL.md §5, §3 item 8).
//!
//! A proof commits to the top-k activations of one *batch* of hidden-state rows: the `topk`
//! flat indices of largest |value| (ties broken exactly as CPU `torch.topk` breaks them) and
//! the signed 16-bit patterns at those indices, encoded as the unique polynomial of degree
//! `< topk` over GF(65497) through the points `(index mod m, bits mod 65497)`.
//!
//! * [`build_proofs`] / [`build_proofs_base64`]: the miner side (`toploc.build_proofs`).
//! * [`verify_proofs`] / [`verify_proofs_base64`]: the auditor side, with the semantics of
//!   toploc's C++ *tensor* path (`verify_proofs` in `toploc/C/csrc/poly.cpp`).
//! * [`ProofPoly`]: one proof; bytes, base64, evaluation, interpolation.
//! * [`select_topk`]: the torch top-k order on its own.
//! * [`f32_to_bf16_bits`]: float32 → bfloat16 as torch rounds (the miner receives float32 rows).
//!
//! Every rule here was checked against the golden vectors in `tests/vectors/toploc/`
//! (their README, "How toploc 0.1.6 behaves", is the normative description). Where the
//! reference silently falls back to null proofs, crashes or truncates, this module returns a
//! typed [`ToplocError`] instead; each such divergence is documented on the function.
//!
//! Activations are passed as a list of *elements*, each a flat `&[u16]` slice of bit
//! patterns in row-major order (an element may be a whole 2-D prefill block or one decode
//! row), exactly the `activations: list[Tensor]` argument of the reference flattened with
//! `.view(-1)`.

#![deny(missing_docs)]

mod bf16;
mod build;
mod poly;
mod topk;
mod verify;

pub use bf16::{bf16_bits_to_f32, f32_to_bf16_bits, f32_to_bf16_bits_slice};
pub use build::{
    batch_ranges, build_proofs, build_proofs_base64, build_proofs_detailed,
    null_proofs_like_reference, BatchProof,
};
pub use poly::{ProofPoly, PRIME};
pub use topk::{select_topk, topk_algorithm, TopkAlgorithm};
pub use verify::{verify_proofs, verify_proofs_base64, VerifyResult, NO_EXPONENT_MATCH};

/// Element type of the activations, i.e. how a 16-bit pattern is read as a number.
///
/// toploc 0.1.6 (`ProofPoly::from_points_tensor` in `poly.cpp`) accepts bfloat16 and float16
/// and refuses float32 ("float32 not supported yet because interpolate has hardcode prime").
/// float32 therefore has no variant: [`Dtype::from_torch_name`] refuses it with
/// [`ToplocError::UnsupportedDtype`]. Convert float32 rows with [`f32_to_bf16_bits`] first
/// (PROTOCOL.md §3 item 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `torch.bfloat16`: bit 15 sign, bits 14..7 exponent, bits 6..0 mantissa.
    Bf16,
    /// `torch.float16` (IEEE binary16): bit 15 sign, bits 14..10 exponent, bits 9..0 mantissa.
    /// Accepted by build (its bit patterns become the proof values); refused by verify,
    /// whose reference (`get_fp_parts`) only reads bfloat16.
    F16,
}

impl Dtype {
    /// Parses a torch dtype name: `"bfloat16"`/`"bf16"` → [`Dtype::Bf16`],
    /// `"float16"`/`"f16"`/`"half"` → [`Dtype::F16`].
    ///
    /// # Errors
    /// [`ToplocError::UnsupportedDtype`] for anything else, including `"float32"` (where the
    /// reference falls back to null proofs, vectors `null_float32_input`).
    pub fn from_torch_name(name: &str) -> Result<Self, ToplocError> {
        match name {
            "bfloat16" | "bf16" | "torch.bfloat16" => Ok(Self::Bf16),
            "float16" | "f16" | "half" | "torch.float16" => Ok(Self::F16),
            other => Err(ToplocError::UnsupportedDtype {
                dtype: other.to_string(),
                operation: "proofs",
            }),
        }
    }

    /// The torch name of this dtype (`"bfloat16"` or `"float16"`).
    pub fn torch_name(self) -> &'static str {
        match self {
            Self::Bf16 => "bfloat16",
            Self::F16 => "float16",
        }
    }
}

/// The three proof parameters, named as the arguments of toploc's
/// `build_proofs(activations, decode_batching_size, topk, skip_prefill)`.
///
/// engy's defaults (PROTOCOL.md §3 item 8: `TOPLOC_TOPK` 128, `TOPLOC_DBS` 32,
/// `skip_prefill = true`) are [`Params::ENGY`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Params {
    /// Number of (index, value) points per proof; also the number of coefficients.
    pub topk: usize,
    /// Number of consecutive elements (decode rows) flattened into one batch.
    pub decode_batching_size: usize,
    /// `false`: element 0 (the prefill block) is a batch on its own and the groups start at
    /// element 1. `true`: the groups start at element 0 (README "Batching").
    pub skip_prefill: bool,
}

impl Params {
    /// engy's proof parameters: topk 128, decode batching size 32, skip_prefill (PROTOCOL.md §3.8).
    pub const ENGY: Params = Params {
        topk: 128,
        decode_batching_size: 32,
        skip_prefill: true,
    };
}

/// Why a proof could not be built, decoded or verified.
///
/// Where toploc 0.1.6 catches an exception inside `build_proofs` and returns null proofs,
/// we return one of these instead (the vectors' `fallback_to_null` cases); use
/// [`null_proofs_like_reference`] if the reference's wire output is needed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToplocError {
    /// `decode_batching_size` was 0 (the reference raises `ZeroDivisionError`, uncaught).
    #[error("decode_batching_size must be at least 1")]
    ZeroDecodeBatchingSize,
    /// `topk` was 0 (reference: null proofs, "Input vectors must not be empty").
    #[error("topk must be at least 1")]
    TopkZero,
    /// skip_prefill=false with no elements: there is no prefill element 0
    /// (reference: null proofs, "list index out of range").
    #[error("skip_prefill is false but there are no activation elements (no prefill element 0)")]
    NoPrefillElement,
    /// A batch has fewer elements than `topk` (reference: null proofs,
    /// "selected index k out of range"; also an empty `[0, hidden]` prefill block).
    #[error("batch {batch} has {batch_len} values, fewer than topk = {topk}")]
    TopkExceedsBatch {
        /// Batch number (0-based, in proof order).
        batch: usize,
        /// Flattened length of that batch.
        batch_len: usize,
        /// Requested top-k.
        topk: usize,
    },
    /// A batch is longer than `i32::MAX` values: the reference stores indices as C `int`.
    #[error("batch {batch} has {batch_len} values, more than the 2^31-1 the proof indices allow")]
    BatchTooLarge {
        /// Batch number (0-based).
        batch: usize,
        /// Flattened length of that batch.
        batch_len: usize,
    },
    /// The dtype is not supported by this operation (float32 for build, float16 for verify).
    #[error("dtype {dtype} is not supported by TOPLOC {operation}")]
    UnsupportedDtype {
        /// The refused dtype name.
        dtype: String,
        /// `"proofs"` (build and verify) or `"verify"`.
        operation: &'static str,
    },
    /// Proof bytes shorter than the 2-byte modulus (reference: `ValueError("Data too short")`).
    #[error("proof data too short: {len} bytes, need at least 2")]
    ProofTooShort {
        /// Number of decoded bytes.
        len: usize,
    },
    /// A character outside the standard base64 alphabet before the first `=`.
    #[error("invalid base64 character {byte:#04x} at position {position}")]
    InvalidBase64 {
        /// Byte offset in the input string.
        position: usize,
        /// The offending byte.
        byte: u8,
    },
    /// `from_points` got x and y of different lengths.
    #[error("x has {x_len} points but y has {y_len}")]
    PointCountMismatch {
        /// Length of x.
        x_len: usize,
        /// Length of y.
        y_len: usize,
    },
    /// `from_points` got no points (reference: "Input vectors must not be empty").
    #[error("no points to interpolate")]
    NoPoints,
    /// An x or y outside the C `int` range the reference accepts (it raises `TypeError`).
    #[error("point value {value} is outside the 32-bit signed range")]
    PointOutOfRange {
        /// The offending value.
        value: i64,
    },
    /// No modulus in 65497..=1 keeps the x values distinct (reference:
    /// `RuntimeError("No injective modulus found!")`), e.g. duplicate x.
    #[error("no injective modulus found")]
    NoInjectiveModulus,
    /// Two reduced x values are congruent mod 65497 (only possible with negative x;
    /// reference: "No modular inverse: gcd(a, m) != 1.").
    #[error("no modular inverse: two x values are congruent mod 65497")]
    NoModularInverse,
    /// verify got a different number of proofs than the activations have batches.
    /// (The reference silently checks only the shorter of the two, or crashes.)
    #[error("{proofs} proofs for {batches} activation batches")]
    ProofCountMismatch {
        /// Number of proofs given.
        proofs: usize,
        /// Number of batches the activations form.
        batches: usize,
    },
    /// verify met a null proof (modulus 0). The reference's tensor path dies of SIGFPE
    /// (integer division by zero) here; a null proof means the prover failed to build one.
    #[error("proof {index} is a null proof (modulus 0)")]
    NullProof {
        /// Proof number (0-based).
        index: usize,
    },
}
