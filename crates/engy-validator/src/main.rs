//! engy-validator: the light validator that keeps the master-signed SN53 weight vector on chain.
//!
//! Subcommands: `run` (the daemon), `check` (operator preflight), `health` (container
//! HEALTHCHECK), `spec` (Merkle weight commitments over a checkpoint). The auditor is the
//! separate `engy-audit` binary, so this image carries no model runtime.
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use engy_validator::{check, config, daemon, liveness};

use engy_spec as spec;

/// engy SN53 light validator.
///
/// Fetches the master-signed epoch weight vector from the provider API, verifies it, and
/// keeps it on chain with `SubtensorModule.set_weights`, resubmitting every
/// ENGY_SN53_RESUBMIT_BLOCKS blocks. Every option can be set by its ENGY_SN53_* variable.
#[derive(Parser, Debug)]
#[command(version = engy_telemetry::build_info::LONG_VERSION, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the validator daemon (exit 0 on SIGTERM/SIGINT, 1 when the watchdog fires or the
    /// configuration/wallet is unusable).
    Run(RunArgs),
    /// Preflight: wallet, provider, chain, registration, permit, stake, commit-reveal,
    /// activity and whether the current payload would land. Exit 1 on any FAIL.
    Check(config::NodeArgs),
    /// Container HEALTHCHECK: exit 0 only when the heartbeat file is fresh
    /// (younger than max(3 × POLL_S, 900 s)). The line also says whether weights land;
    /// `--landing` makes that the exit code too (for monitoring, not for the container).
    Health(HealthArgs),
    /// Build, verify, open and inspect Merkle weight commitments (specs/SCHEME.md).
    Spec(spec::SpecArgs),
}

#[derive(clap::Args, Debug)]
struct HealthArgs {
    #[command(flatten)]
    files: config::FileArgs,
    /// Also exit 1 when nothing has landed for more than half of the subnet's
    /// activity_cutoff, or when the state file refuses every vector (replay guard), as the
    /// last tick saw it. For monitoring: a container restart fixes neither.
    #[arg(long)]
    landing: bool,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    node: config::NodeArgs,
    /// Exit 0 after this many ticks (one-shot runs and tests); default: run forever.
    #[arg(long, env = "ENGY_SN53_MAX_TICKS", value_parser = clap::value_parser!(u64).range(1..))]
    ticks: Option<u64>,
    /// Log line format: `text` (default) or `json` (one object per line, for log shippers).
    /// The filter is ENGY_LOG (default `info`).
    #[arg(long, env = "ENGY_SN53_LOG_FORMAT", value_enum, default_value_t = engy_telemetry::log::LogFormat::Text)]
    log_format: engy_telemetry::log::LogFormat,
    /// Serve Prometheus metrics at http://<ADDR>/metrics (e.g. 127.0.0.1:9615); off by default.
    #[arg(long, env = "ENGY_SN53_METRICS_ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
}

/// Installs the logger; a bad ENGY_LOG is a usage error (exit 2) naming the variable.
fn init_logging(format: engy_telemetry::log::LogFormat) -> Result<(), ExitCode> {
    engy_telemetry::log::init(&engy_telemetry::log::LogConfig {
        filter_var: "ENGY_LOG",
        default_filter: "info",
        format,
        target: engy_telemetry::log::LogTarget::Stdout,
    })
    .map_err(|e| {
        fatal(&e.to_string(), 2);
        ExitCode::from(2)
    })
}

/// The log format the operator asked for (`--log-format` / `ENGY_SN53_LOG_FORMAT`), read
/// before the command line is parsed, for the errors that end the process.
fn requested_format() -> engy_telemetry::log::LogFormat {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    engy_telemetry::log::requested_format(
        &args,
        "--log-format",
        std::env::var_os("ENGY_SN53_LOG_FORMAT"),
    )
}

/// Prints an error that ends the process on stderr, as one JSON line in JSON mode.
fn fatal(message: &str, exit_code: u8) {
    engy_telemetry::log::fatal(requested_format(), "engy-validator", message, exit_code);
}

fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    if let Err(code) = init_logging(args.log_format) {
        return Ok(code);
    }
    let s = args.node.settings()?;
    // a file this uid may not read says who may (ENGY_SN53_UID/GID with compose)
    let loaded = engy_validator::wallet::load_hotkey(&s).map_err(|e| {
        let wallet = format!("wallet {}/{}", s.wallet, s.wallet_hotkey);
        match engy_validator::wallet::access_fix(&e) {
            Some(fix) => anyhow::anyhow!(
                "{wallet}: {}; fix: {fix}",
                engy_telemetry::cli::error_line(&e)
            ),
            None => anyhow::Error::new(e).context(wallet),
        }
    })?;
    let notes = engy_validator::wallet::notes(&loaded);
    for line in notes.problems.iter().chain(&notes.notes) {
        tracing::warn!("{line}");
    }
    tracing::info!(
        "engy-validator {} starting: hotkey {} (wallet {}/{}), netuid {}, chain {} ({}), api {}, master {}, poll {} s, resubmit every {} blocks, state {}, heartbeat {} (stall limit {} s)",
        engy_telemetry::build_info::LONG_VERSION,
        loaded.hotkey.ss58(),
        s.wallet,
        s.wallet_hotkey,
        s.netuid,
        s.network,
        s.chain_url,
        s.api,
        s.master_hotkey,
        s.poll_s,
        s.resubmit_blocks,
        s.state_file.display(),
        s.heartbeat_file.display(),
        liveness::stall_limit(s.poll_s)
    );
    // Say it now, not after the first landed extrinsic, when the state or heartbeat file can
    // never be written. The daemon still runs (it keeps the vector on chain, resubmitting
    // each tick since it cannot record what landed), but the watchdog restarts it every
    // stall limit because the heartbeat never advances.
    let mut state_unwritable = false;
    for (what, path) in [("state", &s.state_file), ("heartbeat", &s.heartbeat_file)] {
        if let Err(e) = engy_validator::state::probe_writable(path) {
            state_unwritable |= what == "state";
            tracing::error!(
                "the {what} file {} cannot be written ({e}); running anyway, but nothing that lands is recorded and the watchdog restarts the process every {} s; fix the directory's ownership/permissions (ENGY_SN53_UID/GID with compose) or set ENGY_SN53_{}_FILE to a writable path",
                path.display(),
                liveness::stall_limit(s.poll_s),
                what.to_ascii_uppercase()
            );
        }
    }
    // One validator process per state file: a second one would race the first on the
    // fixed temp file and on the replay guard. The kernel drops the lock when this process
    // dies (even by SIGKILL), so a restart never finds a stale lock.
    let lock_path = engy_validator::state::lock_path(&s.state_file);
    let mut lock = match std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
    {
        Ok(f) => Some(fd_lock::RwLock::new(f)),
        Err(e) => {
            tracing::warn!(
                "state lock {} cannot be opened ({e}); running without it: make sure no other validator uses this state file",
                lock_path.display()
            );
            None
        }
    };
    let _guard = match lock.as_mut().map(|l| l.try_write()) {
        Some(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
            anyhow::bail!(
                "another engy-validator process holds the lock {} of state file {} (one validator per state file); exiting 1",
                lock_path.display(),
                s.state_file.display()
            );
        }
        Some(Err(e)) => {
            tracing::warn!(
                "state lock {} cannot be taken ({e}); running without it: make sure no other validator uses this state file",
                lock_path.display()
            );
            None
        }
        Some(Ok(g)) => Some(g),
        None => None,
    };
    // A SIGKILL between the temp write and its rename leaves the fixed temp file behind;
    // it never holds the state (only the rename publishes), so it is simply removed.
    for path in [&s.state_file, &s.heartbeat_file] {
        match engy_validator::state::remove_stale_temp(path) {
            Ok(true) => tracing::info!(
                "removed {} left by a write that was killed before its rename ({} itself is intact)",
                engy_validator::state::temp_path(path).display(),
                path.display()
            ),
            Ok(false) => {}
            Err(e) => tracing::warn!(
                "stale temp file {} cannot be removed ({e}); the next write truncates it",
                engy_validator::state::temp_path(path).display()
            ),
        }
    }
    // (a state path that cannot be written at all, e.g. a directory, was named above)
    if let Some(why) = engy_validator::state::damage(&s.state_file).filter(|_| !state_unwritable) {
        tracing::warn!(
            "state file {} is {why}: it reads as empty (no replay guard, no cached vector), so the first tick submits at once; it is rewritten after the next landed extrinsic",
            s.state_file.display()
        );
    }
    let dropped = engy_validator::state::dropped_fields(&s.state_file);
    if !dropped.is_empty() {
        tracing::warn!(
            "state file {}: field(s) {} have the wrong type or value and read as absent (each field is validated on its own, PROTOCOL.md §7 step 9); the others are used; the file is rewritten after the next landed extrinsic",
            s.state_file.display(),
            dropped.join(", ")
        );
    }
    let now = liveness::unix_now();
    if let Some(ahead) = engy_validator::state::read(&s.state_file)
        .last_submit_ts
        .and_then(|ts| liveness::future_by(ts, now))
    {
        tracing::warn!(
            "state file {}: last_submit_ts is {ahead} s in the future (invalid: the clock went backwards, or the file was written on another host); treated as stale: the pre-gate does not skip on it and the schedule counts from the chain's blocks (or submits when it has none)",
            s.state_file.display()
        );
    }
    if let Some(ahead) =
        liveness::read_ts(&s.heartbeat_file).and_then(|ts| liveness::future_by(ts, now))
    {
        tracing::warn!(
            "heartbeat file {}: timestamp is {ahead} s in the future (invalid: the clock went backwards, or the file was written on another host); treated as stale (health fails on it) until the first tick stamps the current time",
            s.heartbeat_file.display()
        );
    }
    liveness::spawn_watchdog(s.heartbeat_file.clone(), s.poll_s)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut d = daemon::Daemon::new(s.clone(), loaded.hotkey)?;
        if let Some(addr) = args.metrics_addr {
            let mut registry = engy_telemetry::prometheus_client::registry::Registry::default();
            let metrics = engy_validator::metrics::Metrics::register(&mut registry);
            let server = engy_telemetry::metrics::serve(
                addr,
                std::sync::Arc::new(registry),
                std::future::pending(),
            )
            .await
            .with_context(|| format!("ENGY_SN53_METRICS_ADDR / --metrics-addr {addr}"))?;
            tracing::info!("metrics at http://{}/metrics", server.local_addr());
            d = d.with_metrics(metrics);
        }
        daemon::run(d, args.ticks).await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Parses the command line; a usage error is printed naming the variable the operator set
/// ([`config::usage_error`]) and is exit 2, except under `spec`, whose 2 is "roots differ":
/// there it is 1, spec's "bad input" (engy_spec's exit codes). Help and version exit 0 as
/// clap does.
fn parse() -> Result<Cli, ExitCode> {
    use clap::CommandFactory;
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let e = match Cli::try_parse_from(&args) {
        Ok(cli) => return Ok(cli),
        Err(e) => e,
    };
    let cmd = Cli::command();
    let spec = args
        .iter()
        .skip(1)
        .filter_map(|a| a.to_str())
        .find_map(|a| cmd.find_subcommand(a))
        .is_some_and(|s| s.get_name() == "spec");
    let code = if spec { 1 } else { 2 };
    match config::usage_error(&e, &cmd, &args, &|k| std::env::var_os(k)) {
        Some(message) => fatal(&message, code),
        // help and version print as clap does
        None if !e.use_stderr() => e.exit(),
        // a usage error clap words well (unknown flag, ...) is still one JSON line in JSON
        // mode
        None if requested_format() == engy_telemetry::log::LogFormat::Json => {
            fatal(&e.render().to_string(), code)
        }
        None => {
            let _ = e.print();
        }
    }
    Err(ExitCode::from(code))
}

/// The exit code of a failed subcommand: a configuration error says which (2 for a usage
/// error), anything else is 1.
fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<config::ConfigError>() {
        Some(c) => c.exit_code(),
        None => 1,
    }
}

fn main() -> ExitCode {
    let cli = match parse() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    // `health` names the build on a second line (docs/VALIDATOR.md).
    let health = matches!(cli.command, Command::Health(_));
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Check(args) => (|| {
            let s = args.settings()?;
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let report = rt.block_on(check::run(&s));
            Ok(if report.passed() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        })(),
        Command::Health(HealthArgs {
            files: args,
            landing,
        }) => {
            (|| {
                let (_, hb) = args.paths()?;
                let verdict = liveness::judge_landing(liveness::read_landing(&hb).as_ref());
                match liveness::judge(liveness::read_ts(&hb), liveness::unix_now(), args.poll_s) {
                    liveness::Health::Fresh { age } => {
                        check::stdout_line(&format!(
                            "ok: last tick {age} s ago; {}",
                            verdict.describe()
                        ));
                        if landing && verdict.failing() {
                            return Ok(ExitCode::FAILURE);
                        }
                        Ok(ExitCode::SUCCESS)
                    }
                    liveness::Health::Missing => {
                        check::stdout_line(&format!("unhealthy: no heartbeat at {}", hb.display()));
                        Ok(ExitCode::FAILURE)
                    }
                    liveness::Health::Stale { age, limit } => {
                        check::stdout_line(&format!(
                            "unhealthy: last tick {age} s ago (limit {limit} s)"
                        ));
                        Ok(ExitCode::FAILURE)
                    }
                    liveness::Health::Future { ahead } => {
                        eprintln!(
                        "WARN heartbeat file {} has a timestamp {ahead} s in the future (invalid: the clock went backwards, or the file was written on another host); treated as stale",
                        hb.display()
                    );
                        check::stdout_line(&format!("unhealthy: heartbeat timestamp {ahead} s in the future (treated as stale)"));
                        Ok(ExitCode::FAILURE)
                    }
                }
            })()
        }
        Command::Spec(args) => spec::main(args),
    };
    if health {
        check::stdout_line(&engy_telemetry::build_info::BUILD.describe("engy-validator"));
    }
    match result {
        Ok(code) => code,
        Err(e) => {
            let code = exit_code(&e);
            fatal(&engy_telemetry::cli::error_line(e.as_ref()), code);
            ExitCode::from(code)
        }
    }
}
