//! `specs/devnet/` is the commitment of the devnet model as `engy-model` generates it today
//! (seed 53, `GenConfig::default()`): regenerate the checkpoint and let the real
//! `engy-validator spec verify` recompute every root against the committed spec file.
use std::path::Path;
use std::process::Command;

#[test]
fn committed_devnet_spec_matches_a_fresh_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("devnet-model");
    engy_model::gen_model(&ckpt, 53, &engy_model::GenConfig::default()).unwrap();
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/devnet");
    let out = Command::new(env!("CARGO_BIN_EXE_engy-validator"))
        .args(["spec", "verify", "--quiet", "--checkpoint"])
        .arg(&ckpt)
        .arg("--spec")
        .arg(&spec)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "specs/devnet no longer matches gen_model(seed 53, defaults); rebuild it with \
         `engy-validator spec build --checkpoint DIR --out specs/devnet`\nstdout: {stdout}\nstderr: {stderr}"
    );
    assert!(stdout.contains("matches model_root"), "stdout: {stdout}");
}
