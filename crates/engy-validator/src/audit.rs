//! `engy-validator audit` (not built yet).

/// Arguments of `engy-validator audit`.
#[derive(clap::Args, Debug)]
pub struct AuditArgs {}

/// Runs `engy-validator audit`.
pub fn main(_args: AuditArgs) -> anyhow::Result<std::process::ExitCode> {
    anyhow::bail!("engy-validator audit is not built yet")
}
