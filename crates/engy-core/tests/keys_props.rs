//! Property tests: SS58 round trip for every encodable prefix, sr25519 sign → verify (and
//! tamper → reject), and `payload::verify` never panicking or accepting altered bodies.

use engy_core::keys::{
    ss58_decode, ss58_decode_prefix_42, ss58_encode, ss58_encode_with_prefix, verify_signature,
    Hotkey, Ss58Error,
};
use engy_core::payload::{build_result_json, sign_payload, verify};
use proptest::prelude::*;

fn prefix() -> impl Strategy<Value = u16> {
    (0u16..16384).prop_filter("reserved", |p| *p != 46 && *p != 47)
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(256) })]

    #[test]
    fn ss58_round_trip(pk in any::<[u8; 32]>(), p in prefix()) {
        let addr = ss58_encode_with_prefix(&pk, p).unwrap();
        prop_assert_eq!(ss58_decode(&addr).unwrap(), (p, pk));
        if p == 42 {
            prop_assert_eq!(&addr, &ss58_encode(&pk));
            prop_assert_eq!(ss58_decode_prefix_42(&addr).unwrap(), pk);
        } else {
            let is_unexpected_prefix = matches!(
                ss58_decode_prefix_42(&addr),
                Err(Ss58Error::UnexpectedPrefix { .. })
            );
            prop_assert!(is_unexpected_prefix);
        }
    }

    #[test]
    fn ss58_single_char_change_is_rejected(pk in any::<[u8; 32]>(), pos in any::<prop::sample::Index>(), c in prop::sample::select(b"123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz".to_vec())) {
        let addr = ss58_encode(&pk);
        let i = pos.index(addr.len());
        let mut bytes = addr.clone().into_bytes();
        prop_assume!(bytes[i] != c);
        bytes[i] = c;
        let changed = String::from_utf8(bytes).unwrap();
        // Either it fails to decode, or (vanishingly rare checksum collision) decodes to
        // another key; it never decodes to the same key.
        if let Ok((_, other)) = ss58_decode(&changed) {
            prop_assert_ne!(other, pk);
        }
    }

    #[test]
    fn sign_then_verify(seed in any::<[u8; 32]>(), msg in prop::collection::vec(any::<u8>(), 0..256), flip in any::<prop::sample::Index>()) {
        let hk = Hotkey::from_mini_secret(&seed).unwrap();
        let sig = hk.sign(&msg);
        prop_assert!(verify_signature(&hk.public_key(), &msg, &sig).is_ok());
        // Round trip through the 64-byte secret form.
        let again = Hotkey::from_secret_key_bytes(hk.secret_key_bytes().as_slice()).unwrap();
        prop_assert_eq!(again.public_key(), hk.public_key());
        prop_assert!(verify_signature(&hk.public_key(), &msg, &again.sign(&msg)).is_ok());
        // Any single flipped signature bit fails.
        let mut bad = sig;
        let bit = flip.index(512);
        bad[bit / 8] ^= 1 << (bit % 8);
        prop_assert!(verify_signature(&hk.public_key(), &msg, &bad).is_err());
    }

    #[test]
    fn verify_never_panics_on_arbitrary_bytes(body in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = verify(&body, "5F7ConTMzXkLvP1fcV5CybakMmGa6967sohaqGdg9DxQkTzU", 53);
    }

    #[test]
    fn altered_signed_body_never_verifies_differently(
        epoch in any::<u64>(),
        weights in prop::collection::vec(("[1-9A-HJ-NP-Za-km-z]{1,48}", any::<u16>()), 0..8),
        pos in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let master = Hotkey::from_mini_secret(&[42u8; 32]).unwrap();
        let rj = build_result_json(53, epoch, &weights);
        let body = sign_payload(&master, 53, epoch, &rj);
        let ok = verify(body.as_bytes(), &master.ss58(), 53).unwrap();
        prop_assert_eq!(ok.epoch_index, epoch);
        prop_assert_eq!(&ok.weights, &weights);
        let mut altered = body.into_bytes();
        let i = pos.index(altered.len());
        prop_assume!(altered[i] != byte);
        altered[i] = byte;
        // Whatever the change, a verified result must be the signed one (e.g. whitespace
        // or display-only fields may change), never different weights or epoch.
        if let Ok(v) = verify(&altered, &master.ss58(), 53) {
            prop_assert_eq!(v.epoch_index, epoch);
            prop_assert_eq!(&v.weights, &weights);
            prop_assert_eq!(&v.result_json, &rj);
        }
    }
}
