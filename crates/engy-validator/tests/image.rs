//! The engy-validator IMAGE on the REAL subtensor runtime (issue 25): its `check` and `health`
//! as the image's default user and as another uid with a mounted wallet, then
//! docker/compose.validator.yml as the operator runs it: the container lands the provider's
//! weight vector, is stopped with SIGTERM, restarts and records the landing from its state
//! volume without a second submit.
//!
//! docker/ci-images.sh builds the image and runs this test with `ENGY_VALIDATOR_IMAGE` (the
//! image's name), `ENGY_SUBTENSOR_URL` (its chopsticks chain) and the machine's engine
//! (`engy_devnet::container`). Without `ENGY_VALIDATOR_IMAGE`: a visible skip (the workspace
//! run of tests/run.sh comes before the images exist).
//!
//! Fixed names: the compose file names its container `engy_sn53_validator` and its volume
//! `engy_sn53_data`. The test runs compose as project `engy-ci-image`, removes leftovers of an
//! earlier run of its own (that label), and refuses to touch a container or volume of that
//! name that is not its own.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::chain::*;
use common::*;
use engy_devnet::container::{run_logged, text, ComposeProject, Engine};
use engy_devnet::provider::ProviderDouble;
use engy_validator::chain::Chain;

const PROJECT: &str = "engy-ci-image";
const CONTAINER: &str = "engy_sn53_validator";
const VOLUME: &str = "engy_sn53_data";
/// Another uid than the image's 65532: the wallet owner of compose's `user:`.
const OWNER: u32 = 1000;
/// The daemon's first log line (main.rs).
const STARTING: &str = "starting: hotkey ";

fn ok(cmd: &mut Command) -> String {
    let out = run_logged(cmd).unwrap();
    assert!(out.status.success(), "{cmd:?} failed:\n{}", text(&out));
    text(&out)
}

fn clear_leftovers(engine: Engine) {
    engine
        .clear_leftover("container", CONTAINER, PROJECT)
        .unwrap();
    engine.clear_leftover("volume", VOLUME, PROJECT).unwrap();
}

/// A named volume of this test, removed when dropped (also when an assertion fails).
struct Volume(Engine, String);

impl Drop for Volume {
    fn drop(&mut self) {
        let _ = run_logged(self.0.command().args(["volume", "rm", "-f", &self.1]));
    }
}

/// chown -R of a test folder.
fn chown_tree(path: &Path, uid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
    if path.is_dir() {
        for e in std::fs::read_dir(path).unwrap() {
            chown_tree(&e.unwrap().path(), uid);
        }
    }
}

/// `engine run --rm` of the image on the host network with the wallets and a state volume.
fn in_container(
    engine: Engine,
    image: &str,
    user: Option<u32>,
    wallets: &Path,
    volume: &str,
    vars: &[(String, String)],
    args: &[&str],
) -> Output {
    let mut cmd = engine.command();
    cmd.args(["run", "--rm", "--no-healthcheck", "--network", "host"]);
    if let Some(u) = user {
        cmd.args(["--user", &format!("{u}:{u}")]);
    }
    cmd.arg("-v")
        .arg(format!("{}:/wallets:ro", wallets.display()))
        .args(["-v", &format!("{volume}:/data")]);
    for (k, v) in vars {
        cmd.args(["-e", &format!("{k}={v}")]);
    }
    cmd.arg(image).args(args);
    run_logged(&mut cmd).unwrap()
}

fn wait_log(engine: Engine, what: &str, done: impl Fn(&str) -> bool) -> String {
    engine
        .wait_log(CONTAINER, what, Duration::from_secs(180), done)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The log since the last start of the daemon (its `starting:` line).
fn since_last_start(log: &str) -> &str {
    log.rfind(STARTING).map_or("", |i| &log[i..])
}

fn container_state(engine: Engine) -> String {
    ok(engine.command().args([
        "inspect",
        "--format",
        "{{.State.Status}} exit={{.State.ExitCode}}",
        CONTAINER,
    ]))
    .trim()
    .to_owned()
}

// Four workers: the engine commands block theirs while the provider double answers the container.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_validator_image_checks_lands_and_restarts_without_a_second_submit() {
    let Some(image) = std::env::var("ENGY_VALIDATOR_IMAGE")
        .ok()
        .filter(|s| !s.is_empty())
    else {
        eprintln!("SKIP the_validator_image_checks_lands_and_restarts_without_a_second_submit: ENGY_VALIDATOR_IMAGE is not set (docker/ci-images.sh builds the image and runs this test)");
        return;
    };
    let engine = Engine::detect().expect("ENGY_VALIDATOR_IMAGE is set but this machine has no container engine (docker with a daemon and compose, or podman and podman-compose)");
    let url = chain_url().expect("ENGY_VALIDATOR_IMAGE is set: ENGY_SUBTENSOR_URL must name the local chain (docker/ci-images.sh starts one)");
    let chain = Chain::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("ENGY_SUBTENSOR_URL={url} is unreachable: {e}"));
    baseline(&chain).await;
    clear_leftovers(engine);

    let (bob, charlie) = (key(BOB_SEED), key(CHARLIE_SEED));
    let (uid, _) = neuron_of(&chain, &charlie).await;
    let provider = ProviderDouble::start(bob.clone(), NETUID).await.unwrap();
    let epoch = engy_validator::liveness::unix_now();
    let vector: Vec<(String, u16)> = vec![
        (key(DAVE_SEED).ss58(), 30000),
        (key(EVE_SEED).ss58(), 20000),
        (key(FERDIE_SEED).ss58(), 10000),
    ];
    provider.publish(epoch, &vector);
    let (_, lu) = neuron_of(&chain, &charlie).await;
    jump_to(&url, &chain, lu + 101).await;

    // The operator's files: a wallet folder (hotkey mode 600) and .env.validator beside
    // docker/, as docs/VALIDATOR.md "Start (Docker)" lays them out.
    let dir = tempfile::tempdir().unwrap();
    write_wallet(dir.path(), "vali", "default", &seed(CHARLIE_SEED));
    let wallets: PathBuf = dir.path().join(".bittensor/wallets");
    let settings: Vec<(String, String)> = [
        ("ENGY_SN53_WALLET", "vali"),
        ("ENGY_SN53_WALLET_HOTKEY", "default"),
        ("ENGY_SN53_API", provider.url().as_str()),
        ("ENGY_SN53_MASTER_HOTKEY", bob.ss58().as_str()),
        ("ENGY_SN53_NETWORK", url.as_str()),
        ("ENGY_SN53_POLL_S", "1"),
        ("ENGY_SN53_RESUBMIT_BLOCKS", "101"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let scratch_volume = Volume(
        engine,
        format!("engy-ci-image-check-{}", std::process::id()),
    );
    let scratch = scratch_volume.1.as_str();

    let in_image = |user: Option<u32>, args: &[&str]| {
        in_container(engine, &image, user, &wallets, scratch, &settings, args)
    };

    // -- the image's default user (65532) owns the wallet: check passes, state writable
    chown_tree(&wallets, 65532);
    let out = in_image(None, &["check"]);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("ok    state file /data/state.json writable"),
        "{report}"
    );
    assert!(
        report.contains(&format!("registered on netuid 53 at uid {uid}")),
        "{report}"
    );
    assert!(!report.contains("FAIL"), "{report}");
    // health before any tick: unhealthy, with the reason
    let out = in_image(None, &["health"]);
    assert!(!out.status.success(), "{}", text(&out));

    // -- another uid owns the wallet: as 65532 the hotkey cannot be read; as that uid check
    //    passes and writes the same state folder
    chown_tree(&wallets, OWNER);
    let out = in_image(None, &["check"]);
    let report = text(&out);
    assert!(!out.status.success(), "{report}");
    assert!(report.contains("FAIL  wallet vali/default"), "{report}");
    let out = in_image(Some(OWNER), &["check"]);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("ok    state file /data/state.json writable"),
        "{report}"
    );

    // -- compose, as the docs run it: ENGY_SN53_UID/GID, the wallet folder and the image come
    //    from .env.validator through --env-file (nothing from this process's environment)
    let mut env_file = settings.clone();
    env_file.extend([
        ("ENGY_SN53_UID".to_owned(), OWNER.to_string()),
        ("ENGY_SN53_GID".to_owned(), OWNER.to_string()),
        (
            "ENGY_SN53_WALLET_DIR".to_owned(),
            wallets.display().to_string(),
        ),
        ("ENGY_SN53_IMAGE".to_owned(), image.clone()),
    ]);
    let compose = ComposeProject::new(
        engine,
        PROJECT,
        dir.path(),
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docker/compose.validator.yml"),
        ".env.validator",
        &env_file,
    )
    .unwrap();
    let compose_cmd = |args: &[&str]| compose.command(args);

    let landed = "set_weights of 3 uids from payload landed in block #";
    let before = head(&chain).await;
    ok(&mut compose_cmd(&["up", "-d", "validator"]));
    let log = wait_log(engine, "the landing", |l| l.contains(landed));
    assert!(
        log.contains(&format!("epoch {epoch} verified (new epoch)")),
        "{log}"
    );
    let (_, landed_at) = neuron_of(&chain, &charlie).await;
    assert!(landed_at > before, "LastUpdate {landed_at} ≤ {before}");
    // health as the container's user (the wallet owner) and as the image's default user
    ok(engine
        .command()
        .args(["exec", CONTAINER, "/usr/local/bin/engy-validator", "health"]));
    ok(engine.command().args([
        "exec",
        "--user",
        "65532:65532",
        CONTAINER,
        "/usr/local/bin/engy-validator",
        "health",
    ]));
    if engine == Engine::Podman {
        // the image's own HEALTHCHECK (no compose healthcheck overrides it)
        ok(engine.command().args(["healthcheck", "run", CONTAINER]));
    }

    // -- SIGTERM (compose stop: stop_signal SIGTERM, grace 60 s): exits 0 by itself
    let t = Instant::now();
    ok(&mut compose_cmd(&["stop", "validator"]));
    let stopped_in = t.elapsed();
    assert_eq!(container_state(engine), "exited exit=0");
    assert!(stopped_in < Duration::from_secs(30), "{stopped_in:?}");
    let log = engine.logs(CONTAINER).unwrap();
    assert!(log.contains("SIGTERM"), "{log}");

    // -- restart: the state volume says the epoch landed; nothing is submitted again
    ok(&mut compose_cmd(&["start", "validator"]));
    let again = format!("epoch {epoch} verified: already applied");
    let log = wait_log(engine, "a tick after the restart", |l| {
        l.matches(STARTING).count() == 2 && since_last_start(l).contains(&again)
    });
    eprintln!("--- compose scenario log ---\n{log}");
    assert_eq!(log.matches(landed).count(), 1, "a second submit:\n{log}");
    assert_eq!(neuron_of(&chain, &charlie).await.1, landed_at);

    ok(&mut compose_cmd(&["down", "-v"]));
    clear_leftovers(engine);
}
