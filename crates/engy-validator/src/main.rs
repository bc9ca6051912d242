//! engy-validator: the light validator that keeps the master-signed SN53 weight vector on chain.
use clap::Parser;

/// engy SN53 light validator (skeleton; see issue "engy-validator").
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
