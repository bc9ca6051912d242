//! TOPLOC proof decode + verify (`verify_proofs_base64`, PROTOCOL.md §3.8,
//! `tests/vectors/toploc`) with arbitrary proofs against arbitrary activations and
//! parameters. Never panics; and proofs built honestly from the same activations verify
//! with no exponent mismatch and zero mantissa error (activations without negative-NaN
//! patterns >= 65497, which the field cannot hold).
#![no_main]
use engy_core::toploc::{build_proofs, verify_proofs, verify_proofs_base64, Dtype, Params, PRIME};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [a, b, c, d, rest @ ..] = data else {
        return;
    };
    let params = Params {
        topk: usize::from(*a % 24),
        decode_batching_size: usize::from(*b % 10),
        skip_prefill: c & 1 == 1,
    };
    let dtype = if (c >> 1) % 8 == 0 {
        Dtype::F16
    } else {
        Dtype::Bf16
    };
    // activations: up to 12 elements of up to 63 bf16 values each; then proof strings
    let n_elements = usize::from(*d % 13);
    let mut cursor = rest;
    let mut owned: Vec<Vec<u16>> = Vec::new();
    for _ in 0..n_elements {
        let Some((len, tail)) = cursor.split_first() else {
            break;
        };
        let len = usize::from(*len % 64);
        let take = (len * 2).min(tail.len());
        let (vals, tail) = tail.split_at(take);
        owned.push(
            vals.chunks_exact(2)
                .map(|p| u16::from_le_bytes([p[0], p[1]]))
                .collect(),
        );
        cursor = tail;
    }
    let elements: Vec<&[u16]> = owned.iter().map(Vec::as_slice).collect();
    let proofs: Vec<String> = String::from_utf8_lossy(cursor)
        .split('\n')
        .map(str::to_owned)
        .collect();
    if let Err(e) = verify_proofs_base64(&elements, dtype, &proofs, &params) {
        let _ = format!("{e} {e:?}");
    }
    if let Ok(honest) = build_proofs(&elements, dtype, &params) {
        // patterns >= 65497 (negative NaNs) wrap in GF(65497): documented reference
        // behaviour (vectors toploc README, `v_nan_payload`), so they are left out here
        let nan_wrap = owned.iter().flatten().any(|&b| u32::from(b) >= PRIME);
        if dtype == Dtype::Bf16 && !nan_wrap {
            let results = verify_proofs(&elements, dtype, &honest, &params).unwrap();
            for r in results {
                assert_eq!(r.exp_mismatches, 0, "{params:?}");
                assert_eq!(r.mant_err_mean, 0.0, "{params:?}");
            }
        }
    }
});
