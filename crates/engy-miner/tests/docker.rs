//! docker/compose.miner.yml is a valid compose file with what a miner box needs (issue 14
//! item 9), and every setting an operator puts in `.env.miner` reaches the miner (issue 21
//! item 10). Renders it with the machine's compose (`docker compose` with a daemon, else
//! podman-compose: `engy_devnet::container`); without either the test prints why it skipped,
//! and fails when CI=true (`.ci/run` installs podman-compose).
use std::path::PathBuf;

use engy_devnet::container::{in_ci, output, text, ComposeProject, Engine};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_miner_compose_file_is_valid_and_runs_sglang_with_hidden_states_beside_the_miner() {
    let compose = repo().join("docker/compose.miner.yml");
    assert!(compose.is_file());
    assert!(repo().join("docker/Dockerfile.miner").is_file());
    let Some(engine) = Engine::detect() else {
        assert!(
            !in_ci(),
            "CI=true but this machine has no container engine: neither docker (with a daemon and `docker compose`) nor podman with podman-compose (bash docker/ci-images.sh tools installs them)"
        );
        println!("skipped: no container engine here (docker with a daemon and `docker compose`, or podman and podman-compose)");
        return;
    };
    // The compose file as the docs use it: .env.miner at the repository root, beside docker/.
    let dir = tempfile::tempdir().unwrap();
    let settings: Vec<(String, String)> = [
        ("GW", "wss://gw.example/gw"),
        ("MINER_KEY", "mk-compose-test"),
        ("MODEL_DIR", "/data/models/m"),
        ("ENGY_WORKER_NAME", "rig-compose-test"),
        ("TOPLOC_GEN_CHUNK", "2048"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let project = ComposeProject::new(
        engine,
        "engy-compose-config",
        dir.path(),
        &compose,
        ".env.miner",
        &settings,
    )
    .unwrap();
    let out = output(&mut project.command(&["config"])).unwrap();
    let text = text(&out);
    assert!(out.status.success(), "{engine:?} compose config\n{text}");
    for needle in [
        "lmsysorg/sglang",
        "--enable-return-hidden-states",
        "driver: nvidia",
        "capabilities:",
        "engy-miner",
        "health",
        "service_healthy",
        "/data/models/m:/model:ro",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
    // Every MINER.md §4 setting in .env.miner reaches the miner: `docker compose config`
    // inlines the env_file, podman-compose names it (the image test runs the miner through
    // this file and sees ENGY_WORKER_NAME in its HELLO: crates/engy-miner/tests/image.rs).
    assert!(
        text.contains("rig-compose-test") || text.contains(".env.miner"),
        "the miner service neither passes .env.miner (env_file) nor its ENGY_WORKER_NAME:\n{text}"
    );
}
