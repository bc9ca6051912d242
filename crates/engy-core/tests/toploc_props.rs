//! Property tests of `engy_core::toploc`: wire round trips, build→verify agreement and the
//! top-k contract.

use engy_core::toploc::{
    bf16_bits_to_f32, build_proofs, build_proofs_base64, select_topk, verify_proofs,
    verify_proofs_base64, Dtype, Params, ProofPoly, PRIME,
};
use proptest::prelude::*;

/// bf16 patterns biased towards ties, zeros, infinities and NaN.
fn bf16_bits() -> impl Strategy<Value = u16> {
    prop_oneof![
        6 => any::<u16>(),
        2 => (0u16..8).prop_map(|v| 0x3F80 + v),     // a few close values: many ties
        1 => prop_oneof![Just(0x0000u16), Just(0x8000), Just(0x7F80), Just(0xFF80)],
        1 => prop_oneof![Just(0x7FC0u16), Just(0xFFC0), Just(0xFFFF), Just(0x7F81)],
    ]
}

fn proof_poly() -> impl Strategy<Value = ProofPoly> {
    (any::<u16>(), prop::collection::vec(any::<u16>(), 0..200))
        .prop_map(|(modulus, coeffs)| ProofPoly { modulus, coeffs })
}

fn activations() -> impl Strategy<Value = (Vec<Vec<u16>>, Params)> {
    (1usize..40, 1usize..6, 1usize..10, any::<bool>()).prop_flat_map(|(hidden, dbs, n, skip)| {
        let topk_max = hidden.min(24);
        (
            prop::collection::vec(prop::collection::vec(bf16_bits(), hidden), n),
            1..=topk_max,
        )
            .prop_map(move |(rows, topk)| {
                (
                    rows,
                    Params {
                        topk,
                        decode_batching_size: dbs,
                        skip_prefill: skip,
                    },
                )
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn bytes_and_base64_round_trip(p in proof_poly()) {
        let bytes = p.to_bytes();
        prop_assert_eq!(bytes.len(), 2 + 2 * p.coeffs.len());
        prop_assert_eq!(&ProofPoly::from_bytes(&bytes).unwrap(), &p);
        let b64 = p.to_base64();
        prop_assert_eq!(&ProofPoly::from_base64(&b64).unwrap(), &p);
        // Unpadded input is accepted (decoding stops at the first '=').
        prop_assert_eq!(&ProofPoly::from_base64(b64.trim_end_matches('=')).unwrap(), &p);
        // A trailing odd byte is ignored.
        let mut odd = bytes.clone();
        odd.push(0xAB);
        prop_assert_eq!(&ProofPoly::from_bytes(&odd).unwrap(), &p);
    }

    #[test]
    fn interpolation_passes_through_points(
        xs in prop::collection::btree_set(0i64..200_000, 1..40),
        seed in any::<u64>(),
    ) {
        let x: Vec<i64> = xs.into_iter().collect();
        let y: Vec<i64> = x.iter().enumerate()
            .map(|(i, _)| (seed.wrapping_mul(i as u64 + 1) >> 17) as i64 % 70_000)
            .collect();
        let p = ProofPoly::from_points(&x, &y).unwrap();
        prop_assert_eq!(p.coeffs.len(), x.len());
        prop_assert!(p.coeffs.iter().all(|&c| u32::from(c) < PRIME));
        let m = i64::from(p.modulus);
        let mut residues: Vec<i64> = x.iter().map(|v| v % m).collect();
        residues.sort_unstable();
        residues.dedup();
        prop_assert_eq!(residues.len(), x.len());
        for (&xi, &yi) in x.iter().zip(&y) {
            prop_assert_eq!(i64::from(p.evaluate(xi % m)), yi.rem_euclid(i64::from(PRIME)));
        }
    }

    #[test]
    fn build_then_verify_is_exact((rows, params) in activations()) {
        let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
        let proofs = build_proofs(&elements, Dtype::Bf16, &params).unwrap();
        let results = verify_proofs(&elements, Dtype::Bf16, &proofs, &params).unwrap();
        prop_assert_eq!(results.len(), proofs.len());
        // Bit patterns >= 65497 (negative NaNs 0xFFD9..=0xFFFF) wrap mod 65497 in the
        // proof, so a batch whose top-k holds one cannot verify exactly (vectors README
        // "Building the polynomial" item 4); every other batch must give (0, 0, 0).
        let b64 = build_proofs_base64(&elements, Dtype::Bf16, &params).unwrap();
        let again = verify_proofs_base64(&elements, Dtype::Bf16, &b64, &params).unwrap();
        prop_assert_eq!(&again, &results);
        let batches = engy_core::toploc::batch_ranges(elements.len(), &params).unwrap();
        for (range, r) in batches.into_iter().zip(&results) {
            let flat: Vec<u16> = elements[range].concat();
            let idx = select_topk(&flat, Dtype::Bf16, params.topk).unwrap();
            let wraps = idx.iter().any(|&i| u32::from(flat[i as usize]) >= PRIME);
            if !wraps {
                prop_assert_eq!(r.exp_mismatches, 0);
                prop_assert_eq!(r.mant_err_mean, 0.0);
                prop_assert_eq!(r.mant_err_median, 0.0);
            }
        }
    }

    #[test]
    fn topk_is_distinct_and_sorted_by_magnitude(
        bits in prop::collection::vec(bf16_bits(), 1..3000),
        k_frac in 0.0f64..1.0,
    ) {
        let k = ((bits.len() as f64 * k_frac) as usize).clamp(1, bits.len());
        let idx = select_topk(&bits, Dtype::Bf16, k).unwrap();
        prop_assert_eq!(idx.len(), k);
        let mut sorted = idx.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), k);
        // Magnitude order with NaN first (torch's `before`); the k-th is >= every unselected.
        // NaN ranks above +inf, which ranks above every finite magnitude.
        let rank = |i: u32| -> f64 {
            let v = bf16_bits_to_f32(bits[i as usize]).abs();
            if v.is_nan() {
                f64::INFINITY
            } else if v.is_infinite() {
                f64::MAX
            } else {
                f64::from(v)
            }
        };
        for w in idx.windows(2) {
            prop_assert!(rank(w[0]) >= rank(w[1]), "not descending at {:?}", w);
        }
        let last = rank(*idx.last().unwrap());
        for i in 0..bits.len() as u32 {
            if !idx.contains(&i) {
                prop_assert!(last >= rank(i));
            }
        }
    }
}

#[test]
fn float16_builds_but_does_not_verify() {
    // float16 bit patterns are accepted as proof values (vectors `float16_input`); the
    // reference's verify reads only bfloat16 fields and raises, so ours refuses.
    let rows: Vec<Vec<u16>> = (0..3u16)
        .map(|r| (0..64u16).map(|i| 0x3C00 ^ (i * 37 + r * 11)).collect())
        .collect();
    let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
    let params = Params {
        topk: 8,
        decode_batching_size: 2,
        skip_prefill: true,
    };
    let proofs = build_proofs(&elements, Dtype::F16, &params).unwrap();
    assert_eq!(proofs.len(), 2);
    assert!(matches!(
        verify_proofs(&elements, Dtype::F16, &proofs, &params),
        Err(engy_core::toploc::ToplocError::UnsupportedDtype { .. })
    ));
    assert!(matches!(
        Dtype::from_torch_name("float32"),
        Err(engy_core::toploc::ToplocError::UnsupportedDtype { .. })
    ));
}

#[test]
fn verify_refuses_null_and_miscounted_proofs() {
    use engy_core::toploc::ToplocError;
    let rows: Vec<Vec<u16>> = (0..4u16)
        .map(|r| (0..64u16).map(|i| 0x3F80 + ((i * 13 + r) % 100)).collect())
        .collect();
    let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
    let params = Params {
        topk: 8,
        decode_batching_size: 2,
        skip_prefill: true,
    };
    let mut proofs = build_proofs(&elements, Dtype::Bf16, &params).unwrap();
    assert_eq!(
        verify_proofs(&elements, Dtype::Bf16, &proofs[..1], &params),
        Err(ToplocError::ProofCountMismatch {
            proofs: 1,
            batches: 2
        })
    );
    proofs[1] = ProofPoly::null(8);
    assert_eq!(
        verify_proofs(&elements, Dtype::Bf16, &proofs, &params),
        Err(ToplocError::NullProof { index: 1 })
    );
}
