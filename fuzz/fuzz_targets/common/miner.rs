//! Helpers shared by the miner's fuzz targets (and mirrored in
//! `crates/engy-miner/tests/hardening_parsers.rs`): a byte source cut where the fuzzer
//! says, a poller for futures over in-memory sources, a row collector, and the slow
//! decimal → bf16 reference.
#![allow(dead_code)]
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use engy_miner::scan::{ReplySource, RowSink, ScanError};

/// A [`ReplySource`] over a slice that hands out `sizes[k % len]` bytes on its k-th read
/// (0 = a read that appends nothing, as a real socket may).
pub struct Chunked<'a> {
    rest: &'a [u8],
    sizes: Vec<usize>,
    k: usize,
}

impl<'a> Chunked<'a> {
    /// Chunk sizes from fuzzer bytes: 0..=15 → that many bytes (0 = an empty read), else
    /// up to 4 KiB; at least one size is non-zero so the source always makes progress.
    pub fn new(rest: &'a [u8], spec: &[u8]) -> Self {
        let mut sizes: Vec<usize> = spec
            .iter()
            .map(|&b| if b < 16 { usize::from(b) } else { usize::from(b) * 16 })
            .collect();
        if sizes.iter().all(|&s| s == 0) {
            sizes.push(1);
        }
        Self { rest, sizes, k: 0 }
    }
}

impl ReplySource for Chunked<'_> {
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
        if self.rest.is_empty() {
            return Ok(false);
        }
        let step = self.sizes[self.k % self.sizes.len()];
        self.k += 1;
        let (a, b) = self.rest.split_at(step.min(self.rest.len()));
        buf.extend_from_slice(a);
        self.rest = b;
        Ok(true)
    }
}

/// Poll a future over an in-memory source: it never waits.
pub fn ready<T>(f: impl Future<Output = T>) -> T {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("a scan over an in-memory source returned Pending"),
    }
}

/// Keeps every row handed to the sink, with its element index.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Keep(pub Vec<(usize, Vec<u16>)>);

impl RowSink for Keep {
    fn row(&mut self, element: usize, bits: &[u16]) {
        self.0.push((element, bits.to_vec()));
    }
}

/// The error's kind (its variant), for comparisons where the byte offset legitimately
/// differs (the same reply inside an SSE line starts later).
pub fn kind(e: &ScanError) -> std::mem::Discriminant<ScanError> {
    std::mem::discriminant(e)
}

/// The slow reference for one hidden value: Rust's `str::parse::<f64>()`, `as f32`, then
/// round-to-nearest-even to bf16 by comparing the two neighbouring bf16 values exactly
/// (in f64). `None` when the text does not parse or the float32 is not finite.
pub fn reference_bf16(text: &str) -> Option<u16> {
    let v = text.parse::<f64>().ok()? as f32;
    if !v.is_finite() {
        return None;
    }
    let bits = v.to_bits();
    let sign = bits & 0x8000_0000;
    let mag = bits & 0x7FFF_FFFF;
    let lo = mag & 0xFFFF_0000;
    let hi = lo + 0x1_0000;
    // The value of a magnitude pattern; 0x7F80_0000 stands for 2^128, the next step up
    // from the largest finite bf16 (IEEE rounds to infinity past half of it).
    let val = |m: u32| -> f64 {
        if m >= 0x7F80_0000 {
            2f64.powi(128)
        } else {
            f64::from(f32::from_bits(m))
        }
    };
    let x = val(mag);
    let (below, above) = (x - val(lo), val(hi) - x);
    let m = if below < above || (below == above && (lo >> 16) & 1 == 0) {
        lo
    } else {
        hi
    };
    Some(((sign | m) >> 16) as u16)
}

/// Whether `t` is a JSON number (RFC 8259 §6): `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
pub fn is_json_number(t: &str) -> bool {
    let b = t.as_bytes();
    let mut i = 0;
    let digits = |i: &mut usize| {
        let s = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i > s
    };
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            digits(&mut i);
        }
        _ => return false,
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if !digits(&mut i) {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if !digits(&mut i) {
            return false;
        }
    }
    i == b.len()
}
