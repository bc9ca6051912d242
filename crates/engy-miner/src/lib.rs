//! engy-miner as a library: the pieces of the miner binary, public for its integration
//! tests and benchmarks. The binary (`src/main.rs`) only parses the command line; see
//! docs/MINER.md and ARCHITECTURE.md "engy-miner".
//!
//! One request, top to bottom: [`gateway::session`] reads a `serve` frame and registers a
//! [`job::Job`] in the [`gateway::Hub`]; [`serve::Engine::process`] renders the prompt
//! ([`chat`]), picks a serve ([`serve::pool`]), runs the chunked generation (one `/generate`
//! call at a time, read by [`scan`]), builds the proof ([`proof`]); the session sends the
//! terminal frame ([`engy_core::wire`]) and unregisters the job.
//!
//! * [`daemon`]: `engy-miner run` (settings, checkpoint, lock, legs, signals, drain).
//! * [`config`]: CLI and environment (docs/PROTOCOL.md §3).
//! * [`gateway`]: legs, sessions, the hub with the one registry of jobs, chunk coalescing.
//! * [`serve`]: the request path on the sglang serves.
//! * [`scan`]: the single-pass `/generate` reply scanner (hidden states → bf16 rows).
//! * [`metrics`]: the Prometheus metrics behind `--metrics-addr`; [`health`]: `engy-miner health`.
//! * [`cell_store`]: committed cells kept for `open_cells` (time and size bounded).
//! * [`job`], [`proof`], [`chat`], [`hw`], [`check`] (the `engy-miner check` preflight).
use std::path::Path;

use sha2::{Digest, Sha256};

pub mod cell_store;
pub mod chat;
pub mod check;
pub mod config;
pub mod daemon;
pub mod gateway;
pub mod health;
pub mod hw;
pub mod job;
pub mod metrics;
pub mod proof;
pub mod scan;
pub mod serve;

use config::Opts;

/// `worker_name` (§2.3): flag/ENGY_WORKER_NAME, legacy ENGY_INSTANCE_ID, else derived.
pub fn worker_name(opts: &Opts) -> String {
    if let Some(w) = opts.worker_name.as_ref().filter(|w| !w.is_empty()) {
        return w.clone();
    }
    if let Ok(w) = std::env::var("ENGY_INSTANCE_ID") {
        if !w.is_empty() {
            return w;
        }
    }
    let seed = format!(
        "{}|{}|{}",
        hw::hostname(),
        opts.model,
        opts.serve_urls().join(",")
    );
    let digest = hex::encode(Sha256::digest(seed.as_bytes()));
    format!("ins-{}", digest.get(..12).unwrap_or(&digest))
}

/// Writes `line` and a newline to standard output (the output of `check` and `health`). A
/// write that fails, above all a reader that closed the pipe (`engy-miner check | head -1`),
/// is ignored instead of panicking as `println!` does: the command runs on and its exit code
/// stays its verdict's (docs/MINER.md "Preflight, then start").
pub fn stdout_line(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// An error with its whole cause chain, `: `-joined, skipping a cause whose text is already
/// in the message (reqwest alone says only "error sending request for url (…)"; the cause
/// says connection refused, DNS failure, TLS, timeout).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// `GW` checked for what the miner does with it (docs/PROTOCOL.md §2): a `ws://`/`wss://` URL
/// with a host, to which `/meta` and `/<worker>` are appended, so no query or fragment.
/// Errors say what to fix and never echo a query (it could hold a token).
pub fn check_gw(gw: &str) -> Result<(), String> {
    let url = reqwest::Url::parse(gw).map_err(|e| format!("GW is not a URL ({e})"))?;
    if !matches!(url.scheme(), "ws" | "wss") {
        return Err(format!(
            "GW must be a ws:// or wss:// URL, got a {}:// URL",
            url.scheme()
        ));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err("GW has no host: export GW=wss://<gateway-host>/gw".into());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "GW must not carry a query (?…) or fragment (#…): the miner appends /meta and /<worker> to it; use {}://{}{} (the key goes in MINER_KEY)",
            url.scheme(),
            url.host_str().unwrap_or_default(),
            url.path().trim_end_matches('/')
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("GW must not carry credentials (user:pass@); the key goes in MINER_KEY".into());
    }
    Ok(())
}

/// `hidden_size` of `<checkpoint>/config.json` (top level or `text_config`), if any.
pub fn hidden_size(checkpoint: &Path) -> Option<usize> {
    checkpoint_hidden_size(checkpoint).ok()
}

/// `hidden_size` of `<checkpoint>/config.json` (top level, else `text_config`, as
/// multimodal checkpoints nest it): every hidden-state row must have this many values.
///
/// # Errors
/// A sentence naming the file and what is wrong with it (unreadable, not JSON, no positive
/// integer `hidden_size`).
pub fn checkpoint_hidden_size(checkpoint: &Path) -> Result<usize, String> {
    let path = checkpoint.join("config.json");
    let raw = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_slice(&raw).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    v.get("hidden_size")
        .or_else(|| v.pointer("/text_config/hidden_size"))
        .and_then(serde_json::Value::as_u64)
        .filter(|h| *h > 0)
        .and_then(|h| usize::try_from(h).ok())
        .ok_or_else(|| {
            format!(
                "{} has no positive integer hidden_size (top level or text_config)",
                path.display()
            )
        })
}
