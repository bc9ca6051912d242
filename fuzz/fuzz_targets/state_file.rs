//! The validator's state file reader (PROTOCOL.md §7 step 9) on arbitrary bytes: it never
//! fails or panics, and what it reads survives the writer's format unchanged (so a state
//! read and written back never loses or alters a field).
#![no_main]
use engy_validator::state::State;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let st = State::from_bytes(data);
    if let Some(b) = st.last_submit_block {
        assert!(b > 0);
    }
    if let Some(d) = &st.cached_digest {
        assert!(d.len() == 64 && d.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
    }
    let bytes = serde_json::to_vec_pretty(&st.to_json()).unwrap();
    assert_eq!(State::from_bytes(&bytes), st, "state does not round-trip");
});
