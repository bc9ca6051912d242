//! Property tests of `engy_core::trace` (docs/PROTOCOL.md §3.10): sglang's int32 form →
//! compact trace → ids is the identity, the id width is the smallest that holds the ids,
//! a trace survives JSON, and any change to its bytes is a typed error, never a panic.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use engy_core::trace::{sglang_int32, sglang_int32_base64, Trace, TraceError};
use engy_core::wire::{Commitment, ToplocCommitment};
use proptest::prelude::*;

/// (layers, width, ids, padded): ids a whole number of rows; routing ids ≥ 0, padded ids ≥ -1,
/// drawn from a few magnitudes so every id width occurs.
fn traces() -> impl Strategy<Value = (u64, u64, Vec<i32>, bool)> {
    (1u64..6, 1u64..5, 0usize..7, any::<bool>(), 0u8..3).prop_flat_map(
        |(layers, width, rows, padded, scale)| {
            let n = (layers * width) as usize * rows;
            let hi: i32 = match scale {
                0 => 256,
                1 => 70_000,
                _ => i32::MAX,
            };
            let lo = if padded { -1 } else { 0 };
            prop::collection::vec(lo..hi, n).prop_map(move |ids| (layers, width, ids, padded))
        },
    )
}

proptest! {
    #[test]
    fn encode_then_decode_is_the_identity((layers, width, ids, padded) in traces(), start in 0u64..1_000_000) {
        let t = Trace::encode(start, layers, width, &ids, padded).unwrap();
        let d = t.decode().unwrap();
        prop_assert_eq!(&d.ids, &ids);
        prop_assert_eq!(d.start, start);
        prop_assert_eq!(d.rows as u64 * layers * width, ids.len() as u64);
        // The smallest width of 1, 2, 4 bytes that holds every stored value.
        let shift = i64::from(padded);
        let max = ids.iter().map(|v| i64::from(*v) + shift).max().unwrap_or(0);
        let want = if max <= 0xFF { 1 } else if max <= 0xFFFF { 2 } else { 4 };
        prop_assert_eq!(t.id_bytes, want);
        prop_assert_eq!(B64.decode(&t.ids).unwrap().len(), ids.len() * usize::from(want));
        // Through JSON, as a commitment carries it.
        let back: Trace = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
        prop_assert_eq!(back, t);
    }

    #[test]
    fn sglang_int32_round_trips((layers, width, ids, _padded) in traces()) {
        let b64 = sglang_int32_base64(&ids);
        prop_assert_eq!(sglang_int32(&b64, layers, width).unwrap(), ids);
    }

    #[test]
    fn a_changed_byte_or_shape_is_an_error_not_a_panic(
        (layers, width, ids, padded) in traces(),
        flip in any::<prop::sample::Index>(),
        bit in 0u8..8,
        field in 0u8..5,
    ) {
        let t = Trace::encode(0, layers, width, &ids, padded).unwrap();
        let mut bad = t.clone();
        match field {
            0 => {
                // Flip one bit of the packed ids (digest left as it was).
                let mut bytes = B64.decode(&t.ids).unwrap();
                if bytes.is_empty() { return Ok(()); }
                let i = flip.index(bytes.len());
                bytes[i] ^= 1 << bit;
                bad.ids = B64.encode(bytes);
                let digest = matches!(bad.decode(), Err(TraceError::Digest { .. }));
                prop_assert!(digest);
            }
            1 => {
                bad.rows += 1;
                let length = matches!(bad.decode(), Err(TraceError::Length { .. }));
                prop_assert!(length);
            }
            2 => {
                bad.id_bytes = [3u8, 0, 8][flip.index(3)];
                prop_assert!(matches!(bad.decode(), Err(TraceError::IdBytes(_))));
            }
            3 => {
                bad.ids.insert(0, '*');
                prop_assert!(bad.decode().is_err());
            }
            _ => {
                bad.width = 0;
                prop_assert!(matches!(bad.decode(), Err(TraceError::Shape(_))));
            }
        }
    }

    #[test]
    fn arbitrary_traces_never_panic(
        rows in any::<u64>(), layers in any::<u64>(), width in any::<u64>(),
        id_bytes in any::<u8>(), padded in any::<bool>(), ids in "[A-Za-z0-9+/=]{0,64}",
        sha in "[0-9a-f]{0,64}",
    ) {
        let t = Trace { start: 0, rows, layers, width, id_bytes, padded, ids, sha256: sha };
        let _ = t.decode();
    }
}

/// A commitment without traces serialises exactly as before the fields existed, and one
/// with a trace carries it under `routing`.
#[test]
fn commitments_without_traces_are_unchanged() {
    let c = Commitment {
        model_root: "r".into(),
        output_token_ids: vec![1, 2],
        toploc: ToplocCommitment {
            proofs: vec!["p".into()],
            topk: 128,
            decode_batching_size: 32,
            skip_prefill: true,
            n_tokens: 2,
            prompt_ids: vec![9],
        },
        routing: None,
        indexer_topk: None,
        cells: None,
    };
    let text = serde_json::to_string(&c).unwrap();
    assert_eq!(
        text,
        r#"{"model_root":"r","output_token_ids":[1,2],"toploc":{"proofs":["p"],"topk":128,"decode_batching_size":32,"skip_prefill":true,"n_tokens":2,"prompt_ids":[9]}}"#
    );
    let old: Commitment = serde_json::from_str(&text).unwrap();
    assert_eq!(old, c);
    let mut with = c;
    with.routing = Some(Trace::encode(0, 1, 2, &[3, 4, 5, 6], false).unwrap());
    let v: serde_json::Value = serde_json::to_value(&with).unwrap();
    assert_eq!(v["routing"]["rows"], 2);
    assert_eq!(v["routing"]["id_bytes"], 1);
    assert!(v.get("indexer_topk").is_none());
}
