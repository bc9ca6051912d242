//! The miner's hidden-state hot path (issue 7), measured in CPU time of the bench thread:
//!
//! * `convert/f32_to_bf16`: float32 → bf16 bits (32 × 2048 values).
//! * `topk/select_topk`: torch-order top-128 of |x| over one 32 × 2048 batch.
//! * `proof/build`, `proof/verify`: one 32-row batch at topk 128 (hidden 2048 and 6144).
//! * `ingest/json`, `ingest/sse`: scan only (rows dropped), from raw reply bytes.
//! * `ingest_prove/json`, `ingest_prove/sse`: the miner's real request path, raw bytes →
//!   finished proofs ([`ProofAcc`]), at 1,024 and 4,096 tokens × hidden 2,048 and 6,144.
//!
//! Replies are generated as sglang's orjson writes them (see `support`) and fed in 64 KiB
//! chunks as they are generated, like a socket; throughput is in tokens (elements).
//! Targets (docs/PERFORMANCE.md): ingest+prove ≥ 30,000 tokens per CPU-second at hidden
//! 2048, ≥ 10,000 at 6144; proof build/verify ≤ 100 µs at 32 × 2048.
//!
//! `cargo bench -p engy-miner --bench ingest` (filter e.g. `-- ingest_prove/json`).
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use engy_core::toploc::{
    bf16_bits_to_f32, build_proofs, build_proofs_base64, f32_to_bf16_bits, select_topk,
    verify_proofs, Dtype, Params,
};
use engy_miner::proof::ProofAcc;
use engy_miner::scan::decimal::parse_bf16;
use engy_miner::scan::{
    scan_reply, scan_reply_from, DropRows, HiddenMode, ReplySource, RowSink, ScanError, SseReader,
};

mod support;
use support::{CpuTime, Reply};

const CHUNK: usize = 1 << 16;

struct Gen<'a>(support::Chunks<'a>);

impl ReplySource for Gen<'_> {
    async fn read_into(&mut self, buf: &mut Vec<u8>) -> Result<bool, ScanError> {
        Ok(self.0.fill(buf))
    }
}

/// Run a future whose source is always ready.
fn ready<T>(f: impl std::future::Future<Output = T>) -> T {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
}

/// Scan one reply into `sink`; returns the number of rows.
fn ingest(reply: &Reply, stream: bool, sink: &mut dyn RowSink) -> usize {
    let src = Gen(reply.chunks(CHUNK));
    let r = if stream {
        let mut rd = SseReader::new(src, usize::MAX);
        ready(rd.next_event(HiddenMode::IfFinished, true, sink))
    } else {
        ready(scan_reply_from(
            src,
            HiddenMode::Always,
            false,
            usize::MAX,
            sink,
        ))
        .map(Some)
    };
    r.ok()
        .flatten()
        .and_then(|r| r.rows)
        .map_or(0, |rows| rows.n_rows)
}

fn ingest_prove(reply: &Reply, stream: bool) -> usize {
    let mut acc = ProofAcc::new(Params::ENGY);
    ingest(reply, stream, &mut acc);
    acc.finish().map_or(0, |p| p.len())
}

/// 32 rows × `hidden` of realistic bf16 values, via the generated JSON.
fn batch_rows(hidden: usize) -> Vec<u16> {
    let json = Reply::new(32, hidden, false).to_vec();
    scan_reply(&json, HiddenMode::Always, false)
        .ok()
        .and_then(|r| r.rows)
        .map(|r| r.bits)
        .unwrap_or_default()
}

fn small(c: &mut Criterion<CpuTime>) {
    let params = Params::ENGY;
    let bits = batch_rows(2048);
    let floats: Vec<f32> = bits.iter().map(|b| bf16_bits_to_f32(*b) * 1.001).collect();
    let mut g = c.benchmark_group("convert");
    g.throughput(Throughput::Elements(floats.len() as u64));
    g.bench_function("f32_to_bf16/32x2048", |b| {
        let mut out = Vec::with_capacity(floats.len());
        b.iter(|| {
            out.clear();
            out.extend(black_box(&floats).iter().map(|x| f32_to_bf16_bits(*x)));
            black_box(&out);
        })
    });
    g.finish();

    // One decimal → bf16 conversion per hidden value: the SWAR fast path against the exact
    // parser it falls back to (fast-float2 → f32 → bf16). "normal": 32 rows of the
    // generated replies (σ ≈ 1, mostly `-0.1640625`); "wide": bf16 values spread evenly
    // over the binades 2^-10..2^4 as the sglang double's synthetic backend serves them
    // (long fractions like `0.00194549560546875`, two integer digits).
    let wide: Vec<u16> = (0..bits.len() as u64)
        .map(|i| {
            let r = i.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
            let v = (128 + (r >> 8) % 128) as f32 * 2f32.powi((r >> 16) as i32 % 14 - 17);
            f32_to_bf16_bits(if r & 1 == 1 { -v } else { v })
        })
        .collect();
    let mut g = c.benchmark_group("decimal");
    for (name, vals) in [("normal", &bits), ("wide", &wide)] {
        let mut text = Vec::new();
        for b in vals {
            let _ = serde_json::to_writer(&mut text, &f64::from(bf16_bits_to_f32(*b)));
            text.push(b',');
        }
        text.extend_from_slice(&[b' '; 64]);
        g.throughput(Throughput::Elements(vals.len() as u64));
        g.bench_function(format!("parse_bf16/{name}_32x2048"), |b| {
            b.iter(|| {
                let (mut i, mut acc) = (0usize, 0u32);
                for _ in 0..vals.len() {
                    let rest = text.get(i..).unwrap_or_default();
                    let (v, n) = match parse_bf16(rest) {
                        Some(r) => r,
                        None => match fast_float2::parse_partial::<f64, _>(rest) {
                            Ok((v, n)) => (f32_to_bf16_bits(v as f32), n),
                            Err(_) => break,
                        },
                    };
                    acc = acc.wrapping_add(u32::from(v));
                    i += n + 1;
                }
                black_box(acc)
            })
        });
        g.bench_function(format!("fast_float2/{name}_32x2048"), |b| {
            b.iter(|| {
                let (mut i, mut acc) = (0usize, 0u32);
                for _ in 0..vals.len() {
                    let Some(Ok((v, n))) = text.get(i..).map(fast_float2::parse_partial::<f64, _>)
                    else {
                        break;
                    };
                    acc = acc.wrapping_add(u32::from(f32_to_bf16_bits(v as f32)));
                    i += n + 1;
                }
                black_box(acc)
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("topk");
    g.bench_function("select_topk/32x2048_k128", |b| {
        b.iter(|| select_topk(black_box(&bits), Dtype::Bf16, 128))
    });
    g.finish();

    let mut g = c.benchmark_group("proof");
    for hidden in [2048usize, 6144] {
        let bits = batch_rows(hidden);
        let elements: Vec<&[u16]> = bits.chunks_exact(hidden).collect();
        let proofs = build_proofs(&elements, Dtype::Bf16, &params).unwrap_or_default();
        g.bench_with_input(
            BenchmarkId::new("build_32rows_k128", hidden),
            &elements,
            |b, e| b.iter(|| build_proofs(black_box(e), Dtype::Bf16, &params)),
        );
        g.bench_with_input(
            BenchmarkId::new("verify_32rows_k128", hidden),
            &elements,
            |b, e| b.iter(|| verify_proofs(black_box(e), Dtype::Bf16, black_box(&proofs), &params)),
        );
    }
    g.finish();
}

fn whole(c: &mut Criterion<CpuTime>) {
    // The streamed proofs are exactly the proofs of all rows at once.
    let check = Reply::new(100, 2048, false);
    let json = check.to_vec();
    let rows = scan_reply(&json, HiddenMode::Always, false)
        .ok()
        .and_then(|r| r.rows)
        .unwrap_or_default();
    let elements: Vec<&[u16]> = rows.bits.chunks_exact(2048).collect();
    let want = build_proofs_base64(&elements, Dtype::Bf16, &Params::ENGY).unwrap_or_default();
    assert_eq!(want.len(), 4);
    for stream in [false, true] {
        let mut acc = ProofAcc::new(Params::ENGY);
        ingest(&Reply::new(100, 2048, stream), stream, &mut acc);
        let got = acc.finish().unwrap_or_default();
        assert_eq!(got, want, "streamed proofs differ");
    }

    for (group, prove) in [("ingest", false), ("ingest_prove", true)] {
        let mut g = c.benchmark_group(group);
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));
        for hidden in [2048usize, 6144] {
            for tokens in [1024usize, 4096] {
                for stream in [false, true] {
                    let reply = Reply::new(tokens, hidden, stream);
                    g.throughput(Throughput::Elements(tokens as u64));
                    let id = BenchmarkId::new(
                        if stream { "sse" } else { "json" },
                        format!("{tokens}x{hidden}"),
                    );
                    g.bench_function(id, |b| {
                        b.iter(|| {
                            let n = if prove {
                                ingest_prove(&reply, stream)
                            } else {
                                ingest(&reply, stream, &mut DropRows)
                            };
                            assert!(n > 0);
                            n
                        })
                    });
                }
            }
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(CpuTime);
    targets = small, whole
}
criterion_main!(benches);
