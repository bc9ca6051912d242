//! The miner's `/generate` reply scanner (`engy_miner::scan::scan_reply`, and the
//! streaming `scan_reply_from` with arbitrary chunk splits; sglang-native-api.md §2.2–§2.6)
//! on arbitrary bytes. Never panics or hangs; every chunking gives exactly the result of
//! the whole reply (the same reply and rows, or the same error at the same byte); a cap at
//! least the reply's length changes nothing.
#![no_main]
#[path = "common/miner.rs"]
mod common;

use common::{ready, Chunked, Keep};
use engy_miner::scan::{scan_reply, scan_reply_from, HiddenMode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [flags, n, rest @ ..] = data else {
        return;
    };
    let n = usize::from(*n % 8).min(rest.len());
    let (spec, body) = rest.split_at(n);
    let mode = match flags % 3 {
        0 => HiddenMode::Always,
        1 => HiddenMode::IfFinished,
        _ => HiddenMode::Skip,
    };
    let text = flags & 4 != 0;
    let whole = scan_reply(body, mode, text);
    assert_eq!(whole, scan_reply(body, mode, text), "not deterministic");
    for cap in [usize::MAX, body.len()] {
        let mut keep = Keep::default();
        let cut = ready(scan_reply_from(Chunked::new(body, spec), mode, text, cap, &mut keep));
        let cut = cut.map(|mut r| {
            if let Some(rows) = r.rows.as_mut() {
                assert_eq!(rows.n_rows, keep.0.len(), "every kept row reaches the sink");
                rows.bits = keep.0.iter().flat_map(|(_, b)| b.iter().copied()).collect();
            }
            r
        });
        assert_eq!(cut, whole, "chunking (cap {cap}) changed the result");
    }
});
