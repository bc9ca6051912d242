//! TOPLOC build/verify speed at engy's realistic shapes: one decode batch of 32 rows of
//! hidden 2048 or 6144, topk 128 (the partial_sort top-k path). Target: build ≤ 100 µs
//! and verify similar for 32×2048.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use engy_core::toploc::{build_proofs, f32_to_bf16_bits, verify_proofs, Dtype, Params};

/// Deterministic pseudo-normal-ish activations as bf16 rows.
fn rows(n_rows: usize, hidden: usize, seed: u64) -> Vec<Vec<u16>> {
    let mut s = seed;
    let mut next = || {
        s = s
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    (0..n_rows)
        .map(|_| {
            (0..hidden)
                .map(|_| f32_to_bf16_bits((next() + next() + next()) * 3.0))
                .collect()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let params = Params::ENGY;
    let mut group = c.benchmark_group("toploc");
    for hidden in [2048usize, 6144] {
        let data = rows(32, hidden, hidden as u64);
        let elements: Vec<&[u16]> = data.iter().map(Vec::as_slice).collect();
        let proofs = build_proofs(&elements, Dtype::Bf16, &params).unwrap();
        group.bench_with_input(
            BenchmarkId::new("build_32rows_k128", hidden),
            &elements,
            |b, e| b.iter(|| build_proofs(black_box(e), Dtype::Bf16, &params).unwrap()),
        );
        group.bench_with_input(
            BenchmarkId::new("verify_32rows_k128", hidden),
            &elements,
            |b, e| {
                b.iter(|| {
                    verify_proofs(black_box(e), Dtype::Bf16, black_box(&proofs), &params).unwrap()
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
