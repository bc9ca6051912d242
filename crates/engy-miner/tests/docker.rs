//! docker/compose.miner.yml is a valid compose file with what a miner box needs (issue 14
//! item 9). Runs `docker compose config` where docker compose is installed; otherwise the
//! test prints why it skipped.
use std::path::PathBuf;
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_miner_compose_file_is_valid_and_runs_sglang_with_hidden_states_beside_the_miner() {
    let compose = repo().join("docker/compose.miner.yml");
    assert!(compose.is_file());
    assert!(repo().join("docker/Dockerfile.miner").is_file());
    let has_compose = Command::new("docker")
        .args(["compose", "version"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_compose {
        println!("skipped: `docker compose` is not installed here (docker compose version failed)");
        return;
    }
    let out = Command::new("docker")
        .args(["compose", "-f"])
        .arg(&compose)
        .arg("config")
        .env("GW", "wss://gw.example/gw")
        .env("MINER_KEY", "mk-compose-test")
        .env("MODEL_DIR", "/data/models/m")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "lmsysorg/sglang",
        "--enable-return-hidden-states",
        "driver: nvidia",
        "capabilities:",
        "engy-miner",
        "health",
        "service_healthy",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
}
