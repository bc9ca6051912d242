//! The engy-miner IMAGE through docker/compose.miner.yml, as docs/MINER.md runs it (issue 25):
//! `check` in the container passes against the gateway and serve doubles with the checkpoint
//! mounted read-only; the miner service then dials the gateway with the settings of
//! `.env.miner` (its ENGY_WORKER_NAME, which compose passes only through env_file: issue 21
//! item 10), reports healthy through the image's HEALTHCHECK, and exits 0 on SIGTERM.
//!
//! docker/ci-images.sh builds the image and runs this test with `ENGY_MINER_IMAGE` set and the
//! machine's engine (`engy_devnet::container`); without it, a visible skip. The sglang
//! service is not started (`--no-deps`: it needs GPUs); the serve double stands in for it.
mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Fixture, KEY, T};
use engy_devnet::container::{run_logged, text, ComposeProject, Engine};
use engy_devnet::sglang::SglangConfig;

const PROJECT: &str = "engy-ci-image-miner";
const CONTAINER: &str = "engy_sn53_miner";

fn ok(cmd: &mut Command) -> String {
    let out = run_logged(cmd).unwrap();
    assert!(out.status.success(), "{cmd:?} failed:\n{}", text(&out));
    text(&out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_miner_image_checks_dials_with_the_env_file_and_stops_on_sigterm() {
    let Some(image) = std::env::var("ENGY_MINER_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        eprintln!("SKIP the_miner_image_checks_dials_with_the_env_file_and_stops_on_sigterm: ENGY_MINER_IMAGE is not set (docker/ci-images.sh builds the image and runs this test)");
        return;
    };
    let engine = Engine::detect().expect("ENGY_MINER_IMAGE is set but this machine has no container engine (docker with a daemon and compose, or podman and podman-compose)");
    engine
        .clear_leftover("container", CONTAINER, PROJECT)
        .unwrap();
    let fx = Fixture::new(64, 1, SglangConfig::default()).await;

    // The operator's files: .env.miner at the repository root beside docker/.
    let dir = tempfile::tempdir().unwrap();
    let (gw, ckpt, serve) = (fx.gw.url(), fx.ckpt(), fx.sglang.url());
    // The container (host network) cannot report a port it picked to the HEALTHCHECK, which
    // reads ENGY_METRICS_ADDR: the port is held here for the test's life and the miner binds
    // it (SO_REUSEADDR, engy_devnet::ports); nobody else is given it meanwhile.
    let metrics_port = engy_devnet::ports::ReservedPort::new().unwrap();
    let metrics = metrics_port.addr().to_string();
    let settings: Vec<(String, String)> = [
        ("GW", gw.as_str()),
        ("MINER_KEY", KEY),
        ("MODEL_DIR", ckpt.to_str().unwrap()),
        ("SERVE_URL", serve.as_str()),
        ("MAX_INFLIGHT", "8"),
        ("ENGY_METRICS_ADDR", metrics.as_str()),
        ("ENGY_MINER_IMAGE", image.as_str()),
        ("ENGY_WORKER_NAME", "rig-image-test"),
        ("ENGY_LOG_FORMAT", "text"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let compose = ComposeProject::new(
        engine,
        PROJECT,
        dir.path(),
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docker/compose.miner.yml"),
        ".env.miner",
        &settings,
    )
    .unwrap();
    let compose_cmd = |args: &[&str]| compose.command(args);

    // -- the preflight, in the container, as the image's user, against the doubles
    let report = ok(&mut compose_cmd(&[
        "run",
        "--rm",
        "--no-deps",
        "miner",
        "check",
    ]));
    assert!(report.contains("all checks passed"), "{report}");
    assert!(report.contains("ok   model_root"), "{report}");
    assert!(fx.gw.conns().is_empty(), "check dialed a leg");

    // -- the service: dials with .env.miner's worker name, healthy by the image's check
    ok(&mut compose_cmd(&["up", "-d", "--no-deps", "miner"]));
    let legs = fx
        .gw
        .wait_legs(1, T)
        .await
        .expect("the miner container dialed no leg");
    let hello = legs[0].hello.clone().expect("HELLO");
    assert_eq!(hello["worker_name"], "rig-image-test", "{hello}");
    ok(engine
        .command()
        .args(["exec", CONTAINER, "/usr/local/bin/engy-miner", "health"]));
    if engine == Engine::Podman {
        ok(engine.command().args(["healthcheck", "run", CONTAINER]));
    }

    // -- SIGTERM (compose stop): drains and exits 0 well inside stop_grace_period
    let t = Instant::now();
    ok(&mut compose_cmd(&["stop", "miner"]));
    assert!(t.elapsed() < Duration::from_secs(40), "{:?}", t.elapsed());
    let state = ok(engine.command().args([
        "inspect",
        "--format",
        "{{.State.Status}} exit={{.State.ExitCode}}",
        CONTAINER,
    ]));
    assert_eq!(state.trim(), "exited exit=0");
    eprintln!(
        "--- miner container log ---\n{}",
        engine.logs(CONTAINER).unwrap()
    );
    ok(&mut compose_cmd(&["down"]));
    engine
        .clear_leftover("container", CONTAINER, PROJECT)
        .unwrap();
}
