//! `model_root` (PROTOCOL.md §4) on generated checkpoint folders, against the byte string
//! built independently here and, when `python3` is on PATH, against Python's hashlib over
//! the reference recipe (`sorted(glob(dir/*.safetensors))`, name + size).

use std::path::Path;
use std::process::Command;

use engy_core::identity::{model_root, IdentityError};
use sha2::{Digest, Sha256};

fn write(dir: &Path, name: &str, len: usize) {
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(dir.join(name), bytes).unwrap();
}

/// The reference recipe in Python (stdlib only), or None when python3 is unavailable.
fn python_model_root(dir: &Path) -> Option<String> {
    let script = r#"
import glob, hashlib, os, sys
d = sys.argv[1]
h = hashlib.sha256()
cfg = os.path.join(d, "config.json")
h.update(open(cfg, "rb").read() if os.path.exists(cfg) else b"{}")
for shard in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
    h.update(os.path.basename(shard).encode())
    h.update(str(os.path.getsize(shard)).encode())
print(h.hexdigest())
"#;
    let out = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(dir)
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_string())
}

#[test]
fn model_root_matches_independent_computation() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let config = br#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":64}"#;
    std::fs::write(d.join("config.json"), config).unwrap();
    // Unsorted creation order, a name that sorts differently by bytes than by "natural" order,
    // a non-ASCII name, a hidden file glob skips, a non-shard, and a shard in a subfolder.
    write(d, "model-00002-of-00002.safetensors", 1234);
    write(d, "model-00001-of-00002.safetensors", 98765);
    write(d, "Z.safetensors", 0);
    write(d, "é.safetensors", 7);
    write(d, ".hidden.safetensors", 5);
    write(d, "tokenizer.json", 10);
    write(d, "model.safetensors.index.json", 10);
    std::fs::create_dir(d.join("sub")).unwrap();
    write(&d.join("sub"), "inner.safetensors", 3);

    let mut expected = config.to_vec();
    for (name, size) in [
        ("Z.safetensors", 0),
        ("model-00001-of-00002.safetensors", 98765),
        ("model-00002-of-00002.safetensors", 1234),
        ("é.safetensors", 7),
    ] {
        expected.extend_from_slice(name.as_bytes());
        expected.extend_from_slice(size.to_string().as_bytes());
    }
    let want = hex::encode(Sha256::digest(&expected));
    let got = model_root(d).unwrap();
    assert_eq!(got, want);
    assert_eq!(got.len(), 64);

    match python_model_root(d) {
        Some(py) => assert_eq!(got, py, "python reference recipe disagrees"),
        None => println!("SKIP python cross-check: python3 not available"),
    }

    // Changing a shard's size changes the root; changing its content at equal size does not.
    write(d, "Z.safetensors", 1);
    let bigger = model_root(d).unwrap();
    assert_ne!(bigger, got);
    std::fs::write(d.join("Z.safetensors"), [0xffu8]).unwrap();
    assert_eq!(model_root(d).unwrap(), bigger);
}

#[test]
fn model_root_without_config_hashes_braces() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    assert_eq!(model_root(d).unwrap(), hex::encode(Sha256::digest(b"{}")));
    write(d, "a.safetensors", 42);
    let want = hex::encode(Sha256::digest(b"{}a.safetensors42"));
    assert_eq!(model_root(d).unwrap(), want);
    if let Some(py) = python_model_root(d) {
        assert_eq!(want, py);
    }
}

#[test]
fn model_root_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope");
    assert!(matches!(
        model_root(&missing),
        Err(IdentityError::Io { .. })
    ));
    let file = tmp.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    assert!(matches!(
        model_root(&file),
        Err(IdentityError::NotADirectory { .. })
    ));
    // A dangling shard symlink cannot be sized: error, not a silent skip.
    #[cfg(unix)]
    {
        let d = tmp.path().join("ck");
        std::fs::create_dir(&d).unwrap();
        std::os::unix::fs::symlink(d.join("gone"), d.join("x.safetensors")).unwrap();
        assert!(matches!(model_root(&d), Err(IdentityError::Io { .. })));
    }
}
