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

/// `engy-validator spec … | head -1`: the reader is gone before the command writes a byte, so
/// every write to standard output fails with EPIPE. The command must end with its own exit
/// code, quietly, not panic in `println!`.
#[test]
fn a_closed_stdout_ends_spec_commands_quietly_with_their_exit_code() {
    let spec = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../specs/devnet");
    for args in [&["spec", "inspect"][..], &["spec", "inspect", "--json"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_engy-validator"))
            .args(args)
            .arg(&spec)
            .stdout(writer)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.is_empty(), "{args:?}: {stderr}");
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
    }
}
