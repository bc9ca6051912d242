//! Hash throughput of the `engy-commit/v1` weight commitment (specs/SCHEME.md).
//! Target: ≥ 1 GB/s per core from page cache (SHA-256 via sha2's SHA-NI backend).
//!
//! * `commit/tensor_leaf_64MiB`: one tensor leaf over an in-memory buffer (one core).
//! * `commit/checkpoint_1_thread`: a whole generated checkpoint (~150 MB, page cache
//!   warm) on a one-thread rayon pool: mmap, header validation, grouping, every root.
//! * `commit/checkpoint_all_threads`: the same on every core.
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engy_core::commit::{self, CommitOptions, Progress};
use safetensors::{tensor::TensorView, Dtype};

/// A dense Qwen3-style bf16 checkpoint: 4 layers, hidden 1024, d_ff 4096, vocab 4096.
fn write_checkpoint(dir: &Path) -> u64 {
    let (h, f, v, layers) = (1024usize, 4096usize, 4096usize, 4usize);
    std::fs::write(
        dir.join("config.json"),
        format!(
            r#"{{"model_type":"qwen3","num_hidden_layers":{layers},"hidden_size":{h},"intermediate_size":{f},"vocab_size":{v},"torch_dtype":"bfloat16"}}"#
        ),
    )
    .unwrap();
    let mut names = vec![
        ("model.embed_tokens.weight".to_string(), vec![v, h]),
        ("model.norm.weight".to_string(), vec![h]),
        ("lm_head.weight".to_string(), vec![v, h]),
    ];
    for l in 0..layers {
        for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            names.push((format!("model.layers.{l}.self_attn.{p}.weight"), vec![h, h]));
        }
        names.push((format!("model.layers.{l}.input_layernorm.weight"), vec![h]));
        names.push((format!("model.layers.{l}.mlp.gate_proj.weight"), vec![f, h]));
        names.push((format!("model.layers.{l}.mlp.up_proj.weight"), vec![f, h]));
        names.push((format!("model.layers.{l}.mlp.down_proj.weight"), vec![h, f]));
    }
    let data: Vec<Vec<u8>> = names
        .iter()
        .enumerate()
        .map(|(i, (_, s))| {
            (0..s.iter().product::<usize>() * 2)
                .map(|j| (j as u8) ^ (i as u8))
                .collect()
        })
        .collect();
    let total = data.iter().map(|d| d.len() as u64).sum();
    for shard in 0..2 {
        let views: Vec<(String, TensorView<'_>)> = names
            .iter()
            .zip(&data)
            .enumerate()
            .filter(|(i, _)| i % 2 == shard)
            .map(|(_, ((n, s), d))| {
                (
                    n.clone(),
                    TensorView::new(Dtype::BF16, s.clone(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(
            views,
            None,
            &dir.join(format!("model-{:05}-of-00002.safetensors", shard + 1)),
        )
        .unwrap();
    }
    total
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("commit");
    g.sample_size(10);

    let buf: Vec<u8> = (0..64usize << 20).map(|i| (i * 31) as u8).collect();
    g.throughput(Throughput::Bytes(buf.len() as u64));
    g.bench_function("tensor_leaf_64MiB", |b| {
        b.iter(|| commit::tensor_leaf("w", "BF16", &[8192, 4096], &buf))
    });

    let dir = tempfile::tempdir().unwrap();
    let total = write_checkpoint(dir.path());
    g.throughput(Throughput::Bytes(total));
    for (name, threads) in [("checkpoint_1_thread", 1), ("checkpoint_all_threads", 0)] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                pool.install(|| {
                    commit::commit_checkpoint(
                        dir.path(),
                        &CommitOptions::default(),
                        &Progress::default(),
                    )
                    .unwrap()
                })
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
