//! Build facts for `engy_telemetry::build_info` (docs/VALIDATOR.md and docs/MINER.md
//! "Versions"): the git commit of the source tree and whether its tracked files differed from
//! that commit.
//!
//! Sources, in order:
//! 1. `ENGY_GIT_COMMIT` (7 to 40 hex digits) and `ENGY_GIT_DIRTY` (`true`/`false`) set at
//!    build time: a build without `.git` (a docker build, a source tarball) passes them as
//!    build arguments. A value that is not hex / not a boolean fails the build with a message.
//! 2. `git` run in this crate's folder, when the repository's top level is this workspace:
//!    `git rev-parse HEAD`, and `git status --porcelain --untracked-files=no` for the dirty
//!    flag (tracked files only, as `git describe --dirty`).
//! 3. Neither: commit `unknown`, tree state `unknown`, and a cargo warning saying so.
//!
//! Emits `ENGY_BUILD_COMMIT` (hex or `unknown`) and `ENGY_BUILD_DIRTY` (`true`, `false` or
//! `unknown`) for `env!`.
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=ENGY_GIT_COMMIT");
    println!("cargo:rerun-if-env-changed=ENGY_GIT_DIRTY");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    // crates/engy-telemetry -> the workspace root
    let workspace = manifest
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| manifest.clone());

    let from_env_commit = std::env::var("ENGY_GIT_COMMIT")
        .ok()
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty());
    let from_env_dirty = std::env::var("ENGY_GIT_DIRTY")
        .ok()
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty());
    if let Some(c) = &from_env_commit {
        if !(7..=40).contains(&c.len()) || !c.bytes().all(|b| b.is_ascii_hexdigit()) {
            panic!("ENGY_GIT_COMMIT={c:?} is not a git commit (7 to 40 hex digits); pass e.g. --build-arg ENGY_GIT_COMMIT=$(git rev-parse HEAD)");
        }
    }
    let env_dirty = match from_env_dirty.as_deref() {
        None => None,
        Some("true" | "1" | "yes") => Some("true"),
        Some("false" | "0" | "no") => Some("false"),
        Some(other) => panic!("ENGY_GIT_DIRTY={other:?} is not true or false"),
    };

    let git = if from_env_commit.is_some() && env_dirty.is_some() {
        None
    } else {
        git_facts(&manifest, &workspace)
    };
    let commit = from_env_commit
        .or_else(|| git.as_ref().map(|g| g.commit.clone()))
        .unwrap_or_else(|| "unknown".to_owned());
    let dirty = env_dirty
        .or_else(|| git.as_ref().map(|g| if g.dirty { "true" } else { "false" }))
        .unwrap_or("unknown");
    if commit == "unknown" {
        println!("cargo:warning=engy build info: no git repository and no ENGY_GIT_COMMIT; `--version` will say `commit unknown` (pass ENGY_GIT_COMMIT=<sha> to the build)");
    }
    println!("cargo:rustc-env=ENGY_BUILD_COMMIT={commit}");
    println!("cargo:rustc-env=ENGY_BUILD_DIRTY={dirty}");
}

struct Git {
    commit: String,
    dirty: bool,
}

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// The commit and dirty flag, and the rerun triggers that keep them current; `None` when
/// there is no git or the repository around this crate is not this workspace.
fn git_facts(manifest: &Path, workspace: &Path) -> Option<Git> {
    let top = PathBuf::from(git(manifest, &["rev-parse", "--show-toplevel"])?);
    if top.canonicalize().ok()? != workspace.canonicalize().ok()? {
        return None;
    }
    let commit = git(manifest, &["rev-parse", "HEAD"])?;
    let status = git(manifest, &["status", "--porcelain", "--untracked-files=no"])?;
    // Rerun when HEAD moves, the index changes, or any source file of the workspace changes
    // (an edit makes the tree dirty without touching .git). Only paths that exist: a missing
    // one would rerun the script on every build.
    let abs = |p: String| {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            manifest.join(p)
        }
    };
    let git_dir = abs(git(manifest, &["rev-parse", "--git-dir"])?);
    let common = abs(git(manifest, &["rev-parse", "--git-common-dir"])?);
    let mut watch = vec![
        git_dir.join("HEAD"),
        git_dir.join("index"),
        common.join("packed-refs"),
        workspace.join("Cargo.toml"),
        workspace.join("Cargo.lock"),
        workspace.join("crates"),
    ];
    if let Some(r) = git(manifest, &["symbolic-ref", "-q", "HEAD"]) {
        watch.push(common.join(r));
    }
    for p in watch.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    Some(Git {
        commit,
        dirty: !status.is_empty(),
    })
}
