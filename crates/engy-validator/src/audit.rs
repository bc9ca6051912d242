//! `engy-validator audit`: re-derive a miner commitment's hidden states from a checkpoint in one
//! teacher-forced pass and check its TOPLOC proofs (PROTOCOL.md §3.10, §4, §5; the rules are in
//! [`engy_model::audit`]).
//!
//! Exit codes: 0 `pass`, 1 `cheat`, 2 `unproven` (the commitment is malformed or mis-shaped:
//! the reason is printed), 3 the audit itself could not run (unreadable checkpoint or
//! commitment file).
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use engy_model::audit::{audit, AuditParams, AuditReport, Verdict};
use engy_model::{Checkpoint, Precision};

/// Arguments of `engy-validator audit`.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {
    /// Checkpoint directory (config.json, *.safetensors) the commitment claims to be served
    /// from.
    #[arg(long, env = "CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// JSON file holding the commitment (PROTOCOL.md §3.10), or a gateway `response` frame
    /// containing it under "commitment"; `-` reads standard input.
    #[arg(long)]
    pub commitment: PathBuf,
    /// Proof top-k the commitment must use (model spec `toploc_k`).
    #[arg(long, default_value_t = 128)]
    pub toploc_k: usize,
    /// A decode batch passes with at most this many exponent mismatches (model spec
    /// `toploc_v`).
    #[arg(long, default_value_t = 40)]
    pub toploc_v: u64,
    /// The commitment passes when at least this fraction of its batches pass (model spec
    /// `toploc_p`, 0..=1).
    #[arg(long, default_value_t = 0.99)]
    pub toploc_p: f64,
    /// Print the full report as one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

const EXIT_PASS: u8 = 0;
const EXIT_CHEAT: u8 = 1;
const EXIT_UNPROVEN: u8 = 2;
const EXIT_ERROR: u8 = 3;

/// Runs `engy-validator audit` (exit codes in the module docs).
pub fn main(args: AuditArgs) -> anyhow::Result<ExitCode> {
    match run(&args) {
        Ok(report) => {
            if args.json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print_text(&report);
            }
            Ok(ExitCode::from(match report.verdict {
                Verdict::Pass => EXIT_PASS,
                Verdict::Cheat => EXIT_CHEAT,
                Verdict::Unproven { .. } => EXIT_UNPROVEN,
            }))
        }
        Err(e) => {
            eprintln!("engy-validator audit: error: {e:#}");
            eprintln!("no verdict: fix the input above and run the audit again");
            Ok(ExitCode::from(EXIT_ERROR))
        }
    }
}

fn run(args: &AuditArgs) -> anyhow::Result<AuditReport> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.toploc_p),
        "--toploc-p must be within 0..=1, got {}",
        args.toploc_p
    );
    anyhow::ensure!(args.toploc_k > 0, "--toploc-k must be at least 1");
    let text = if args.commitment.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading the commitment from stdin")?
    } else {
        std::fs::read_to_string(&args.commitment)
            .with_context(|| format!("reading {}", args.commitment.display()))?
    };
    let params = AuditParams {
        toploc_k: args.toploc_k,
        toploc_v: args.toploc_v,
        toploc_p: args.toploc_p,
    };
    let value: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        // Not JSON at all: the commitment is unproven, the audit itself worked.
        Err(e) => {
            return Ok(AuditReport {
                verdict: Verdict::Unproven {
                    reason: format!("the commitment file is not JSON: {e}"),
                },
                score: None,
                prompt_tokens: 0,
                n_tokens: 0,
                proof_bytes: 0,
                passing_batches: 0,
                batches: Vec::new(),
                params,
            })
        }
    };
    let ck = Checkpoint::open(&args.checkpoint, Precision::Bf16)
        .with_context(|| format!("opening checkpoint {}", args.checkpoint.display()))?;
    audit(&ck.model, &ck.model_root, &value, &params).context("recomputing hidden states")
}

fn print_text(r: &AuditReport) {
    match &r.verdict {
        Verdict::Unproven { reason } => println!("verdict: unproven ({reason})"),
        v => println!("verdict: {}", v.label()),
    }
    if let Some(score) = r.score {
        println!(
            "score: {score:.4} (mean exponent mismatches / topk {}), {}/{} batches within \
             toploc_v {}, pass ratio required {}",
            r.params.toploc_k,
            r.passing_batches,
            r.batches.len(),
            r.params.toploc_v,
            r.params.toploc_p
        );
        println!(
            "prompt tokens {}, proven output rows {}, proof bytes {}",
            r.prompt_tokens, r.n_tokens, r.proof_bytes
        );
        for (i, b) in r.batches.iter().enumerate() {
            println!(
                "  batch {i}: {} rows, {} exponent mismatches, mantissa error mean {:.2} \
                 median {:.0} -> {}",
                b.rows,
                b.exp_mismatches,
                b.mant_err_mean,
                b.mant_err_median,
                if b.pass { "pass" } else { "FAIL" }
            );
        }
    }
}
