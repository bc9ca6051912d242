//! SS58 decoding (PROTOCOL.md §2, `tests/vectors/keys/ss58.json`) on arbitrary text. An
//! address that decodes must re-encode to exactly the same text (no malleable spellings of
//! one key), and the three decoders must agree.
#![no_main]
use engy_core::keys::{
    ss58_decode, ss58_decode_any_prefix, ss58_decode_prefix_42, ss58_encode_with_prefix,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let full = ss58_decode(text);
    let any = ss58_decode_any_prefix(text);
    let p42 = ss58_decode_prefix_42(text);
    match &full {
        Ok((prefix, pk)) => {
            assert_eq!(
                ss58_encode_with_prefix(pk, *prefix).as_deref(),
                Ok(text),
                "decoded address does not re-encode to itself"
            );
            if let Ok(k) = &any {
                assert_eq!(k, pk);
            }
            if *prefix == 42 {
                assert_eq!(p42.as_ref().ok(), Some(pk));
            } else {
                assert!(p42.is_err());
            }
        }
        Err(e) => {
            let _ = format!("{e} {e:?}");
            assert!(p42.is_err());
        }
    }
});
