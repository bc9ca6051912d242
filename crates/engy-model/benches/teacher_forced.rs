//! The audit's teacher-forced pass ([`Model::hidden_states`], weights streamed from the mmapped
//! shards as `engy-audit audit` loads them): tokens per second and achieved GFLOP/s per
//! architecture.
//!
//! Cases:
//! * every tiny checkpoint of `$ENGY_ARCH_VECTORS_DIR` (default `tests/vectors/arch`);
//! * one Qwen3.6-35B-A3B layer of real shapes in block FP8 ([`synth::Qwen36Shapes::RELEASE`]),
//!   a Gated DeltaNet layer and a gated-attention layer, each with its 256-expert MoE, written
//!   to a temporary directory (vocabulary cut to 4096 rows: the embedding is a row lookup and
//!   the LM head is not part of the audit pass).
//!
//! FLOPs counted: `2 × active matmul parameters` per token, read from the shard headers: every
//! 2-D weight under `model.layers.` (NVFP4 packed width doubled), routed experts weighted by
//! `top_k / num_experts`; the attention score / DeltaNet state arithmetic is not counted (it is
//! small beside the projections at these lengths). Run: `cargo bench -p engy-model --bench
//! teacher_forced`; each case also prints one summary line (`tok/s`, `GFLOP/s`) from three
//! timed passes.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engy_model::synth::{self, Qwen36Shapes};
use engy_model::{LoadOptions, Model, Residency};

/// Tokens per pass.
const T: usize = 64;

fn vectors_dir() -> PathBuf {
    match std::env::var_os("ENGY_ARCH_VECTORS_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch"),
    }
}

/// The JSON header of a safetensors file (first 8 bytes: its length), without reading the data.
fn header(path: &Path) -> serde_json::Value {
    use std::io::Read;
    let mut f = std::fs::File::open(path).unwrap();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).unwrap();
    let mut h = vec![0u8; u64::from_le_bytes(n) as usize];
    f.read_exact(&mut h).unwrap();
    serde_json::from_slice(&h).unwrap()
}

/// Active matmul parameters per token (see the module docs).
fn active_params(dir: &Path, cfg: &serde_json::Value) -> f64 {
    let text = cfg.get("text_config").unwrap_or(cfg);
    let field = |k: &[&str]| {
        k.iter()
            .find_map(|k| text.get(*k).or_else(|| cfg.get(*k)))
            .and_then(serde_json::Value::as_f64)
    };
    let experts = field(&["num_experts", "n_routed_experts", "num_local_experts"]).unwrap_or(1.0);
    let top_k = field(&["num_experts_per_tok"]).unwrap_or(1.0);
    let (mut dense, mut routed) = (0f64, 0f64);
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let h = header(&p);
        for (name, t) in h.as_object().unwrap() {
            let name = name.replace("model.language_model.", "model.");
            if !name.starts_with("model.layers.") || !name.ends_with(".weight") {
                continue;
            }
            let shape: Vec<f64> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(serde_json::Value::as_f64)
                .collect();
            let [n, k] = shape[..] else { continue };
            let k = if t["dtype"] == "U8" { 2.0 * k } else { k };
            if name.contains(".experts.") {
                routed += n * k;
            } else {
                dense += n * k;
            }
        }
    }
    dense + routed * top_k / experts
}

struct Case {
    name: String,
    model: Model,
    ids: Vec<u32>,
    flop_per_pass: f64,
}

fn load(name: String, dir: &Path) -> Case {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let opts = LoadOptions {
        residency: Residency::Streaming,
        ..LoadOptions::default()
    };
    let model = Model::open(dir, &opts).unwrap_or_else(|e| panic!("{name}: {e}"));
    let vocab = model.config().vocab_size as u32;
    let ids = (0..T as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let flop_per_pass = 2.0 * active_params(dir, &cfg) * T as f64;
    Case {
        name,
        model,
        ids,
        flop_per_pass,
    }
}

fn summary(c: &Case) {
    let _ = c.model.hidden_states(&c.ids).unwrap();
    let start = Instant::now();
    let n = 3;
    for _ in 0..n {
        let _ = c.model.hidden_states(&c.ids).unwrap();
    }
    let s = start.elapsed().as_secs_f64() / f64::from(n);
    eprintln!(
        "teacher_forced/{}: T={T}, {:.3} GFLOP/pass, {:.1} ms/pass, {:.1} tok/s, {:.2} GFLOP/s",
        c.name,
        c.flop_per_pass / 1e9,
        s * 1e3,
        T as f64 / s,
        c.flop_per_pass / s / 1e9
    );
}

fn bench(cr: &mut Criterion) {
    let mut cases: Vec<Case> = Vec::new();
    let dir = vectors_dir();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("case.json").is_file())
        .collect();
    dirs.sort();
    for d in dirs {
        let name = d.file_name().unwrap().to_string_lossy().into_owned();
        cases.push(load(name, &d));
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, interval) in [
        ("qwen3_6_real_layer_deltanet_fp8", 4),
        ("qwen3_6_real_layer_attention_fp8", 1),
    ] {
        let shapes = Qwen36Shapes {
            layers: 1,
            vocab: 4096,
            full_attention_interval: interval,
            ..Qwen36Shapes::RELEASE
        };
        let d = tmp.path().join(name);
        synth::write_qwen3_5_moe(&d, &shapes, true, 53).unwrap();
        cases.push(load(name.to_string(), &d));
    }

    let mut g = cr.benchmark_group("teacher_forced");
    g.sample_size(10);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(T as u64));
    for c in &cases {
        summary(c);
        g.bench_function(&c.name, |b| {
            b.iter(|| c.model.hidden_states(&c.ids).unwrap());
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
