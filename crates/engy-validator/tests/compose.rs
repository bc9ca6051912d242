//! The validator's compose files as docs/VALIDATOR.md "Start (Docker)" runs them, literally,
//! from a directory that is not the checkout: `docker compose --env-file .env.validator -f
//! docker/docker-compose.validator.yml up -d` (the original runbook's names, links to ours)
//! and the same with our names. Every setting must come from that `.env.validator` (none from
//! a file beside the checkout), `user:` and the wallet folder too, and the compose files must
//! pass every variable of `engy-validator run --help` by name.
//!
//! Runs with podman-compose (`--dry-run --verbose up -d`: the `podman create` line it would
//! run, with every `-e`, `-u` and `-v`) or, with a Docker daemon, `docker compose config
//! --format json`. Without either the test says why it skipped, and fails when CI=true
//! (`bash docker/ci-images.sh tools` installs podman-compose).
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use engy_devnet::container::{in_ci, output, text, Engine};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// (the runbook's file name, the file it must be)
const FILES: [(&str, &str); 6] = [
    ("docker-compose.validator.yml", "compose.validator.yml"),
    (
        "docker-compose.validator-dev.yml",
        "compose.validator.dev.yml",
    ),
    (
        "docker-compose.validator-staging.yml",
        "compose.validator.staging.yml",
    ),
    ("compose.validator.yml", "compose.validator.yml"),
    ("compose.validator.dev.yml", "compose.validator.dev.yml"),
    (
        "compose.validator.staging.yml",
        "compose.validator.staging.yml",
    ),
];

/// Variables the compose files fix to the container's paths.
const FIXED: [(&str, &str); 3] = [
    ("ENGY_SN53_WALLET_PATH", "/wallets"),
    ("ENGY_SN53_STATE_FILE", "/data/state.json"),
    ("ENGY_SN53_HEARTBEAT_FILE", "/data/heartbeat.json"),
];

/// Settings with no flag, so not in `run --help`'s `[env: …]` (docs/VALIDATOR.md).
const NO_FLAG: [&str; 3] = [
    "ENGY_SN53_WALLET_PASSWORD",
    "ENGY_SN53_WALLET_PASSWORD_FILE",
    "ENGY_LOG",
];

/// The `[env: NAME…]` names of a `--help` text.
fn help_env_names(help: &str) -> BTreeSet<String> {
    help.split("[env: ")
        .skip(1)
        .filter_map(|rest| {
            let end = rest.find(['=', ']'])?;
            Some(rest[..end].to_owned())
        })
        .collect()
}

fn run_help_env() -> BTreeSet<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_engy-validator"))
        .args(["run", "--help"])
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    help_env_names(&String::from_utf8_lossy(&out.stdout))
}

/// What compose would give the validator container: its environment, `user:` and volumes.
#[derive(Debug)]
struct Resolved {
    env: Vec<(String, String)>,
    user: String,
    volumes: Vec<String>,
}

impl Resolved {
    fn get(&self, k: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
}

/// Parses podman-compose's dry-run line `podman create --name=engy_sn53_validator … IMAGE`.
fn parse_podman_create(log: &str) -> Option<Resolved> {
    let line = log
        .lines()
        .find(|l| l.contains("podman create") && l.contains("--name=engy_sn53_validator"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut r = Resolved {
        env: Vec::new(),
        user: String::new(),
        volumes: Vec::new(),
    };
    for w in words.windows(2) {
        match w[0] {
            "-e" => {
                let (k, v) = w[1].split_once('=')?;
                r.env.push((k.to_owned(), v.to_owned()));
            }
            "-u" => r.user = w[1].to_owned(),
            "-v" => r.volumes.push(w[1].to_owned()),
            _ => {}
        }
    }
    Some(r)
}

fn parse_docker_config(json: &str) -> Option<Resolved> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let svc = &v["services"]["validator"];
    let env = svc["environment"]
        .as_object()?
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    let volumes = svc["volumes"]
        .as_array()?
        .iter()
        .filter(|m| m["type"] == "bind")
        .map(|m| {
            format!(
                "{}:{}:ro",
                m["source"].as_str().unwrap_or(""),
                m["target"].as_str().unwrap_or("")
            )
        })
        .collect();
    Some(Resolved {
        env,
        user: svc["user"].as_str()?.to_owned(),
        volumes,
    })
}

/// Removes what podman-compose's dry run leaves (it creates the named volumes and the
/// watchtower's network even then): only what did not exist before and belongs to one of the
/// compose files' own projects.
struct Leftovers {
    engine: Engine,
    before: Vec<(&'static str, &'static str)>,
}

const MADE: [(&str, &str); 3] = [
    ("volume", "engy_sn53_data"),
    ("volume", "engy_sn53_data_dev"),
    ("network", "engy-sn53_default"),
];

fn exists(engine: Engine, kind: &str, name: &str) -> bool {
    engine
        .command()
        .args([kind, "exists", name])
        .status()
        .is_ok_and(|s| s.success())
}

impl Leftovers {
    fn new(engine: Engine) -> Self {
        let before = MADE
            .into_iter()
            .filter(|(k, n)| engine == Engine::Podman && exists(engine, k, n))
            .collect();
        Self { engine, before }
    }
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        if self.engine != Engine::Podman {
            return;
        }
        for (kind, name) in MADE {
            if self.before.contains(&(kind, name)) || !exists(self.engine, kind, name) {
                continue;
            }
            if let Some(p) = self.engine.project_of(kind, name) {
                if p == "engy-sn53" || p == "engy-sn53-dev" || p.is_empty() {
                    let _ = self.engine.command().args([kind, "rm", name]).output();
                }
            }
        }
    }
}

/// `compose --env-file .env.validator -f docker/FILE up -d` as written, from `op`.
fn resolve(engine: Engine, op: &Path, file: &str, names: &[String]) -> Resolved {
    let f = format!("docker/{file}");
    let mut cmd = match engine {
        Engine::Podman => {
            let mut c = engine.compose();
            c.args([
                "--verbose",
                "--dry-run",
                "--env-file",
                ".env.validator",
                "-f",
            ])
            .arg(&f)
            .args(["up", "-d"]);
            c
        }
        Engine::Docker => {
            let mut c = engine.compose();
            c.args(["--env-file", ".env.validator", "-f"])
                .arg(&f)
                .args(["config", "--format", "json"]);
            c
        }
    };
    cmd.current_dir(op);
    for k in names {
        cmd.env_remove(k);
    }
    let out = output(&mut cmd).unwrap();
    let log = text(&out);
    assert!(
        out.status.success(),
        "{file}: {engine:?} compose failed\n{log}"
    );
    let parsed = match engine {
        Engine::Podman => parse_podman_create(&log),
        Engine::Docker => parse_docker_config(&String::from_utf8_lossy(&out.stdout)),
    };
    parsed.unwrap_or_else(|| panic!("{file}: no validator container in\n{log}"))
}

#[test]
fn the_runbook_compose_commands_work_unchanged_from_any_directory() {
    // the original runbook's names are links to ours
    for (old, ours) in FILES {
        let link = repo().join("docker").join(old);
        let target = std::fs::canonicalize(&link)
            .unwrap_or_else(|e| panic!("docker/{old}: {e} (the original runbook names it)"));
        assert_eq!(
            target,
            std::fs::canonicalize(repo().join("docker").join(ours)).unwrap(),
            "docker/{old} is not docker/{ours}"
        );
    }
    let Some(engine) = Engine::detect() else {
        assert!(
            !in_ci(),
            "CI=true but this machine has no container engine: neither docker (with a daemon and `docker compose`) nor podman with podman-compose (bash docker/ci-images.sh tools installs them)"
        );
        println!("skipped: no container engine here (docker with a daemon and `docker compose`, or podman and podman-compose)");
        return;
    };
    let _leftovers = Leftovers::new(engine);
    // A checkout with a decoy .env.validator at its root (where `env_file: ../.env.validator`
    // would read), and the operator's own directory elsewhere, reaching the compose files
    // through a `docker` link so that the runbook's `-f docker/…` is typed as written.
    let tmp = tempfile::tempdir().unwrap();
    let checkout = tmp.path().join("checkout");
    let docker = checkout.join("docker");
    std::fs::create_dir_all(&docker).unwrap();
    for (old, ours) in FILES {
        std::fs::copy(repo().join("docker").join(ours), docker.join(ours)).unwrap();
        if old != ours {
            std::os::unix::fs::symlink(ours, docker.join(old)).unwrap();
        }
    }
    std::fs::copy(
        repo().join("docker/Dockerfile.validator"),
        docker.join("Dockerfile.validator"),
    )
    .unwrap();
    std::fs::write(
        checkout.join(".env.validator"),
        "ENGY_SN53_WALLET=decoy-wallet\nENGY_SN53_NETUID=99\n",
    )
    .unwrap();
    let op = tmp.path().join("operator");
    std::fs::create_dir_all(&op).unwrap();
    std::os::unix::fs::symlink(&docker, op.join("docker")).unwrap();
    let settings = [
        ("ENGY_SN53_WALLET", "op-wallet"),
        ("ENGY_SN53_WALLET_HOTKEY", "op-hotkey"),
        ("ENGY_SN53_UID", "4242"),
        ("ENGY_SN53_GID", "4343"),
        ("ENGY_SN53_WALLET_DIR", "/srv/op-wallets"),
        ("ENGY_SN53_POLL_S", "120"),
        ("ENGY_LOG", "debug"),
        // fixed by the compose files: not used
        ("ENGY_SN53_STATE_FILE", "/op/state.json"),
    ];
    let env_text: String = settings.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
    std::fs::write(op.join(".env.validator"), env_text).unwrap();
    let mut names: Vec<String> = settings.iter().map(|(k, _)| k.to_string()).collect();
    names.extend(run_help_env());
    names.extend(NO_FLAG.iter().map(|s| s.to_string()));
    names.push("ENGY_SN53_NETUID".into());
    names.push("ENGY_SN53_IMAGE".into());

    for (file, _) in FILES {
        let r = resolve(engine, &op, file, &names);
        for (k, v) in settings
            .iter()
            .filter(|(k, _)| !k.ends_with("_UID") && !k.ends_with("_GID") && !k.ends_with("_DIR"))
        {
            let want = FIXED
                .iter()
                .find(|(f, _)| f == k)
                .map_or(*v, |(_, fixed)| *fixed);
            assert_eq!(r.get(k), Some(want), "{file}: {k} in {r:?}");
        }
        for (k, v) in FIXED {
            assert_eq!(r.get(k), Some(v), "{file}: {k} in {r:?}");
        }
        assert_eq!(r.user, "4242:4343", "{file}: user: from .env.validator");
        assert!(
            r.volumes.iter().any(|v| v == "/srv/op-wallets:/wallets:ro"),
            "{file}: the wallet folder of .env.validator is not mounted: {r:?}"
        );
        // nothing from the checkout's decoy, and an unset setting stays unset
        assert!(
            !format!("{r:?}").contains("decoy") && r.get("ENGY_SN53_NETUID").is_none(),
            "{file}: a setting came from beside the checkout, not from --env-file: {r:?}"
        );
        assert!(r.get("ENGY_SN53_NETWORK").is_none(), "{file}: {r:?}");
    }
}

/// Every variable of `engy-validator run --help` (and the three without a flag) is passed by
/// name by each compose file, and nothing else but the three fixed paths.
#[test]
fn the_compose_files_pass_every_setting_of_run_by_name() {
    let mut want = run_help_env();
    want.extend(NO_FLAG.iter().map(|s| s.to_string()));
    for (_, file) in &FILES[3..] {
        let yml = std::fs::read_to_string(repo().join("docker").join(file)).unwrap();
        assert!(
            !yml.lines().any(|l| l.trim_start().starts_with("env_file")),
            "{file} reads an env_file relative to docker/: run from another directory it reads the wrong file"
        );
        let block: Vec<&str> = yml
            .lines()
            .skip_while(|l| l.trim() != "environment:")
            .skip(1)
            .take_while(|l| l.starts_with("      ") || l.trim_start().starts_with('#'))
            .map(str::trim)
            .filter(|l| l.starts_with("- "))
            .map(|l| &l[2..])
            .collect();
        let bare: BTreeSet<String> = block
            .iter()
            .filter(|e| !e.contains('='))
            .map(|e| e.to_string())
            .collect();
        let fixed: BTreeSet<String> = block
            .iter()
            .filter_map(|e| e.split_once('=').map(|(k, _)| k.to_string()))
            .collect();
        let mut all = bare.clone();
        all.extend(fixed.iter().cloned());
        assert_eq!(
            all, want,
            "{file}: the environment names differ from `run --help`'s variables"
        );
        assert_eq!(
            fixed,
            FIXED.iter().map(|(k, _)| k.to_string()).collect(),
            "{file}"
        );
    }
}
