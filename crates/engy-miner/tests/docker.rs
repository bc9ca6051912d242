//! docker/compose.miner.yml is a valid compose file with what a miner box needs, every
//! setting an operator puts in `.env.miner` is passed to the miner by name, and
//! docker/compose.miner.cells.yml layered on it mounts one spool into the serve and the
//! miner. Renders them with the machine's compose (`docker compose` with a daemon, else
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
    // Every setting of `engy-miner --help` is passed by name (compose resolves it from the
    // --env-file; the image test sees ENGY_WORKER_NAME in the HELLO:
    // crates/engy-miner/tests/image.rs), and the file reads no env_file relative to itself.
    assert!(
        !text.contains("env_file"),
        "an env_file is read relative to docker/:\n{text}"
    );
    for name in [
        "ENGY_WORKER_NAME",
        "TOPLOC_GEN_CHUNK",
        "HW_GPUS",
        "ENGY_CELLS_RETAIN_S",
    ] {
        assert!(
            text.contains(name),
            "{name} is not passed to the miner:\n{text}"
        );
    }
    // cells: the override mounts one spool into both containers and installs the hooks
    let cells = dir.path().join("docker/compose.miner.cells.yml");
    std::fs::copy(repo().join("docker/compose.miner.cells.yml"), &cells).unwrap();
    let mut cmd = engine.compose();
    cmd.args(["-p", "engy-compose-config", "-f"])
        .arg(dir.path().join("docker/compose.miner.yml"))
        .arg("-f")
        .arg(&cells)
        .arg("--env-file")
        .arg(dir.path().join(".env.miner"))
        .arg("config")
        .current_dir(dir.path());
    for (k, _) in &settings {
        cmd.env_remove(k);
    }
    let out = output(&mut cmd).unwrap();
    let cells_text = engy_devnet::container::text(&out);
    let text = cells_text;
    assert!(
        out.status.success(),
        "{engine:?} compose config (cells)\n{text}"
    );
    for needle in [
        "engy-cells-hooks /var/spool/engy-cells",
        "ENGY_CELLS_SPOOL",
        "--disable-radix-cache",
        "engy_sn53_cells_spool:/var/spool/engy-cells",
        "/var/spool/engy-cells",
    ] {
        assert!(text.contains(needle), "{needle} missing in\n{text}");
    }
    assert_eq!(
        text.matches("engy_sn53_cells_spool:/var/spool/engy-cells")
            .count(),
        2,
        "the spool is not mounted in both the serve and the miner:\n{text}"
    );
}
