//! `ProofPoly::from_base64` / `from_bytes` (TOPLOC wire format, `tests/vectors/toploc/poly.json`)
//! on arbitrary input: never panics; a decoded proof re-encodes to the bytes it came from
//! (up to the ignored odd trailing byte) and evaluates inside the field.
#![no_main]
use engy_core::toploc::{ProofPoly, PRIME};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(p) = ProofPoly::from_bytes(data) {
        let even = data.len() & !1;
        assert_eq!(p.to_bytes(), data[..even].to_vec());
        let again = ProofPoly::from_base64(&p.to_base64()).unwrap();
        assert_eq!(again, p);
        for x in [0i64, 1, -1, i64::from(i32::MAX), i64::MIN, i64::MAX] {
            assert!(p.evaluate(x) < PRIME);
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        match ProofPoly::from_base64(text) {
            Ok(p) => {
                let again = ProofPoly::from_base64(&p.to_base64()).unwrap();
                assert_eq!(again, p);
            }
            Err(e) => {
                let _ = format!("{e} {e:?}");
            }
        }
    }
});
