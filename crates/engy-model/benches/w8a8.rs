//! The W8A8 recompute's cost against the bf16 one: one teacher-forced pass of 64 tokens over a
//! Qwen3.6-35B-A3B layer of real shapes in block FP8 ([`synth::Qwen36Shapes::RELEASE`]: a
//! Gated DeltaNet layer and a gated-attention layer, each with its 256-expert MoE; vocabulary
//! cut to 4096 rows), weights streamed from the shards as `engy-audit audit` loads them, in
//! bf16 ([`Compute::Bf16`], the weights' bf16 values) and in W8A8 (the same with every FP8
//! product's input rows quantised per token and per 128-group, the weights dequantised
//! exactly: [`Fp8Activations::PerTokenGroup`]).
//!
//! Run: `cargo bench -p engy-model --bench w8a8`; each case also prints one summary line
//! (`ms/pass`) from three timed passes. bench/RESULTS.md "W8A8 recompute" records it.
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engy_model::arch::Fp8Activations;
use engy_model::synth::{self, Qwen36Shapes};
use engy_model::{Compute, LoadOptions, Model, Residency};

/// Tokens per pass.
const T: usize = 64;

fn bench(cr: &mut Criterion) {
    let tmp = tempfile::tempdir().unwrap();
    let mut cases = Vec::new();
    for (layer, interval) in [("deltanet", 4), ("attention", 1)] {
        let shapes = Qwen36Shapes {
            layers: 1,
            vocab: 4096,
            full_attention_interval: interval,
            ..Qwen36Shapes::RELEASE
        };
        let d = tmp.path().join(layer);
        synth::write_qwen3_5_moe(&d, &shapes, true, 53).unwrap();
        for acts in [Fp8Activations::Unquantised, Fp8Activations::PerTokenGroup] {
            let opts = LoadOptions {
                residency: Residency::Streaming,
                compute: Compute::Bf16,
                fp8_activations: acts,
                ..LoadOptions::default()
            };
            let model = Model::open(&d, &opts).unwrap();
            let name = format!("qwen3_6_real_layer_{layer}_fp8/{}", acts.label());
            cases.push((name, model));
        }
    }
    let ids: Vec<u32> = (0..T as u32).map(|i| (i * 7919 + 13) % 4096).collect();
    let mut g = cr.benchmark_group("w8a8");
    g.sample_size(10);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(T as u64));
    for (name, model) in &cases {
        let _ = model.hidden_states(&ids).unwrap();
        let start = Instant::now();
        for _ in 0..3 {
            let _ = model.hidden_states(&ids).unwrap();
        }
        let s = start.elapsed().as_secs_f64() / 3.0;
        eprintln!("w8a8/{name}: T={T}, {:.1} ms/pass", s * 1e3);
        g.bench_function(name, |b| b.iter(|| model.hidden_states(&ids).unwrap()));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
