//! docs/VALIDATOR.md and the binary agree, and its steps work as written: the configuration
//! table is `run --help` (variable and flag, both ways), the metrics' label values are the
//! binary's, `check | head -1` keeps the verdict's exit code, a lone API override is a usage
//! error, and a hotkey the process may not read says which uid/gid to run as.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;

use common::*;
use engy_devnet::provider::ProviderDouble;
use engy_devnet::runbook::{self, ticked};

const DEAD_CHAIN: &str = "ws://127.0.0.1:9";

fn doc() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/VALIDATOR.md"
    ))
    .unwrap()
}

/// Variable → flag of `engy-validator run --help` (`engy_devnet::runbook`, the one parser the
/// miner's docs test uses too).
fn run_help() -> BTreeMap<String, String> {
    let out = std::process::Command::new(bin())
        .args(["run", "--help"])
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success());
    runbook::help_options(&String::from_utf8_lossy(&out.stdout)).by_env
}

#[test]
fn the_configuration_table_is_run_help_plus_the_documented_rest() {
    let by_env = run_help();
    let rows: Vec<(Vec<String>, String, String)> = runbook::table_after(&doc(), "## Configuration")
        .expect("VALIDATOR.md has a Configuration section")
        .into_iter()
        .map(|cells| {
            let vars = ticked(&cells[0])
                .into_iter()
                .filter(|v| v.starts_with("ENGY_"))
                .collect();
            let flag = ticked(&cells[1]).into_iter().next().unwrap_or_default();
            (vars, flag, cells[3].clone())
        })
        .collect();
    let compose: String = ["compose.validator.yml", "compose.validator.staging.yml"]
        .iter()
        .map(|f| {
            std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../docker")
                    .join(f),
            )
            .unwrap()
        })
        .collect();
    let mut documented = BTreeSet::new();
    for (vars, flag, meaning) in &rows {
        for var in vars {
            documented.insert(var.clone());
            match by_env.get(var) {
                Some(f) => assert_eq!(f, flag, "VALIDATOR.md: {var} is `{flag}`, --help `{f}`"),
                None if meaning.starts_with("compose only") => assert!(
                    compose.contains(&format!("${{{var}")),
                    "{var} is documented as compose-only but no compose file reads it"
                ),
                None => assert!(
                    flag.is_empty() && meaning.contains("no flag"),
                    "VALIDATOR.md: {var} is not in `run --help` and its row does not say `no flag`"
                ),
            }
        }
    }
    for (var, flag) in &by_env {
        assert!(
            documented.contains(var),
            "`run --help` has {var} ({flag}), which VALIDATOR.md's table does not"
        );
    }
}

/// The label values VALIDATOR.md "Metrics" lists are the binary's closed sets.
#[test]
fn the_metrics_label_values_are_the_binarys() {
    let d = doc();
    for (metric, set) in [
        (
            "`provider_errors_total{kind}`",
            engy_validator::metrics::PROVIDER_ERROR_KINDS,
        ),
        (
            "`chain_errors_total{kind}`",
            engy_validator::metrics::CHAIN_ERROR_KINDS,
        ),
        ("`ticks_total{outcome}`", engy_validator::metrics::OUTCOMES),
    ] {
        let row = d
            .lines()
            .find(|l| l.starts_with(&format!("| {metric}")))
            .unwrap_or_else(|| panic!("no row for {metric}"));
        let listed: BTreeSet<String> = ticked(row.rsplit(" | ").next().unwrap())
            .into_iter()
            .filter(|w| !w.contains(':') && !w.contains('<'))
            .collect();
        let want: BTreeSet<String> = set.iter().map(|s| s.to_string()).collect();
        assert_eq!(listed, want, "VALIDATOR.md {metric}");
    }
}

/// `check | head -1`: a reader gone before the first line; no panic, exit 1 (the dead chain
/// FAILs), as with a reader; `health` likewise.
#[tokio::test]
async fn check_and_health_keep_their_exit_code_with_a_closed_stdout() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    for args in [&["check"][..], &["health"][..]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut cmd = env.command(args);
        cmd.stdout(writer).stderr(Stdio::piped());
        let out = cmd.output().await.unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Overriding ENGY_SN53_API alone is a usage error (exit 2), as the docs class it.
#[tokio::test]
async fn a_lone_api_override_is_a_usage_error() {
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let mut env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    env.vars.retain(|(k, _)| k != "ENGY_SN53_MASTER_HOTKEY");
    for args in [&["check"][..], &["run", "--ticks", "1"][..]] {
        let out = env.run(args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("only be overridden together"));
    }
}

/// The container's most likely error: a mode-600 hotkey read by another uid (the image's
/// 65532). `check` FAILs naming the file's owner and ENGY_SN53_UID/GID; `run` exits 1 with
/// the same fix. Needs root (to run the binary as another uid); says so and skips otherwise.
#[tokio::test]
async fn a_hotkey_of_another_uid_names_the_uid_to_run_as() {
    use std::os::unix::fs::PermissionsExt;
    if std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
        .unwrap_or(1)
        != 0
    {
        println!("skipped: not root, cannot run the validator as another uid");
        return;
    }
    let p = ProviderDouble::start(key(BOB_SEED), 53).await.unwrap();
    let env = Env::new(CHARLIE_SEED, &p.url(), &p.master_ss58(), DEAD_CHAIN);
    // the folders searchable by anyone, the hotkey 600 root's; the binary where 65532 can run it
    let home = env.home.path();
    for dir in [
        home.to_path_buf(),
        home.join(".bittensor"),
        home.join(".bittensor/wallets"),
        home.join(".bittensor/wallets/vali"),
        home.join(".bittensor/wallets/vali/hotkeys"),
    ] {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let bindir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bindir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let copy = bindir.path().join("engy-validator");
    std::fs::copy(bin(), &copy).unwrap();
    for args in [&["check"][..], &["run", "--ticks", "1"][..]] {
        let mut cmd = std::process::Command::new(&copy);
        cmd.args(args).env_clear();
        for (k, v) in &env.vars {
            cmd.env(k, v);
        }
        std::os::unix::process::CommandExt::uid(&mut cmd, 65532);
        std::os::unix::process::CommandExt::gid(&mut cmd, 65532);
        let out = cmd.output().unwrap();
        let all = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(1), "{args:?}: {all}");
        let line = all
            .lines()
            .find(|l| l.contains("hotkey file") && l.contains("Permission denied"))
            .unwrap_or_else(|| panic!("{args:?}: {all}"));
        assert!(line.contains("owned by uid 0 gid 0"), "{line}");
        assert!(line.contains("this process runs as uid 65532"), "{line}");
        assert!(line.contains("ENGY_SN53_UID=0 ENGY_SN53_GID=0"), "{line}");
    }
}
