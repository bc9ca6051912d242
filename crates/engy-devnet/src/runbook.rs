//! Reading a runbook and a binary's `--help` the one way every runbook test reads them.
//!
//! The miner's and the validator's tests check that docs/MINER.md and docs/VALIDATOR.md agree
//! with the binaries: each configuration table's variables and flags are the ones `--help`
//! prints. Both read the same two texts, a GitHub-flavoured markdown table and clap's help
//! layout, so the parsers live here once.

use std::collections::{BTreeMap, BTreeSet};

/// The options of a clap `--help` text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HelpOptions {
    /// Environment variable → the long flag it sets (`ENGY_MINER_GATEWAY_URL` → `--gateway-url`),
    /// from each option's `[env: NAME…]`.
    pub by_env: BTreeMap<String, String>,
    /// Every long flag of the text (`--help` included).
    pub flags: BTreeSet<String>,
}

/// The options of a clap `--help` text: each option starts with a line whose first word is a
/// flag (`--flag …` or `-x, --flag …`; a value list's `- on: …` is not one), and its
/// `[env: NAME]` or `[env: NAME=value]` follows before the next option.
pub fn help_options(help: &str) -> HelpOptions {
    let mut out = HelpOptions::default();
    let mut current: Option<String> = None;
    for line in help.lines() {
        let t = line.trim_start();
        if t.starts_with("--") || (t.starts_with('-') && t.get(2..4) == Some(", ")) {
            current = t
                .split([' ', ','])
                .find(|w| w.starts_with("--"))
                .map(str::to_owned);
            if let Some(f) = &current {
                out.flags.insert(f.clone());
            }
        }
        if let (Some(f), Some(rest)) = (&current, t.split("[env: ").nth(1)) {
            if let Some(end) = rest.find(['=', ']']) {
                out.by_env.insert(rest[..end].to_owned(), f.clone());
            }
        }
    }
    out
}

/// The cells of a markdown table row, trimmed (an escaped `\|` stays inside its cell, as
/// GitHub renders it).
pub fn row_cells(row: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut prev = ' ';
    for c in row.trim().trim_matches('|').chars() {
        if c == '|' && prev != '\\' {
            out.push(String::new());
        } else if let Some(last) = out.last_mut() {
            last.push(c);
        }
        prev = c;
    }
    out.into_iter().map(|c| c.trim().to_owned()).collect()
}

/// The backticked words of a markdown text (`` `A` or `B` `` → `["A", "B"]`).
pub fn ticked(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The body rows of the first table after the first occurrence of `heading` in `doc`, each as
/// its cells ([`row_cells`]; the header row and the `|---|` line skipped). `None` when
/// `heading` is not in `doc`; an empty list when no table follows it.
pub fn table_after(doc: &str, heading: &str) -> Option<Vec<Vec<String>>> {
    let at = doc.find(heading)?;
    Some(
        doc[at..]
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .skip(2)
            .map(row_cells)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_row_keeps_escaped_pipes_and_ticks() {
        let doc = "# x\n## Configuration\n\ntext\n\n| variable | flag |\n|---|---|\n| `A_B` / `C` | `--a` (`x\\|y`) |\n| `D` | |\n\nafter\n| not | this |\n";
        let rows = table_after(doc, "## Configuration").unwrap();
        assert_eq!(
            rows,
            vec![
                vec!["`A_B` / `C`".to_owned(), "`--a` (`x\\|y`)".to_owned()],
                vec!["`D`".to_owned(), String::new()],
            ]
        );
        assert_eq!(ticked(&rows[0][0]), ["A_B", "C"]);
        assert_eq!(ticked(&rows[0][1]), ["--a", "x\\|y"]);
        assert_eq!(table_after(doc, "## Missing"), None);
    }

    #[test]
    fn help_options_pair_each_env_with_its_flag() {
        let help = "Options:\n      --gateway-url <URL>\n          The gateway\n          \n          [env: ENGY_GATEWAY_URL=]\n\n  -v, --verbose\n          Possible values:\n          - on: more\n          [env: ENGY_VERBOSE]\n  -h, --help\n          Print help\n";
        let o = help_options(help);
        assert_eq!(o.by_env["ENGY_GATEWAY_URL"], "--gateway-url");
        assert_eq!(o.by_env["ENGY_VERBOSE"], "--verbose");
        assert_eq!(o.by_env.len(), 2);
        assert_eq!(
            o.flags.iter().map(String::as_str).collect::<Vec<_>>(),
            ["--gateway-url", "--help", "--verbose"]
        );
    }
}
