//! The miner's SSE reader (`engy_miner::scan::SseReader::next_event`, sglang-native-api.md
//! §2.7) over arbitrary bytes cut at arbitrary places. Never panics or hangs; every
//! chunking of the stream gives the same events (replies, rows, errors with their byte
//! offsets) as reading it whole; a cap never changes an event except into `TooLarge`; and
//! one `data:` line holding a JSON object or list (not `[DONE]`) reads as that value
//! scanned on its own.
#![no_main]
#[path = "common/miner.rs"]
mod common;

use common::{kind, ready, Chunked, Keep};
use engy_miner::scan::{HiddenMode, ReplySource, Reply, ScanError, SliceSource, SseReader, scan_reply};
use libfuzzer_sys::fuzz_target;

type Events = Vec<(Result<Option<Reply>, ScanError>, Keep)>;

/// Every event until the end, `[DONE]` or the first error (after which a reader's state
/// is not defined). Each event consumes at least one line, so there are at most
/// `len + 1` of them.
fn events<S: ReplySource>(src: S, cap: usize, mode: HiddenMode, text: bool, len: usize) -> Events {
    let mut rd = SseReader::new(src, cap);
    let mut out = Vec::new();
    loop {
        let mut keep = Keep::default();
        let r = ready(rd.next_event(mode, text, &mut keep));
        let stop = !matches!(r, Ok(Some(_)));
        out.push((r, keep));
        assert!(out.len() <= len + 2, "the reader does not advance");
        if stop {
            return out;
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [flags, n, rest @ ..] = data else {
        return;
    };
    let n = usize::from(*n % 8).min(rest.len());
    let (spec, stream) = rest.split_at(n);
    let mode = match flags % 3 {
        0 => HiddenMode::Always,
        1 => HiddenMode::IfFinished,
        _ => HiddenMode::Skip,
    };
    let text = flags & 4 != 0;
    let whole = events(SliceSource::new(stream), usize::MAX, mode, text, stream.len());
    let cut = events(Chunked::new(stream, spec), usize::MAX, mode, text, stream.len());
    assert_eq!(whole, cut, "chunking changed the events");

    // A cap: events within it are unchanged; the first one past it is TooLarge.
    let cap = 16 + usize::from(flags >> 3) * 8;
    let capped = events(Chunked::new(stream, spec), cap, mode, text, stream.len());
    for (i, (r, keep)) in capped.iter().enumerate() {
        match r {
            Err(ScanError::TooLarge { cap: c }) => {
                assert_eq!(*c, cap);
                assert_eq!(i + 1, capped.len());
            }
            _ => assert_eq!((r, keep), (&whole[i].0, &whole[i].1), "the cap changed event {i}"),
        }
    }

    // One `data:` line with a JSON object or list reads as that value scanned alone.
    if matches!(stream.first(), Some(b'{' | b'['))
        && !stream.contains(&b'\n')
        && !stream.starts_with(b"[DONE]")
    {
        let line = [b"data: ".as_slice(), stream, b"\n\ndata: [DONE]\n\n"].concat();
        let ev = events(SliceSource::new(&line), usize::MAX, HiddenMode::Always, text, line.len());
        let alone = scan_reply(stream, HiddenMode::Always, text);
        match (&ev[0].0, &alone) {
            (Ok(Some(a)), Ok(b)) => {
                let mut a = a.clone();
                if let Some(rows) = a.rows.as_mut() {
                    rows.bits = ev[0].1 .0.iter().flat_map(|(_, r)| r.iter().copied()).collect();
                }
                assert_eq!(&a, b, "an SSE event differs from its payload scanned alone");
            }
            (Err(a), Err(b)) => assert_eq!(kind(a), kind(b), "{a} vs {b}"),
            (a, b) => panic!("SSE event {a:?} but the payload alone gives {b:?}"),
        }
    }
});
