//! Verifying one sampled-audit cell ([`engy_model::cells::verify_cell`]) of a real-shape
//! Qwen3.6-35B-A3B MoE layer in block FP8 (hidden 2048, 256 experts, top-8, expert width 512,
//! shared expert 512; [`synth::Qwen36Shapes::RELEASE`] at one layer, vocabulary cut to 4096
//! rows): time per cell with the checkpoint opened as `engy-audit` opens it (weights streamed
//! from the mmapped shards, nothing resident), and the peak RSS of a fresh process that opens
//! the checkpoint and verifies one cell (printed once, `VmHWM`).
//!
//! Run: `cargo bench -p engy-model --bench cell_verify`.
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::Criterion;
use engy_core::cells::Cell;
use engy_model::cells::{serve_cells, verify_cell, CellPolicy, CellServe};
use engy_model::synth::{self, Qwen36Shapes};
use engy_model::{Compute, LoadOptions, Model, Residency};

const CHILD: &str = "ENGY_BENCH_CELL_CHILD";

fn open(dir: &Path) -> Model {
    let opts = LoadOptions {
        residency: Residency::Streaming,
        ..LoadOptions::default()
    };
    Model::open(dir, &opts).unwrap()
}

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The child: open the checkpoint, verify the one cell, print the peak RSS.
fn child(dir: PathBuf) {
    let model = open(&dir);
    let cell = Cell::decode(&std::fs::read(dir.join("cell.bin")).unwrap()).unwrap();
    let c = verify_cell(&model, &cell, &CellPolicy::default()).unwrap();
    assert!(c.pass(), "{c:?}");
    println!("{}", peak_rss_kib());
}

fn main() {
    if let Some(dir) = std::env::var_os(CHILD) {
        child(PathBuf::from(dir));
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("qwen36-fp8-1layer");
    let shapes = Qwen36Shapes {
        layers: 1,
        vocab: 4096,
        ..Qwen36Shapes::RELEASE
    };
    synth::write_qwen3_5_moe(&dir, &shapes, true, 53).unwrap();
    // An honest bf16 serve's cells over 8 tokens; the bench verifies the last one.
    let serve = open(&dir).with_compute(Compute::Bf16).unwrap();
    let ids: Vec<u32> = (0..8).map(|i| 17 + 31 * i).collect();
    let cells = serve_cells(&serve, &ids, CellServe::Honest).unwrap();
    let cell = cells.last().unwrap().clone();
    std::fs::write(dir.join("cell.bin"), cell.encode()).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .env(CHILD, &dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kib: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0);
    let shard_bytes: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum();
    println!(
        "cell_verify: peak RSS of a process that opens the checkpoint ({:.0} MiB on disk) and \
         verifies one cell: {:.1} MiB",
        shard_bytes as f64 / (1 << 20) as f64,
        kib as f64 / 1024.0
    );
    let model = open(&dir);
    let policy = CellPolicy::default();
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    c.bench_function("cell_verify/qwen36_fp8_layer", |b| {
        b.iter(|| verify_cell(&model, &cell, &policy).unwrap())
    });
    c.final_summary();
}
