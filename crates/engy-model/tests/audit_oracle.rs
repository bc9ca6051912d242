//! The auditor against an independent reference serve: every commitment of the audit oracle
//! (`$ENGY_AUDIT_ORACLE_DIR`, default the shipped `tests/vectors/audit-oracle`; schema in its
//! README) audited against its checkpoint with the auditor's default recompute
//! ([`Recompute::Auto`]: bf16, then f32).
//!
//! The rule, from the oracle's README ("a correct auditor says"): every `honest_*` variant
//! passes (an honest miner is never flagged), and `int4_g32` never passes on any checkpoint: a
//! cheat, or, on a block-FP8 checkpoint, where the W8A8 recompute runs too, `unproven` when no
//! unquantised recompute is closer than the W8A8 one by 3 standard errors (the W8A8
//! serving-noise rule, docs/PROTOCOL.md §5.1; all 24 of those commitments, whose differences
//! run from 6.3 closer to bf16 to 3.0 closer to W8A8 on 3 to 5 batches).
//! `fp8_tensor` (every projection through FP8 with one scale per tensor, a 2–4% weight change)
//! on a checkpoint not itself quantised must be caught in at least [`FP8_MIN_DETECTION`] of its
//! commitments: on the smallest models a few of its batches stay within `toploc_v`
//! (docs/design/recomputes.md), and the auditor's thresholds are the model spec's, not
//! tuned to catch them. Other variants (`fp8_tensor` re-quantising an FP8 checkpoint, a ~1%
//! change; `tf_fp8_dequant_batched`; any variant this test does not know) are measured and
//! printed, not asserted. The table it prints is recorded in bench/RESULTS.md
//! "Audit verdicts".
//!
//! On a DSA architecture it also asserts the rule of the tie orders
//! (docs/design/dsa-ties.md): a higher-first recompute runs exactly when the lower-first pass
//! of its dtype cut through a tie, and prints how many were not run.
//!
//! Checkpoints: the oracle names its case folders after the arch oracle's; each case's
//! checkpoint is the first of `<oracle>/<case>` (when it holds a `config.json`),
//! `$ENGY_ARCH_VECTORS_DIR/<case>`, `<oracle>/../arch/<case>` and the shipped
//! `tests/vectors/arch/<case>`. A commitment paired with the wrong checkpoint is `unproven`
//! (another `model_root`), which fails the test.
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use engy_model::arch::TieOrder;
use engy_model::audit::{audit_with, AuditParams, AuditReport, Recompute, Verdict, W8A8_NOISE};
use engy_model::{Model, Numerics};

fn oracle_dir() -> PathBuf {
    common::vectors_or("ENGY_AUDIT_ORACLE_DIR", "audit-oracle")
}

fn checkpoint_for(oracle: &Path, case: &str) -> Option<PathBuf> {
    let mut candidates = vec![oracle.join(case)];
    if let Some(d) = std::env::var_os("ENGY_ARCH_VECTORS_DIR").filter(|d| !d.is_empty()) {
        candidates.push(PathBuf::from(d).join(case));
    }
    candidates.push(oracle.join("..").join("arch").join(case));
    candidates.push(common::vectors_dir().join(case));
    candidates
        .into_iter()
        .find(|d| d.join("config.json").is_file())
}

/// The smallest fraction of `fp8_tensor` commitments on a bf16 checkpoint that must be caught.
const FP8_MIN_DETECTION: f64 = 0.75;

/// What a correct auditor says of `variant`, asserted per commitment: `Some(true)` pass,
/// `Some(false)` cheat, `None` not asserted one by one.
fn expected(variant: &str) -> Option<bool> {
    if variant.starts_with("honest_") {
        Some(true)
    } else if variant == "int4_g32" {
        Some(false)
    } else {
        None
    }
}

#[derive(Default)]
struct Row {
    n: usize,
    pass: usize,
    /// Per recompute (dtype, and the DSA tie order when it is not the first).
    ranges: common::MismatchRanges,
}

impl Row {
    /// Counts one commitment's recomputes into the ranges.
    fn record(&mut self, report: &AuditReport) {
        self.n += 1;
        self.ranges.record(report);
    }
}

/// The sub-folders of `dir` (one per case), sorted.
fn case_dirs(dir: &Path) -> Vec<PathBuf> {
    common::sorted_paths(dir, Path::is_dir)
}

/// The case's checkpoint ([`checkpoint_for`]), opened resident on the test device, and its
/// `model_root`.
fn open_case(oracle: &Path, case: &str) -> (PathBuf, Model, String) {
    let ckpt = checkpoint_for(oracle, case)
        .unwrap_or_else(|| panic!("{case}: no checkpoint folder with a config.json found"));
    let (model, root) = common::open_resident(&ckpt);
    (ckpt, model, root)
}

#[test]
fn honest_serves_pass_and_weight_swaps_are_caught() {
    let oracle = oracle_dir();
    let cases = case_dirs(&oracle);
    assert!(!cases.is_empty(), "no case folders in {}", oracle.display());
    let params = AuditParams::default();
    let mut failures = Vec::new();
    let mut audited = 0;
    // Recomputes run, and higher-first ones not run because their lower-first pass cut no tie.
    let (mut passes, mut skipped) = (0usize, 0usize);
    for case_dir in &cases {
        let case = case_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let (ckpt, model, root) = open_case(&oracle, &case);
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
        let quantised = config.get("quantization_config").is_some()
            || config
                .get("text_config")
                .and_then(|t| t.get("quantization_config"))
                .is_some();
        let files = common::commitment_files(case_dir);
        let mut table: BTreeMap<String, Row> = BTreeMap::new();
        for f in &files {
            let (stem, variant, value) = common::read_commitment(f);
            let report = audit_with(&model, &root, &value, &params, Recompute::Auto)
                .unwrap_or_else(|e| panic!("{case}/{stem}: {e}"));
            audited += 1;
            let row = table.entry(variant.clone()).or_default();
            row.record(&report);
            let passed = match &report.verdict {
                Verdict::Pass => true,
                Verdict::Cheat => false,
                // A swap on a block-FP8 checkpoint may land in the W8A8 noise band: not a
                // pass, and left to the cell audit (docs/PROTOCOL.md §5.1).
                Verdict::Unproven { reason }
                    if reason.starts_with(W8A8_NOISE) && !variant.starts_with("honest_") =>
                {
                    false
                }
                Verdict::Unproven { reason } => {
                    failures.push(format!("{case}/{stem}: unproven ({reason})"));
                    continue;
                }
            };
            row.pass += usize::from(passed);
            passes += report.recomputes.len();
            // The plan up to its passing entry (all of it, for a cheat): a DSA higher-first
            // recompute runs exactly when its lower-first pass cut through a tie.
            let dsa = engy_model::arch::has_dsa(model.config().kind);
            let outcome = |n: Numerics| {
                report.recomputes.iter().find(|o| {
                    (o.compute, o.attention, o.dsa_ties, o.fp8_activations)
                        == (n.compute, n.attention, n.dsa_ties, n.fp8_activations)
                })
            };
            for n in Recompute::Auto.plan(dsa) {
                let ran = outcome(n);
                if n.dsa_ties == TieOrder::HigherFirst {
                    let cut = outcome(Numerics {
                        dsa_ties: TieOrder::LowerFirst,
                        ..n
                    })
                    .and_then(|o| o.dsa_boundary_ties)
                    .is_none_or(|n| n > 0);
                    if ran.is_some() != cut {
                        failures.push(format!(
                            "{case}/{stem}: {n:?} {} though its lower-first \
                             pass {}",
                            if ran.is_some() { "ran" } else { "did not run" },
                            if cut {
                                "cut through a tie"
                            } else {
                                "cut no tie"
                            }
                        ));
                    }
                }
                match ran {
                    Some(o) if o.verdict == "pass" => break,
                    Some(_) => {}
                    None => skipped += 1,
                }
            }
            if let Some(want) = expected(&variant) {
                if want != passed {
                    failures.push(format!(
                        "{case}/{stem}: {} but a correct auditor says {} ({})",
                        report.verdict.label(),
                        if want { "pass" } else { "not a pass" },
                        common::tried(&report)
                    ));
                }
            }
        }
        println!("{case} ({}):", ckpt.display());
        for (variant, row) in &table {
            let want = match expected(variant) {
                Some(true) => "pass",
                Some(false) => "cheat",
                None if variant == "fp8_tensor" && !quantised => "mostly cheat",
                None => "measured",
            };
            println!(
                "  {variant:<28} {:>2}/{:<2} pass  (expected {want:<12})  {}",
                row.pass,
                row.n,
                row.ranges.text()
            );
        }
        if let Some(row) = table.get("fp8_tensor").filter(|_| !quantised) {
            let caught = (row.n - row.pass) as f64 / row.n.max(1) as f64;
            if caught < FP8_MIN_DETECTION {
                failures.push(format!(
                    "{case}/fp8_tensor: caught in {} of {} commitments, fewer than {:.0}%",
                    row.n - row.pass,
                    row.n,
                    FP8_MIN_DETECTION * 100.0
                ));
            }
        }
    }
    println!(
        "{audited} commitments, {passes} recomputes run, {skipped} DSA higher-first recomputes \
         not run (their lower-first pass cut no tie)"
    );
    assert!(audited > 0, "no commitments under {}", oracle.display());
    assert!(
        failures.is_empty(),
        "{} of {audited} verdicts are wrong:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn honest_serves_dir() -> PathBuf {
    common::vectors_or("ENGY_HONEST_SERVES_DIR", "honest-serves")
}

/// Every commitment of `$ENGY_HONEST_SERVES_DIR` (default the shipped
/// `tests/vectors/honest-serves`: transformers' eager bf16 serves of the arch oracle's
/// checkpoints on other prompts; README there) is honest and must pass. Prints, per case and
/// seed, the passes and the largest batch mismatch count of each recompute that ran.
#[test]
fn honest_serves_of_other_prompts_pass() {
    let dir = honest_serves_dir();
    let params = AuditParams::default();
    let (mut audited, mut failures) = (0, Vec::new());
    for case_dir in &case_dirs(&dir) {
        let case = case_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let (ckpt, model, root) = open_case(&oracle_dir(), case);
        let mut table: BTreeMap<String, Row> = BTreeMap::new();
        for f in &common::commitment_files(case_dir) {
            let (stem, set, value) = common::read_commitment(f);
            let report = audit_with(&model, &root, &value, &params, Recompute::Auto)
                .unwrap_or_else(|e| panic!("{case}/{stem}: {e}"));
            audited += 1;
            let row = table.entry(set).or_default();
            row.record(&report);
            row.pass += usize::from(report.verdict == Verdict::Pass);
            if report.verdict != Verdict::Pass {
                let verdict = report.verdict.label();
                failures.push(format!(
                    "{case}/{stem}: {verdict} ({})",
                    common::tried(&report)
                ));
            }
        }
        println!("{case} ({}):", ckpt.display());
        for (set, row) in &table {
            let (pass, n, ranges) = (row.pass, row.n, row.ranges.text());
            println!("  {set:<24} {pass:>2}/{n:<2} pass  {ranges}");
        }
    }
    assert!(audited > 0, "no commitments under {}", dir.display());
    assert!(
        failures.is_empty(),
        "{} of {audited} honest serves flagged:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
