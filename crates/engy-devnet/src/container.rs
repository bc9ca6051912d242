//! The container engine of this machine, for the tests of the images and compose files
//! (docker/ci-images.sh, issue 25): docker where its daemon and `docker compose` answer,
//! else podman with podman-compose (daemonless: what CI installs, `ci-images.sh tools`).
//!
//! Both take the same arguments for what the tests do (`run`, `logs`, `inspect`, `exec`,
//! `volume`, and compose's `-p`/`-f`/`--env-file` with `config`/`up`/`run`/`stop`/`start`/`down`).
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A container engine and its compose front end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// `docker` with a running daemon and the `docker compose` plugin.
    Docker,
    /// `podman` and `podman-compose`.
    Podman,
}

impl Engine {
    /// The engine this machine has: docker when `docker info` and `docker compose version`
    /// succeed, else podman when `podman --version` and `podman-compose --version` do; `None`
    /// when neither (a docker client without a daemon counts as none).
    pub fn detect() -> Option<Engine> {
        if succeeds("docker", &["info"]) && succeeds("docker", &["compose", "version"]) {
            Some(Engine::Docker)
        } else if succeeds("podman", &["--version"]) && succeeds("podman-compose", &["--version"]) {
            Some(Engine::Podman)
        } else {
            None
        }
    }

    /// `docker` or `podman`.
    pub fn program(self) -> &'static str {
        match self {
            Engine::Docker => "docker",
            Engine::Podman => "podman",
        }
    }

    /// The engine's command line (`docker` / `podman`), arguments to follow.
    pub fn command(self) -> Command {
        Command::new(self.program())
    }

    /// The compose command line (`docker compose` / `podman-compose`), arguments to follow.
    pub fn compose(self) -> Command {
        match self {
            Engine::Docker => {
                let mut c = Command::new("docker");
                c.arg("compose");
                c
            }
            Engine::Podman => Command::new("podman-compose"),
        }
    }

    /// The compose project that made container or volume `name` (its
    /// `com.docker.compose.project` label, set by both compose front ends); `Some("")` when it
    /// exists without one, `None` when it does not exist. `kind`: `container` or `volume`.
    pub fn project_of(self, kind: &str, name: &str) -> Option<String> {
        let out = output(self.command().args([
            kind,
            "inspect",
            "--format",
            "{{index .Labels \"com.docker.compose.project\"}}",
            name,
        ]))
        .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Removes container or volume `name` left by an earlier run of compose project
    /// `project`; nothing when it does not exist.
    ///
    /// # Errors
    /// It belongs to another project (an operator's container or state volume, never
    /// touched), or the removal failed.
    pub fn clear_leftover(self, kind: &str, name: &str, project: &str) -> Result<(), String> {
        match self.project_of(kind, name) {
            None => Ok(()),
            Some(p) if p != project => Err(format!(
                "a {kind} {name} of project '{p}' exists on this machine; the test would replace it: remove it or run elsewhere"
            )),
            Some(_) => {
                let args: &[&str] = match kind {
                    "volume" => &["volume", "rm", "-f", name],
                    _ => &["rm", "-f", name],
                };
                let out = output(self.command().args(args)).map_err(|e| e.to_string())?;
                if out.status.success() {
                    Ok(())
                } else {
                    Err(format!("removing {kind} {name}: {}", text(&out)))
                }
            }
        }
    }

    /// The log of `container` so far (stdout + stderr).
    ///
    /// # Errors
    /// The engine could not be run.
    pub fn logs(self, container: &str) -> std::io::Result<String> {
        output(self.command().args(["logs", container])).map(|o| text(&o))
    }

    /// Polls the log of `container` every 500 ms until `done` holds for it, and returns it.
    ///
    /// # Errors
    /// `timeout` passed first: the message names `what` and holds the log.
    pub fn wait_log(
        self,
        container: &str,
        what: &str,
        timeout: Duration,
        done: impl Fn(&str) -> bool,
    ) -> Result<String, String> {
        let deadline = Instant::now() + timeout;
        loop {
            let log = self.logs(container).map_err(|e| e.to_string())?;
            if done(&log) {
                return Ok(log);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "{what}: not in the log of {container} after {timeout:?}:\n{log}"
                ));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

/// A compose file of the repository run as the docs have operators run it: copied to
/// `<dir>/docker/`, its env file at `<dir>/<env_name>` (the repository root's place, which the
/// compose files' `env_file: ../.env.*` names), every command with `-p <project> -f <file>
/// --env-file <env file>` from `<dir>`, and none of the env file's variables taken from this
/// process's environment (the file alone configures the run).
#[derive(Debug, Clone)]
pub struct ComposeProject {
    engine: Engine,
    project: String,
    dir: PathBuf,
    file: PathBuf,
    env_file: PathBuf,
    names: Vec<String>,
}

impl ComposeProject {
    /// Lays out `dir` from the compose file `source` and the `(name, value)` settings of the
    /// env file `env_name` (e.g. `.env.validator`).
    ///
    /// # Errors
    /// Copying the compose file or writing the env file failed.
    pub fn new(
        engine: Engine,
        project: &str,
        dir: &Path,
        source: &Path,
        env_name: &str,
        settings: &[(String, String)],
    ) -> std::io::Result<ComposeProject> {
        let docker = dir.join("docker");
        std::fs::create_dir_all(&docker)?;
        let file = docker.join(source.file_name().unwrap_or(source.as_os_str()));
        std::fs::copy(source, &file)?;
        let env_file = dir.join(env_name);
        let text: String = settings.iter().map(|(k, v)| format!("{k}={v}\n")).collect();
        std::fs::write(&env_file, text)?;
        Ok(ComposeProject {
            engine,
            project: project.to_owned(),
            dir: dir.to_path_buf(),
            file,
            env_file,
            names: settings.iter().map(|(k, _)| k.clone()).collect(),
        })
    }

    /// The compose command line for `args` (`up -d validator`, `stop miner`, …).
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = self.engine.compose();
        c.args(["-p", &self.project, "-f"])
            .arg(&self.file)
            .arg("--env-file")
            .arg(&self.env_file)
            .args(args)
            .current_dir(&self.dir);
        for k in &self.names {
            c.env_remove(k);
        }
        c
    }
}

/// Whether this is a CI run (`CI=true`, as `.ci/run` is run): there a missing engine is a
/// failure, not a skip.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Runs `cmd` to the end and returns its output; an error names the program (not found,
/// not executable).
///
/// # Errors
/// The spawn error, with the program's name.
pub fn output(cmd: &mut Command) -> std::io::Result<Output> {
    cmd.output().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("{}: {e}", cmd.get_program().to_string_lossy()),
        )
    })
}

/// [`output`], printing the command, its status and its output to stderr (the test's log).
///
/// # Errors
/// As [`output`].
pub fn run_logged(cmd: &mut Command) -> std::io::Result<Output> {
    let out = output(cmd)?;
    eprintln!("--- {cmd:?} → {}\n{}", out.status, text(&out));
    Ok(out)
}

/// stdout then stderr of `out`, as text (for assertions and failure messages).
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn succeeds(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}
