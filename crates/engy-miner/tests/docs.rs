//! docs/MINER.md and the binary agree: every variable and flag of the configuration table is
//! one of `engy-miner --help` (same variable, same flag) and every one of `--help` is in the
//! table; every `--flag` the runbook's `engy-miner` command lines type exists; and
//! docker/compose.miner.yml passes every variable of `--help` to the miner.
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use engy_devnet::runbook::{self, ticked};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap()
}

fn help() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_engy-miner"))
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Variable → flag and every flag of the miner's `--help` (`engy_devnet::runbook`, the one
/// parser the validator's runbook test uses too).
fn help_options(help: &str) -> (BTreeMap<String, String>, BTreeSet<String>) {
    let o = runbook::help_options(help);
    (o.by_env, o.flags)
}

/// Rows of the table under `heading`: (variables, flag or "").
fn config_table(doc: &str, heading: &str) -> Vec<(Vec<String>, String)> {
    runbook::table_after(doc, heading)
        .unwrap_or_else(|| panic!("{heading} missing"))
        .into_iter()
        .map(|cells| {
            let vars = ticked(&cells[0])
                .into_iter()
                .filter(|v| v.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
                .collect();
            let flag = ticked(&cells[1]).into_iter().next().unwrap_or_default();
            (vars, flag)
        })
        .collect()
}

#[test]
fn the_configuration_table_is_the_binarys_help() {
    let help = help();
    let (by_env, _) = help_options(&help);
    let doc = read("docs/MINER.md");
    let rows = config_table(&doc, "## 4. Configuration");
    assert!(rows.len() > 20, "{rows:?}");
    let mut documented = BTreeSet::new();
    for (vars, flag) in &rows {
        for var in vars {
            documented.insert(var.clone());
            match by_env.get(var) {
                Some(f) => assert_eq!(
                    f, flag,
                    "docs/MINER.md: {var} is `{flag}` in the table, `{f}` in --help"
                ),
                None => {
                    // a variable without a flag (RUST_LOG) or a legacy alias: named in --help
                    assert!(
                        help.contains(var.as_str()),
                        "docs/MINER.md names {var}, which `engy-miner --help` does not"
                    );
                    assert!(
                        flag.is_empty() || vars.len() > 1,
                        "{var} has no flag, the table says {flag}"
                    );
                }
            }
        }
    }
    for (var, flag) in &by_env {
        assert!(
            documented.contains(var),
            "`engy-miner --help` has {var} ({flag}), which docs/MINER.md's table does not"
        );
    }
}

#[test]
fn every_flag_the_runbook_types_exists() {
    let (_, flags) = help_options(&help());
    let doc = read("docs/MINER.md");
    let mut typed = BTreeSet::new();
    let mut in_code = false;
    for line in doc.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let t = line.trim();
        if in_code && (t.starts_with("engy-miner") || t.contains(" engy-miner ")) {
            let after = &t[t.find("engy-miner").unwrap()..];
            for w in after.split_whitespace() {
                if w.starts_with("--") && w.len() > 2 {
                    typed.insert(w.split('=').next().unwrap().to_owned());
                }
            }
        }
    }
    assert!(typed.contains("--serve-url"), "{typed:?}");
    for f in &typed {
        assert!(
            flags.contains(f),
            "docs/MINER.md types `engy-miner … {f}`, which --help does not have"
        );
    }
}

#[test]
fn the_compose_file_passes_every_setting_by_name() {
    let (by_env, _) = help_options(&help());
    // the base file, and the cells override for ENGY_CELLS / ENGY_CELLS_SPOOL
    let mut names = BTreeSet::new();
    for file in ["docker/compose.miner.yml", "docker/compose.miner.cells.yml"] {
        let yml = read(file);
        assert!(
            !yml.lines().any(|l| l.trim_start().starts_with("env_file")),
            "{file} reads an env_file relative to docker/"
        );
        let miner = &yml[yml.find("\n  miner:").expect("a miner service")..];
        names.extend(
            miner
                .lines()
                .skip_while(|l| l.trim() != "environment:")
                .skip(1)
                .take_while(|l| l.starts_with("      ") || l.trim_start().starts_with('#'))
                .map(str::trim)
                .filter_map(|l| l.strip_prefix("- "))
                .map(|e| e.split('=').next().unwrap().to_owned()),
        );
    }
    let mut want: BTreeSet<String> = by_env.keys().cloned().collect();
    want.extend(["RUST_LOG".to_owned(), "ENGY_INSTANCE_ID".to_owned()]);
    assert_eq!(
        names, want,
        "docker/compose.miner.yml's miner environment differs from `engy-miner --help`'s variables"
    );
}
