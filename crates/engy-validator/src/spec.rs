//! `engy-validator spec` (not built yet).

/// Arguments of `engy-validator spec`.
#[derive(clap::Args, Debug)]
pub struct SpecArgs {}

/// Runs `engy-validator spec`.
pub fn main(_args: SpecArgs) -> anyhow::Result<std::process::ExitCode> {
    anyhow::bail!("engy-validator spec is not built yet")
}
