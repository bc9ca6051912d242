//! engy-miner: bridges the engy gateway (websocket) to local sglang serves and proves every
//! completion with TOPLOC (docs/PROTOCOL.md §2–§5). See docs/MINER.md.
use std::process::ExitCode;

use clap::Parser;
use engy_miner::config::{Cli, Cmd};
use engy_miner::{check, daemon, health};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // RUST_LOG (default `info`) to stderr, text or JSON. The websocket library logs through
    // the `log` crate, which is not bridged into this logger: its TRACE frame dumps (the
    // HELLO frame carries MINER_KEY) reach no log at any level (docs/SECURITY.md).
    let log = engy_telemetry::log::LogConfig {
        filter_var: "RUST_LOG",
        default_filter: "info",
        format: cli.opts.log_format,
        target: engy_telemetry::log::LogTarget::Stderr,
    };
    if let Err(e) = engy_telemetry::log::init(&log) {
        return daemon::config_error(e);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("engy-miner: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.cmd {
        Some(Cmd::Check) => rt.block_on(check::run(&cli.opts)),
        Some(Cmd::Health) => rt.block_on(health::run(&cli.opts)),
        Some(Cmd::Run) | None => rt.block_on(daemon::run(cli.opts)),
    }
}
