//! What the engy-model integration tests share: the arch oracle's case folders.
use std::path::PathBuf;

/// `$ENGY_ARCH_VECTORS_DIR`, or the shipped `<workspace>/tests/vectors/arch` (schema
/// `arch-oracle/1`, see its README).
pub fn vectors_dir() -> PathBuf {
    match std::env::var_os("ENGY_ARCH_VECTORS_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors/arch"),
    }
}

/// Every case folder (one holding `case.json`) of [`vectors_dir`], sorted.
#[allow(dead_code)] // not every test crate that includes this module uses it
pub fn cases() -> Vec<PathBuf> {
    let dir = vectors_dir();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("case.json").is_file())
        .collect();
    v.sort();
    v
}

/// `$ENGY_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`; default `cpu`): where the oracle tests run
/// the model. CI runs them on the CPU; scripts/gpu-check.sh runs the same tests on a GPU in a
/// `cuda` build (docs/AUDITOR.md "On a GPU").
#[allow(dead_code)] // not every test crate that includes this module uses it
pub fn test_device() -> engy_model::DeviceSpec {
    match std::env::var("ENGY_TEST_DEVICE") {
        Ok(d) if !d.is_empty() => d
            .parse()
            .unwrap_or_else(|e| panic!("ENGY_TEST_DEVICE: {e}")),
        _ => engy_model::DeviceSpec::Cpu,
    }
}
