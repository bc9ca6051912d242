//! engy-validator: the light validator that keeps the master-signed SN53 weight vector on chain.
//!
//! Subcommands: `run` (the daemon), `check` (operator preflight), `health` (container
//! HEALTHCHECK), `spec` (Merkle weight commitments over a checkpoint). The auditor is the
//! separate `engy-audit` binary, so this image carries no model runtime.
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use engy_validator::{check, config, daemon, liveness};

mod spec;

/// engy SN53 light validator.
///
/// Fetches the master-signed epoch weight vector from the provider API, verifies it, and
/// keeps it on chain with `SubtensorModule.set_weights`, resubmitting every
/// ENGY_SN53_RESUBMIT_BLOCKS blocks. Every option can be set by its ENGY_SN53_* variable.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
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
    /// (younger than max(3 × POLL_S, 900 s)).
    Health(config::FileArgs),
    /// Build, verify, open and inspect Merkle weight commitments (specs/SCHEME.md).
    Spec(spec::SpecArgs),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    node: config::NodeArgs,
    /// Exit 0 after this many ticks (one-shot runs and tests); default: run forever.
    #[arg(long, env = "ENGY_SN53_MAX_TICKS")]
    ticks: Option<u64>,
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("ENGY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .with_writer(std::io::stdout)
        .init();
}

fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    init_logging();
    let s = args.node.settings()?;
    let loaded = engy_validator::wallet::load_hotkey(&s)
        .with_context(|| format!("wallet {}/{}", s.wallet, s.wallet_hotkey))?;
    if loaded.insecure_permissions {
        tracing::warn!(
            "hotkey file {} is readable by others (mode {:o}); fix: chmod 600",
            loaded.path.display(),
            loaded.mode.unwrap_or(0)
        );
    }
    tracing::info!(
        "engy-validator {} starting: hotkey {} (wallet {}/{}), netuid {}, chain {} ({}), api {}, master {}, poll {} s, resubmit every {} blocks, state {}, heartbeat {} (stall limit {} s)",
        env!("CARGO_PKG_VERSION"),
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
    for (what, path) in [("state", &s.state_file), ("heartbeat", &s.heartbeat_file)] {
        if let Err(e) = engy_validator::state::probe_writable(path) {
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
    if let Some(why) = engy_validator::state::damage(&s.state_file) {
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
    liveness::spawn_watchdog(s.heartbeat_file.clone(), s.poll_s)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let d = daemon::Daemon::new(s.clone(), loaded.hotkey)?;
        daemon::run(d, args.ticks).await
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The error and its causes, `: `-joined like `{:#}`, skipping a cause whose text the
/// message already contains (several library errors print their source inline).
fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn main() -> ExitCode {
    let cli = Cli::parse();
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
        Command::Health(args) => (|| {
            let (_, hb) = args.paths()?;
            match liveness::judge(liveness::read_ts(&hb), liveness::unix_now(), args.poll_s) {
                liveness::Health::Fresh { age } => {
                    println!("ok: last tick {age} s ago");
                    Ok(ExitCode::SUCCESS)
                }
                liveness::Health::Missing => {
                    println!("unhealthy: no heartbeat at {}", hb.display());
                    Ok(ExitCode::FAILURE)
                }
                liveness::Health::Stale { age, limit } => {
                    println!("unhealthy: last tick {age} s ago (limit {limit} s)");
                    Ok(ExitCode::FAILURE)
                }
            }
        })(),
        Command::Spec(args) => spec::main(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("engy-validator: {}", describe(&e));
            ExitCode::FAILURE
        }
    }
}
