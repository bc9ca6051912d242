//! engy-validator: the light validator that keeps the master-signed SN53 weight vector on chain.
//!
//! Subcommands: `run` (the daemon), `check` (operator preflight), `health` (container
//! HEALTHCHECK), `audit` (re-derive a miner's hidden states and check its TOPLOC proof),
//! `spec` (Merkle weight commitments over a checkpoint).
use clap::{Parser, Subcommand};

mod audit;
mod spec;

/// engy SN53 light validator.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Audit a miner commitment against a checkpoint (teacher-forced recompute + TOPLOC verify).
    Audit(audit::AuditArgs),
    /// Build, verify, open and inspect Merkle weight commitments (specs/SCHEME.md).
    Spec(spec::SpecArgs),
}

fn main() -> anyhow::Result<std::process::ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Audit(args) => audit::main(args),
        Command::Spec(args) => spec::main(args),
    }
}
