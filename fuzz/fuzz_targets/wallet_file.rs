//! The bittensor wallet hotkey file loader (`engy_core::keys::load_hotkey_file`,
//! `tests/vectors/keys/wallet.json`) on arbitrary file contents. Never panics, and no
//! error message or `Debug` output echoes secret material: neither a long hex run of the
//! file nor, when it loads, the key's secret bytes.
#![no_main]
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::OnceLock;

use engy_core::keys::load_hotkey_file;
use libfuzzer_sys::fuzz_target;

fn path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let base = std::env::var_os("ENGY_FUZZ_TMP")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("engy-fuzz-wallet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("hotkey")
    })
}

/// Hex runs of at least 16 characters in the input (candidate secrets).
fn hex_runs(data: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(data).to_ascii_lowercase();
    text.split(|c: char| !c.is_ascii_hexdigit())
        .filter(|r| r.len() >= 16)
        .map(str::to_owned)
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let p = path();
    {
        let mut f = std::fs::File::create(p).unwrap();
        f.write_all(data).unwrap();
    }
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
    match load_hotkey_file(p) {
        Ok(loaded) => {
            let secret = hex::encode(loaded.hotkey.secret_key_bytes().as_slice());
            let shown = format!("{loaded:?}").to_ascii_lowercase();
            assert!(!shown.contains(&secret[..32]), "Debug shows the secret key");
            assert!(!shown.contains(&secret[64..96]), "Debug shows the nonce");
        }
        Err(e) => {
            let shown = format!("{e} {e:?}").to_ascii_lowercase();
            for run in hex_runs(data) {
                assert!(
                    !shown.contains(&run),
                    "error message echoes file content {run:?}: {shown}"
                );
            }
        }
    }
});
