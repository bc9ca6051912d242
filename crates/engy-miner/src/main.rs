//! engy-miner: bridges the engy gateway (websocket) to a local sglang serve and proves every completion.
use clap::Parser;

/// engy SN53 miner (skeleton; see issue "engy-miner").
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
