//! What build is running: the workspace version, the git commit and whether the tree was
//! dirty, in one place for both daemons' `--version`, `health`, the miner's HELLO `versions`
//! and the `<prefix>_build_info` metric.
//!
//! The commit comes from `build.rs`: `ENGY_GIT_COMMIT` / `ENGY_GIT_DIRTY` given to the build
//! (a docker build without `.git` passes them as build arguments), else `git` in the source
//! tree, else `unknown` (docs/MINER.md and docs/VALIDATOR.md "Versions").
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{labels, Labels};

/// The build of this binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BuildInfo {
    /// The workspace version (`Cargo.toml`), shared by every engy crate, e.g. `0.1.0`.
    pub version: &'static str,
    /// The git commit (7–40 lowercase hex digits), or `unknown`.
    pub commit: &'static str,
    /// `true` when tracked files differed from the commit at build time, `false` when not,
    /// `unknown` when there was no way to tell.
    pub dirty: &'static str,
}

/// This build.
pub const BUILD: BuildInfo = BuildInfo {
    version: env!("CARGO_PKG_VERSION"),
    commit: env!("ENGY_BUILD_COMMIT"),
    dirty: env!("ENGY_BUILD_DIRTY"),
};

/// The `--version` text of both daemons: `0.1.0 (commit <sha>, dirty=false)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("ENGY_BUILD_COMMIT"),
    ", dirty=",
    env!("ENGY_BUILD_DIRTY"),
    ")"
);

impl BuildInfo {
    /// The dirty flag as a JSON-friendly value: `Some(true)`, `Some(false)`, or `None` when
    /// unknown.
    pub fn dirty_flag(&self) -> Option<bool> {
        match self.dirty {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        }
    }

    /// One line for logs and `health`: `engy-miner 0.1.0 (commit <sha>, dirty=false)`.
    pub fn describe(&self, binary: &str) -> String {
        format!(
            "{binary} {} (commit {}, dirty={})",
            self.version, self.commit, self.dirty
        )
    }
}

/// Registers `build_info` (a gauge, always 1, labelled `version`, `commit`, `dirty`) in
/// `registry`; with the daemon's prefix it scrapes as e.g.
/// `engy_miner_build_info{version="0.1.0",commit="…",dirty="false"} 1`.
pub fn register(registry: &mut Registry, build: &BuildInfo) {
    let family = Family::<Labels, Gauge>::default();
    family
        .get_or_create(&labels(&[
            ("version", build.version),
            ("commit", build.commit),
            ("dirty", build.dirty),
        ]))
        .set(1);
    registry.register(
        "build_info",
        "The running build: workspace version, git commit and whether the tree was dirty (always 1)",
        family,
    );
}

/// The labels of `<name>{…} 1` in a scrape's text (`name` e.g. `engy_miner_build_info`),
/// as `(version, commit, dirty)`; `None` when the series is absent.
pub fn parse_scraped(scrape: &str, name: &str) -> Option<(String, String, String)> {
    let line = scrape
        .lines()
        .find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{')))?;
    let labels = line.get(name.len() + 1..)?.split('}').next()?;
    let get = |key: &str| {
        labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == key).then(|| v.trim().trim_matches('"').to_owned())
        })
    };
    Some((get("version")?, get("commit")?, get("dirty")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metric_scrapes_with_its_labels_and_parses_back() {
        let mut r = Registry::with_prefix("engy_miner");
        let b = BuildInfo {
            version: "1.2.3",
            commit: "0123456789abcdef0123456789abcdef01234567",
            dirty: "true",
        };
        register(&mut r, &b);
        let text = crate::metrics::encode(&r).unwrap();
        assert!(
            text.contains(r#"engy_miner_build_info{version="1.2.3",commit="0123456789abcdef0123456789abcdef01234567",dirty="true"} 1"#),
            "{text}"
        );
        assert_eq!(
            parse_scraped(&text, "engy_miner_build_info"),
            Some((b.version.into(), b.commit.into(), b.dirty.into()))
        );
        assert_eq!(b.dirty_flag(), Some(true));
    }

    #[test]
    fn this_build_names_a_commit_and_a_tree_state() {
        assert!(
            BUILD.commit == "unknown"
                || (BUILD.commit.len() >= 7 && BUILD.commit.bytes().all(|c| c.is_ascii_hexdigit())),
            "{BUILD:?}"
        );
        assert!(matches!(BUILD.dirty, "true" | "false" | "unknown"));
        assert!(LONG_VERSION.starts_with(BUILD.version));
        assert!(LONG_VERSION.contains(BUILD.commit));
    }
}
