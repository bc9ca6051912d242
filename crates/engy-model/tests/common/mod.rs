//! What the engy-model integration tests share, so that each fixture is made one way: the
//! vector folders (the shipped ones or the variable's), their case and commitment files, a
//! case's checkpoint opened for an audit, and the audit oracles' per-recompute tables.
// Not every test crate that includes this module uses every item.
#![allow(dead_code)]

pub mod cells;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use engy_model::audit::AuditReport;
use engy_model::{LoadOptions, Model, Residency};

/// The checkpoint `gen_model(seed, GenConfig::default())` writes (the devnet's tiny model),
/// generated once per test binary and seed in a temporary folder kept for the process.
pub fn generated_checkpoint(seed: u64) -> &'static Path {
    type Dirs = BTreeMap<u64, (tempfile::TempDir, &'static Path)>;
    static DIRS: std::sync::Mutex<Dirs> = std::sync::Mutex::new(BTreeMap::new());
    let mut dirs = DIRS.lock().unwrap_or_else(|e| e.into_inner());
    dirs.entry(seed)
        .or_insert_with(|| {
            let t = tempfile::tempdir().unwrap();
            let p = t.path().join("m");
            engy_model::gen_model(&p, seed, &engy_model::GenConfig::default()).unwrap();
            (t, Box::leak(p.into_boxed_path()))
        })
        .1
}

/// `$VAR` when set and not empty, else the shipped `<workspace>/tests/vectors/<folder>`.
pub fn vectors_or(var: &str, folder: &str) -> PathBuf {
    match std::env::var_os(var) {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/vectors")
            .join(folder),
    }
}

/// `$ENGY_ARCH_VECTORS_DIR`, or the shipped `<workspace>/tests/vectors/arch` (schema
/// `arch-oracle/1`, see its README).
pub fn vectors_dir() -> PathBuf {
    vectors_or("ENGY_ARCH_VECTORS_DIR", "arch")
}

/// The entries of `dir` that `keep`, sorted; panics naming `dir` when it cannot be read.
pub fn sorted_paths(dir: &Path, keep: impl Fn(&Path) -> bool) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| keep(p))
        .collect();
    v.sort();
    v
}

/// The commitments of an oracle folder: its `*.json` files but `meta.json`, sorted.
pub fn commitment_files(dir: &Path) -> Vec<PathBuf> {
    sorted_paths(dir, |p| {
        p.extension().is_some_and(|x| x == "json") && p.file_stem().is_some_and(|s| s != "meta")
    })
}

/// A commitment file's stem and its variant (`VARIANT_NN` → `VARIANT`), and its JSON.
pub fn read_commitment(path: &Path) -> (String, String, serde_json::Value) {
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or_default()
        .to_string();
    let variant = stem.rsplit_once('_').map_or(&*stem, |(v, _)| v).to_string();
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let value =
        serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (stem, variant, value)
}

/// The checkpoint in `dir` opened resident on [`test_device`], and its `model_root`.
pub fn open_resident(dir: &Path) -> (Model, String) {
    let opts = LoadOptions {
        residency: Residency::Resident,
        device: test_device(),
        ..LoadOptions::default()
    };
    let model = Model::open(dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let root = engy_core::identity::model_root(dir).unwrap();
    (model, root)
}

/// Per recompute label (`bf16`, `f32`, `bf16/w8a8`, …): the (min, max) over commitments of the
/// largest batch mismatch count: the audit oracles' table columns.
#[derive(Default)]
pub struct MismatchRanges(pub BTreeMap<String, (u64, u64)>);

impl MismatchRanges {
    /// Counts one commitment's recomputes in.
    pub fn record(&mut self, report: &AuditReport) {
        for o in &report.recomputes {
            let r = self.0.entry(o.label()).or_insert((u64::MAX, 0));
            r.0 = r.0.min(o.max_exp_mismatches);
            r.1 = r.1.max(o.max_exp_mismatches);
        }
    }

    /// `bf16 max-batch 3..23  f32 max-batch 0..9`.
    pub fn text(&self) -> String {
        let ranges: Vec<String> = self
            .0
            .iter()
            .map(|(c, (lo, hi))| format!("{c} max-batch {lo}..{hi}"))
            .collect();
        ranges.join("  ")
    }
}

/// Each recompute of `report` and its largest batch mismatch count, for a failure message.
pub fn tried(report: &AuditReport) -> String {
    let tried: Vec<String> = report
        .recomputes
        .iter()
        .map(|o| format!("{} max {}", o.label(), o.max_exp_mismatches))
        .collect();
    tried.join(", ")
}

/// Every case folder (one holding `case.json`) of [`vectors_dir`], sorted.
pub fn cases() -> Vec<PathBuf> {
    sorted_paths(&vectors_dir(), |p| p.join("case.json").is_file())
}

/// `$ENGY_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`; default `cpu`): where the oracle tests run
/// the model. CI runs them on the CPU; scripts/gpu-check.sh runs the same tests on a GPU in a
/// `cuda` build (docs/AUDITOR.md "On a GPU").
pub fn test_device() -> engy_model::DeviceSpec {
    match std::env::var("ENGY_TEST_DEVICE") {
        Ok(d) if !d.is_empty() => d
            .parse()
            .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}")),
        _ => engy_model::DeviceSpec::Cpu,
    }
}
