//! engy-audit: the auditor, a binary of its own so the light validator's image carries no
//! model runtime (`engy-validator` links neither engy-model nor candle).
//!
//! * `audit` ([`audit`]): one miner commitment against the pinned checkpoint; exit 0 pass,
//!   1 cheat, 2 unproven, 3 the audit could not run.
//! * `cells` ([`cells`]): the sampled cell audit of one request: the auditor's own challenge
//!   (commitment, beacon, policy `n`), the miner's answer (a bundle, or a refusal) against it,
//!   the cells against the checkpoint whose touched weights are checked against the trusted
//!   `model_root`; exit 0 pass, 1 cheat, 2 not judged, 3 the audit could not run, 4 the
//!   checkpoint is not the committed one.
//! * `spec` ([`spec`]): build, verify, open and inspect Merkle weight commitments
//!   (specs/SCHEME.md); the same code and exit codes as `engy-validator spec`.
//!
//! A usage error (an unknown flag, a value that does not parse, from a flag or from its
//! variable, a missing argument) is the subcommand's "could not run" code: 3 for `audit` and
//! `cells`, 1 for `spec` (and 3 with no subcommand), never a verdict's code; the message names
//! the variable when the value came from one ([`engy_telemetry::cli::usage_error`]). Help and
//! version exit 0.
use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

mod audit;
mod cells;
// `spec` is the engy-spec crate, the same command as `engy-validator spec`.
use engy_spec as spec;

/// engy SN53 auditor.
///
/// Recomputes a miner commitment's hidden states from the pinned checkpoint and checks its
/// TOPLOC proofs; builds and verifies the checkpoint's Merkle weight commitment.
#[derive(Parser, Debug)]
#[command(version = engy_telemetry::build_info::LONG_VERSION, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Audit a miner commitment against a checkpoint (teacher-forced recompute + TOPLOC
    /// verify). Exit 0 pass, 1 cheat, 2 unproven, 3 the audit could not run (a usage error
    /// included).
    Audit(audit::AuditArgs),
    /// The sampled cell audit of one request: the auditor's challenge (from the commitment,
    /// the beacon and its policy) and the miner's answer to it (a bundle of opened cells, or a
    /// refusal), checked against the checkpoint, whose touched weights are checked against the
    /// trusted model_root. Exit 0 pass, 1 cheat (a failed cell, a bundle that does not answer
    /// the challenge, a refusal inside the retention window), 2 not judged, 3 the audit could
    /// not run (a usage error included), 4 the checkpoint is not the committed one.
    Cells(cells::CellsArgs),
    /// Build, verify, open and inspect Merkle weight commitments (specs/SCHEME.md).
    /// Exit 0 done / matches, 1 bad input (a usage error included), 2 roots differ or the
    /// proof is rejected.
    Spec(spec::SpecArgs),
    /// The audit service: takes the gateway's reports over HTTP, samples them by a chain
    /// beacon, audits them on resident workers and keeps verdicts and evidence in SQLite or
    /// PostgreSQL (docs/AUDIT-SERVICE.md). Runs until SIGTERM; exit 0 stopped,
    /// 1 failed, 3 a setting not usable.
    Serve(Box<engy_audit_service::ServeArgs>),
}

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => return usage(&e, &args),
    };
    match cli.command {
        Command::Audit(args) => audit::main(&args),
        Command::Cells(args) => cells::main(&args),
        Command::Serve(args) => engy_audit_service::main(&args),
        Command::Spec(args) => match spec::main(args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!(
                    "engy-audit spec: error: {}",
                    engy_telemetry::cli::error_line(e.as_ref())
                );
                ExitCode::from(1)
            }
        },
    }
}

/// Prints a usage error (naming the variable the value came from, when it did) and returns
/// the subcommand's "could not run" code (module docs); help and version print and exit 0.
fn usage(e: &clap::Error, args: &[OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        e.exit()
    }
    let cmd = Cli::command();
    let message = engy_telemetry::cli::usage_error(e, &cmd, args, &|k| std::env::var_os(k))
        .unwrap_or_else(|| e.render().to_string());
    eprint!("{message}");
    let sub = args
        .iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .find_map(|a| cmd.find_subcommand(a))
        .map(|s| s.get_name().to_owned());
    let code = match sub.as_deref() {
        Some("spec") => 1,
        Some("cells") => cells::EXIT_ERROR,
        _ => audit::EXIT_ERROR,
    };
    eprintln!("engy-audit: nothing was run: fix the command line above (exit {code})");
    ExitCode::from(code)
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
