//! `engy_core::payload::verify` (PROTOCOL.md §6) on arbitrary bytes, against the vectors'
//! master hotkey and netuid 53. Must never panic; when a body verifies, the returned facts
//! must be self-consistent (recomputed digest, weights within u16, determinism).
#![no_main]
use engy_core::payload::{sha256_hex, verify};
use libfuzzer_sys::fuzz_target;

/// The master hotkey of `tests/vectors/payloads` (public key only).
const MASTER: &str = "5F7ConTMzXkLvP1fcV5CybakMmGa6967sohaqGdg9DxQkTzU";

fuzz_target!(|data: &[u8]| {
    let first = verify(data, MASTER, 53);
    match &first {
        Ok(v) => {
            assert_eq!(v.netuid, 53);
            assert_eq!(v.digest, sha256_hex(v.result_json.as_bytes()));
        }
        Err(e) => {
            // Display and the reason word never panic.
            let _ = format!("{e} {e:?} {}", e.reason_word());
        }
    }
    // Verification is a pure function of the bytes.
    assert_eq!(first, verify(data, MASTER, 53));
});
