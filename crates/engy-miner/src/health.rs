//! `engy-miner health`: the container health check (docker/Dockerfile.miner). It reads the
//! running miner's own `/metrics` at ENGY_METRICS_ADDR and passes while at least one gateway
//! leg has a live session (`engy_miner_legs_connected` ≥ 1). It names the build that runs
//! (the scrape's `engy_miner_build_info`), which can differ from this binary's after an
//! upgrade on disk.
//!
//! Output: one line on stdout, `healthy: …` / `unhealthy: …` ending in the running build; or
//! under `--log-format json` one object `{"status", "detail", "legs_connected", "running"}`.
//! Exit codes: 0 healthy, 1 anything else: unhealthy (the reason is printed), and also
//! ENGY_METRICS_ADDR unset or not an address (said once on stderr, as the start-up refusals
//! are). Never 2: Docker reserves it for a HEALTHCHECK command
//! (<https://docs.docker.com/reference/dockerfile/#healthcheck>).
use std::process::ExitCode;
use std::time::Duration;

use engy_telemetry::build_info::{self, BUILD};
use engy_telemetry::log::LogFormat;
use serde_json::json;

use crate::config::Opts;
use crate::daemon::fatal;

/// Run the check.
pub async fn run(opts: &Opts) -> ExitCode {
    let addr = match opts.metrics_socket() {
        Ok(Some(a)) => a,
        Ok(None) => return unusable(opts.log_format, "ENGY_METRICS_ADDR is not set: `health` reads the running miner's /metrics, so set the same --metrics-addr / ENGY_METRICS_ADDR for both"),
        Err(e) => return unusable(opts.log_format, e),
    };
    let url = format!("http://{addr}/metrics");
    let out = |healthy: bool,
               detail: String,
               legs: Option<f64>,
               running: Option<(String, String, String)>| {
        print(opts.log_format, healthy, &detail, legs, running.as_ref())
    };
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            return out(
                false,
                format!("cannot build an HTTP client: {}", crate::error_chain(&e)),
                None,
                None,
            )
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
                return out(
                    false,
                    format!("{url}: {}", crate::error_chain(&e)),
                    None,
                    None,
                )
            }
        },
        Err(e) => {
            return out(
                false,
                format!(
                    "{url}: {} (is the miner running with this --metrics-addr?)",
                    crate::error_chain(&e)
                ),
                None,
                None,
            )
        }
    };
    let running = build_info::parse_scraped(&text, "engy_miner_build_info");
    match legs_connected(&text) {
        Some(n) if n >= 1.0 => out(
            true,
            format!("{n} gateway leg(s) connected"),
            Some(n),
            running,
        ),
        Some(n) => out(
            false,
            "no gateway leg is connected (the miner's log says why: dial failed, DENIED, …)".into(),
            Some(n),
            running,
        ),
        None => out(
            false,
            format!("{url} has no engy_miner_legs_connected (not an engy-miner?)"),
            None,
            running,
        ),
    }
}

/// A setting `health` cannot work with: one fatal line on stderr, exit 1 (not 2, which
/// Docker reserves for a HEALTHCHECK).
fn unusable(format: LogFormat, msg: impl std::fmt::Display) -> ExitCode {
    fatal(format, msg, 1);
    ExitCode::FAILURE
}

/// Prints the verdict (text or one JSON object) and gives its exit code.
fn print(
    format: LogFormat,
    healthy: bool,
    detail: &str,
    legs: Option<f64>,
    running: Option<&(String, String, String)>,
) -> ExitCode {
    let status = if healthy { "healthy" } else { "unhealthy" };
    match format {
        LogFormat::Text => {
            let build = match running {
                Some((v, c, d)) => format!("running engy-miner {v} (commit {c}, dirty={d})"),
                None => format!(
                    "running build unknown; this binary is {}",
                    BUILD.describe("engy-miner")
                ),
            };
            crate::stdout_line(&format!("{status}: {detail}; {build}"));
        }
        LogFormat::Json => {
            let running = running.map(|(v, c, d)| json!({"version": v, "commit": c, "dirty": d}));
            crate::stdout_line(
                &json!({"status": status, "detail": detail, "legs_connected": legs, "running": running})
                    .to_string(),
            );
        }
    }
    if healthy {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `engy_miner_legs_connected` in a scrape's text, if present.
pub fn legs_connected(scrape: &str) -> Option<f64> {
    scrape.lines().find_map(|l| {
        l.strip_prefix("engy_miner_legs_connected ")
            .and_then(|v| v.trim().parse().ok())
    })
}
