//! engy-audit: the auditor, a binary of its own so the light validator's image carries no
//! model runtime (`engy-validator` links neither engy-model nor candle).
//!
//! * `audit` ([`audit`]): one miner commitment against the pinned checkpoint; exit 0 pass,
//!   1 cheat, 2 unproven, 3 the audit could not run.
//! * `cells` ([`cells`]): a miner's cell audit bundle against the checkpoint, its touched
//!   weights checked against the trusted `model_root`; exit 0 pass, 1 cheat, 2 bundle refused,
//!   3 the audit could not run, 4 the checkpoint is not the committed one.
//! * `spec` ([`spec`]): build, verify, open and inspect Merkle weight commitments
//!   (specs/SCHEME.md); the same code and exit codes as `engy-validator spec`.
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod audit;
mod cells;
// `spec` is the engy-spec crate, the same command as `engy-validator spec`.
use engy_spec as spec;

/// engy SN53 auditor.
///
/// Recomputes a miner commitment's hidden states from the pinned checkpoint and checks its
/// TOPLOC proofs; builds and verifies the checkpoint's Merkle weight commitment.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Audit a miner commitment against a checkpoint (teacher-forced recompute + TOPLOC
    /// verify). Exit 0 pass, 1 cheat, 2 unproven, 3 the audit could not run.
    Audit(audit::AuditArgs),
    /// Check a miner's cell audit bundle (the challenged cells of one request, opened) against
    /// the checkpoint, whose touched weights are checked against the trusted model_root.
    /// Exit 0 pass, 1 cheat, 2 bundle refused, 3 the audit could not run, 4 the checkpoint is
    /// not the committed one.
    Cells(cells::CellsArgs),
    /// Build, verify, open and inspect Merkle weight commitments (specs/SCHEME.md).
    /// Exit 0 done / matches, 1 bad input, 2 roots differ or the proof is rejected.
    Spec(spec::SpecArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Audit(args) => audit::main(&args),
        Command::Cells(args) => cells::main(&args),
        Command::Spec(args) => match spec::main(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("engy-audit spec: error: {e:#}");
                ExitCode::from(1)
            }
        },
    }
}

/// Prints a verdict's report (`json`: the report as one JSON line, else `text()`) and returns
/// `code`. A reader that has gone (`| head -1`) read what it wanted: the verdict's code stands.
/// A report that cannot be serialised or written is exit `error_code`, with the reason on
/// stderr under `cmd`.
fn emit<R: serde::Serialize>(
    cmd: &str,
    report: &R,
    json: bool,
    text: impl FnOnce(&R) -> String,
    code: u8,
    error_code: u8,
) -> ExitCode {
    ExitCode::from(emit_code(cmd, report, json, text, code, error_code))
}

/// [`emit`], returning the exit code as a number (for runs that combine several).
fn emit_code<R: serde::Serialize>(
    cmd: &str,
    report: &R,
    json: bool,
    text: impl FnOnce(&R) -> String,
    code: u8,
    error_code: u8,
) -> u8 {
    use std::io::Write as _;
    let text = if json {
        match serde_json::to_string(report) {
            Ok(s) => s + "\n",
            Err(e) => {
                eprintln!("engy-audit {cmd}: error: serialising the report: {e}");
                return error_code;
            }
        }
    } else {
        text(report)
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => code,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => code,
        Err(e) => {
            eprintln!("engy-audit {cmd}: error: writing the report to standard output: {e}");
            error_code
        }
    }
}
