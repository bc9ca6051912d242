//! The miner's hidden-state parser (`engy_miner::scan::scan_reply` /`scan_reply_from`,
//! sglang-native-api.md §2.6.4, PROTOCOL.md §3.8) on `hidden_states` built from fuzzer
//! bytes: elements that are empty, 1-D rows or 2-D blocks of number-like tokens.
//!
//! * a parsed reply keeps exactly one row per non-empty element (a block's LAST row), and
//!   each kept value equals the slow reference: Rust `str::parse::<f64>() as f32`, then
//!   round-to-nearest-even to bf16;
//! * a reply whose every token is a JSON number of < 64 bytes with a finite float32 value
//!   parses;
//! * any chunking gives exactly the whole reply's result; inside an SSE `data:` line the
//!   result is the same (errors of the same kind).
#![no_main]
#[path = "common/miner.rs"]
mod common;

use common::{is_json_number, kind, ready, reference_bf16, Chunked, Keep};
use engy_miner::scan::{scan_reply, scan_reply_from, HiddenMode, SseReader};
use libfuzzer_sys::fuzz_target;

const ALPHABET: &[u8] = b"0123456789.-eE+0123456789x";

enum Elem {
    Empty,
    Row(Vec<String>),
    Block(Vec<Vec<String>>),
}

fn build(prog: &[u8]) -> Vec<Elem> {
    let mut elems = Vec::new();
    let mut rows: Vec<Vec<String>> = vec![Vec::new()];
    let mut block = false;
    let mut tok = String::new();
    let finish = |elems: &mut Vec<Elem>, rows: &mut Vec<Vec<String>>, block: &mut bool, tok: &mut String| {
        if !tok.is_empty() {
            rows.last_mut().unwrap().push(std::mem::take(tok));
        }
        let taken = std::mem::replace(rows, vec![Vec::new()]);
        if *block {
            elems.push(Elem::Block(taken));
        } else {
            let row = taken.into_iter().next().unwrap();
            elems.push(if row.is_empty() { Elem::Empty } else { Elem::Row(row) });
        }
        *block = false;
    };
    for &b in prog {
        match b {
            0xF0 => rows.last_mut().unwrap().push(std::mem::take(&mut tok)),
            0xF1 => finish(&mut elems, &mut rows, &mut block, &mut tok),
            0xF2 => {
                if !tok.is_empty() {
                    rows.last_mut().unwrap().push(std::mem::take(&mut tok));
                }
                if block {
                    rows.push(Vec::new());
                }
                block = true;
            }
            0xF3 => {
                finish(&mut elems, &mut rows, &mut block, &mut tok);
                elems.push(Elem::Empty);
            }
            _ => tok.push(char::from(ALPHABET[usize::from(b) % ALPHABET.len()])),
        }
    }
    if !tok.is_empty() || block || rows.iter().any(|r| !r.is_empty()) {
        finish(&mut elems, &mut rows, &mut block, &mut tok);
    }
    // A row of one empty token prints as `[]`: it is an empty row (or element).
    let norm = |r: &mut Vec<String>| {
        if r.len() == 1 && r[0].is_empty() {
            r.clear();
        }
    };
    for e in &mut elems {
        match e {
            Elem::Row(r) => {
                norm(r);
                if r.is_empty() {
                    *e = Elem::Empty;
                }
            }
            Elem::Block(rs) => rs.iter_mut().for_each(norm),
            Elem::Empty => {}
        }
    }
    elems
}

fuzz_target!(|data: &[u8]| {
    let [flags, n, rest @ ..] = data else {
        return;
    };
    let n = usize::from(*n % 8).min(rest.len());
    let (spec, prog) = rest.split_at(n);
    let elems = build(prog);
    let (sep, pad) = if flags & 1 == 0 { (",", "") } else { (", ", " ") };
    let row = |r: &Vec<String>| format!("[{pad}{}{pad}]", r.join(sep));
    let hs: Vec<String> = elems
        .iter()
        .map(|e| match e {
            Elem::Empty => "[]".to_string(),
            Elem::Row(r) => row(r),
            Elem::Block(rs) => format!("[{}]", rs.iter().map(row).collect::<Vec<_>>().join(sep)),
        })
        .collect();
    let hs = format!("[{}]", hs.join(sep));
    let body = if flags & 2 == 0 {
        format!(r#"{{"meta_info":{{"hidden_states":{hs}}}}}"#)
    } else {
        format!(
            r#"[{{"text":"x","output_ids":[1,2],"meta_info":{{"id":"r","finish_reason":{{"type":"length","length":2}},"hidden_states":{hs},"e2e_latency":0.1}}}}]"#
        )
    };
    let body = body.as_bytes();

    // What the reference says: the kept row of each non-empty element, per token.
    let kept: Vec<&Vec<String>> = elems
        .iter()
        .filter_map(|e| match e {
            Elem::Empty => None,
            Elem::Row(r) => Some(r),
            Elem::Block(rs) => rs.last(),
        })
        .collect();
    let all_tokens = || {
        elems.iter().flat_map(|e| match e {
            Elem::Empty => Vec::new(),
            Elem::Row(r) => r.iter().collect(),
            Elem::Block(rs) => rs.iter().flatten().collect(),
        })
    };
    let valid = all_tokens().all(|t| is_json_number(t) && t.len() < 64 && reference_bf16(t).is_some());

    let whole = scan_reply(body, HiddenMode::Always, true);
    match &whole {
        Ok(r) => {
            for t in all_tokens() {
                assert!(reference_bf16(t).is_some(), "accepted {t:?}, which the reference rejects");
            }
            let rows = r.rows.as_ref().expect("hidden_states were parsed");
            let want: Vec<u16> = kept
                .iter()
                .flat_map(|r| r.iter().map(|t| reference_bf16(t).unwrap()))
                .collect();
            assert_eq!(rows.bits, want, "rows differ from the reference");
            assert_eq!(rows.n_rows, kept.len());
            assert_eq!(rows.n_elements, elems.len());
            let lead = elems.iter().take_while(|e| matches!(e, Elem::Empty)).count();
            assert_eq!(rows.offset, lead);
        }
        Err(e) => assert!(!valid, "a valid reply was refused: {e}"),
    }

    let mut keep = Keep::default();
    let cut = ready(scan_reply_from(Chunked::new(body, spec), HiddenMode::Always, true, usize::MAX, &mut keep));
    let cut = cut.map(|mut r| {
        if let Some(rows) = r.rows.as_mut() {
            rows.bits = keep.0.iter().flat_map(|(_, b)| b.iter().copied()).collect();
        }
        r
    });
    assert_eq!(cut, whole, "chunking changed the result");

    let line = [b"data: ".as_slice(), body, b"\n\n"].concat();
    let mut rd = SseReader::new(Chunked::new(&line, spec), usize::MAX);
    let mut keep = Keep::default();
    match (ready(rd.next_event(HiddenMode::Always, true, &mut keep)), &whole) {
        (Ok(Some(mut a)), Ok(b)) => {
            if let Some(rows) = a.rows.as_mut() {
                rows.bits = keep.0.iter().flat_map(|(_, b)| b.iter().copied()).collect();
            }
            assert_eq!(&a, b, "the SSE event differs from the body");
        }
        (Err(a), Err(b)) => assert_eq!(kind(&a), kind(b), "{a} vs {b}"),
        (a, b) => panic!("SSE event {a:?} but the body gives {b:?}"),
    }
});
