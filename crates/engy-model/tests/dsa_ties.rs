//! DSA index scores that tie exactly at the `index_topk` boundary: a `glm_moe_dsa` checkpoint
//! whose indexer has 2 heads, served by transformers in bf16 (docs/design/dsa-ties.md).
//!
//! `tests/vectors/dsa-ties` (`$ENGY_DSA_TIES_DIR`; README there) holds the checkpoint and
//! commitments of batched honest serves that differ only in the order the serve's indexer
//! takes among exactly equal index scores (`tests/reverse/dsa_ties_serves.py --ties`):
//!
//! * `honest_ties_lower-first`: equal scores taken lower key index first, an order the
//!   auditor recomputes ([`engy_model::arch::TieOrder`]). Asserted: every commitment passes
//!   the default recompute, so engy's indexer computes transformers' index scores and
//!   selections on this checkpoint bit for bit but for the order among ties.
//! * `honest_ties_torch`: torch's own CPU `topk` order (libstdc++ `nth_element`: neither
//!   lower nor higher first, and a function of the padded row). Asserted: the recompute sees
//!   the selections cut through ties in every commitment (the cause); the verdicts are
//!   printed, not asserted (measured in docs/design/dsa-ties.md: no order the auditor can know
//!   reproduces them).
mod common;

use engy_model::audit::{audit_with, AuditParams, Recompute, Verdict};

#[test]
fn a_two_head_indexer_passes_when_the_serve_takes_ties_in_a_known_order() {
    let dir = common::vectors_or("ENGY_DSA_TIES_DIR", "dsa-ties");
    let cases = common::sorted_paths(&dir, |p| p.join("config.json").is_file());
    assert!(!cases.is_empty(), "no case folders in {}", dir.display());
    let params = AuditParams::default();
    let mut failures = Vec::new();
    for case_dir in &cases {
        let case = case_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let (model, root) = common::open_resident(case_dir);
        let mut table: std::collections::BTreeMap<String, (usize, usize, common::MismatchRanges)> =
            Default::default();
        for f in common::commitment_files(&case_dir.join("commitments")) {
            let (stem, variant, value) = common::read_commitment(&f);
            let report = audit_with(&model, &root, &value, &params, Recompute::Auto)
                .unwrap_or_else(|e| panic!("{case}/{stem}: {e}"));
            let row = table.entry(variant.clone()).or_default();
            row.0 += 1;
            row.1 += usize::from(report.verdict == Verdict::Pass);
            row.2.record(&report);
            let ties = report
                .recomputes
                .first()
                .and_then(|o| o.dsa_boundary_ties)
                .unwrap_or(0);
            match variant.as_str() {
                "honest_ties_lower-first" if report.verdict != Verdict::Pass => {
                    failures.push(format!(
                        "{case}/{stem}: {:?} (tried {})",
                        report.verdict,
                        common::tried(&report)
                    ))
                }
                "honest_ties_torch" if ties == 0 => failures.push(format!(
                    "{case}/{stem}: no selection cut through a tie in the first recompute"
                )),
                _ => {}
            }
        }
        for (variant, (n, pass, ranges)) in &table {
            println!(
                "{case:<20} {variant:<24} pass {pass:>2}/{n:<2}  {}",
                ranges.text()
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
