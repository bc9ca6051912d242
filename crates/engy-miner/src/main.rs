//! engy-miner: bridges the engy gateway (websocket) to local sglang serves and proves every
//! completion with TOPLOC (docs/PROTOCOL.md §2–§5). See docs/MINER.md.
use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use engy_miner::config::{Cli, Cmd};
use engy_miner::{check, daemon, health};
use engy_telemetry::cli::usage_error;
use engy_telemetry::log::{requested_format, LogFormat};

fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let cli = match Cli::try_parse_from(&args) {
        Ok(cli) => cli,
        Err(e) => return usage(&e, &args),
    };
    let format = cli.opts.log_format;
    // RUST_LOG (default `info`) to stderr, text or JSON. The websocket library logs through
    // the `log` crate, which is not bridged into this logger: its TRACE frame dumps (the
    // HELLO frame carries MINER_KEY) reach no log at any level (docs/SECURITY.md).
    let log = engy_telemetry::log::LogConfig {
        filter_var: "RUST_LOG",
        default_filter: "info",
        format,
        target: engy_telemetry::log::LogTarget::Stderr,
    };
    if let Err(e) = engy_telemetry::log::init(&log) {
        return daemon::config_error(format, e);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            daemon::fatal(format, format!("cannot start the async runtime: {e}"), 1);
            return ExitCode::FAILURE;
        }
    };
    match cli.cmd {
        Some(Cmd::Check) => rt.block_on(check::run(&cli.opts)),
        Some(Cmd::Health) => rt.block_on(health::run(&cli.opts)),
        Some(Cmd::Run) | None => rt.block_on(daemon::run(cli.opts)),
    }
}

/// A command line clap refuses: help and version as clap prints them (exit 0); any other
/// error names the variable the operator set (`MAX_INFLIGHT`, not `--max-inflight`), as one
/// JSON line under `--log-format json` / ENGY_LOG_FORMAT=json, exit 2.
fn usage(e: &clap::Error, args: &[OsString]) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        e.exit()
    }
    // Built, so that the subcommands carry the global settings' flags and variables.
    let mut cmd = Cli::command();
    cmd.build();
    let message = usage_error(e, &cmd, args, &|k| std::env::var_os(k))
        .unwrap_or_else(|| e.render().to_string());
    match requested_format(args, "--log-format", std::env::var_os("ENGY_LOG_FORMAT")) {
        LogFormat::Text => eprint!("{message}"),
        f => daemon::fatal(f, message, daemon::EXIT_CONFIG),
    }
    ExitCode::from(daemon::EXIT_CONFIG)
}
