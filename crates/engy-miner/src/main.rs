//! engy-miner: bridges the engy gateway (websocket) to local sglang serves and proves every
//! completion with TOPLOC (PROTOCOL.md §2–§5). See docs/MINER.md.
use std::process::ExitCode;

use clap::Parser;
use engy_miner::config::{Cli, Cmd};
use engy_miner::{check, daemon};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
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
        Some(Cmd::Run) | None => rt.block_on(daemon::run(cli.opts)),
    }
}

/// `RUST_LOG` (default `info`) to stderr, with one rule no filter can lift: the websocket
/// library's TRACE events are dropped, because they dump whole frames and the HELLO frame
/// carries MINER_KEY (docs/SECURITY.md).
fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let no_frame_dumps = tracing_subscriber::filter::filter_fn(|meta| {
        let t = meta.target();
        !(*meta.level() == tracing::Level::TRACE
            && (t.starts_with("tungstenite") || t.starts_with("tokio_tungstenite")))
    });
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .with_filter(no_frame_dumps);
    tracing_subscriber::registry().with(filter).with(fmt).init();
}
