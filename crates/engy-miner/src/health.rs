//! `engy-miner health`: the container health check (docker/Dockerfile.miner). It reads the
//! running miner's own `/metrics` at ENGY_METRICS_ADDR and passes while at least one gateway
//! leg has a live session (`engy_miner_legs_connected` ≥ 1).
//!
//! Exit codes: 0 healthy, 1 unhealthy (the reason is printed), 2 ENGY_METRICS_ADDR unset or
//! not an address.
use std::process::ExitCode;
use std::time::Duration;

use crate::config::Opts;
use crate::daemon::{config_error, EXIT_CONFIG};

/// Run the check.
pub async fn run(opts: &Opts) -> ExitCode {
    let addr = match opts.metrics_socket() {
        Ok(Some(a)) => a,
        Ok(None) => {
            eprintln!("engy-miner: ENGY_METRICS_ADDR is not set: `health` reads the running miner's /metrics, so set the same --metrics-addr / ENGY_METRICS_ADDR for both");
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(e) => return config_error(e),
    };
    let url = format!("http://{addr}/metrics");
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            println!(
                "unhealthy: cannot build an HTTP client: {}",
                crate::error_chain(&e)
            );
            return ExitCode::FAILURE;
        }
    };
    let text = match client
        .get(&url)
        .send()
        .await
        .and_then(|r| r.error_for_status())
    {
        Ok(r) => match r.text().await {
            Ok(t) => t,
            Err(e) => {
                println!("unhealthy: {url}: {}", crate::error_chain(&e));
                return ExitCode::FAILURE;
            }
        },
        Err(e) => {
            println!(
                "unhealthy: {url}: {} (is the miner running with this --metrics-addr?)",
                crate::error_chain(&e)
            );
            return ExitCode::FAILURE;
        }
    };
    match legs_connected(&text) {
        Some(n) if n >= 1.0 => {
            println!("healthy: {n} gateway leg(s) connected");
            ExitCode::SUCCESS
        }
        Some(_) => {
            println!("unhealthy: no gateway leg is connected (the miner's log says why: dial failed, DENIED, …)");
            ExitCode::FAILURE
        }
        None => {
            println!("unhealthy: {url} has no engy_miner_legs_connected (not an engy-miner?)");
            ExitCode::FAILURE
        }
    }
}

/// `engy_miner_legs_connected` in a scrape's text, if present.
pub fn legs_connected(scrape: &str) -> Option<f64> {
    scrape.lines().find_map(|l| {
        l.strip_prefix("engy_miner_legs_connected ")
            .and_then(|v| v.trim().parse().ok())
    })
}
