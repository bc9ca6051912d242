//! `engy-miner check`: the operator's preflight. Prints one `ok`/`FAIL` line per check, each
//! FAIL with its fix, and a summary line; exits 1 if anything failed. Under `--log-format
//! json` it prints one JSON object instead (docs/MINER.md "Preflight"):
//! `{"passed": bool, "failed": n, "checks": [{"check", "ok", "detail", "fix"?, "warn"?}],
//! "build"}`. A `warn` line (an optional feature the serve lacks, such as the routing
//! trace) is not a failure.
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use engy_core::toploc::{build_proofs_base64, verify_proofs_base64, Dtype, Params};
use engy_telemetry::log::LogFormat;
use serde_json::{json, Value};

use crate::config::Opts;
use crate::scan::{scan_reply, HiddenMode};
use crate::serve::offers;
use crate::serve::trace::TraceShapes;

/// The checks so far: printed as they come in text mode, collected for one object in JSON.
struct Report {
    format: LogFormat,
    failed: usize,
    checks: Vec<Value>,
}

impl Report {
    fn new(format: LogFormat) -> Self {
        Self {
            format,
            failed: 0,
            checks: Vec::new(),
        }
    }
    fn ok(&mut self, what: &str, detail: impl std::fmt::Display) {
        match self.format {
            LogFormat::Text => crate::stdout_line(&format!("ok   {what}: {detail}")),
            LogFormat::Json => self
                .checks
                .push(json!({"check": what, "ok": true, "detail": detail.to_string()})),
        }
    }
    /// Something optional is missing: printed with its fix, not counted as a failure.
    fn warn(&mut self, what: &str, detail: impl std::fmt::Display, fix: &str) {
        match self.format {
            LogFormat::Text => {
                crate::stdout_line(&format!("warn {what}: {detail}\n     fix: {fix}"))
            }
            LogFormat::Json => self.checks.push(
                json!({"check": what, "ok": true, "warn": true, "detail": detail.to_string(), "fix": fix}),
            ),
        }
    }
    fn fail(&mut self, what: &str, detail: impl std::fmt::Display, fix: &str) {
        self.failed += 1;
        match self.format {
            LogFormat::Text => {
                crate::stdout_line(&format!("FAIL {what}: {detail}\n     fix: {fix}"))
            }
            LogFormat::Json => self.checks.push(
                json!({"check": what, "ok": false, "detail": detail.to_string(), "fix": fix}),
            ),
        }
    }
    /// The summary (text) or the whole report (JSON), and the exit code.
    fn finish(self) -> ExitCode {
        match self.format {
            LogFormat::Text if self.failed == 0 => crate::stdout_line("all checks passed"),
            LogFormat::Text => crate::stdout_line(&format!("{} check(s) failed", self.failed)),
            LogFormat::Json => {
                let b = engy_telemetry::build_info::BUILD;
                crate::stdout_line(
                    &json!({
                        "passed": self.failed == 0,
                        "failed": self.failed,
                        "checks": self.checks,
                        "build": {"version": b.version, "commit": b.commit, "dirty": b.dirty_flag()},
                    })
                    .to_string(),
                );
            }
        }
        if self.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

/// Run every check; the exit code is 1 when any failed.
pub async fn run(opts: &Opts) -> ExitCode {
    let mut r = Report::new(opts.log_format);
    let mut hidden = None;
    match &opts.checkpoint {
        None => r.fail(
            "checkpoint",
            "not set",
            "pass --checkpoint DIR or set CHECKPOINT",
        ),
        Some(dir) => {
            match crate::chat::Prompter::load(dir) {
                Ok(p) => {
                    let msgs = json!([{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Hello!"}]);
                    match p.prompt_ids(&msgs) {
                        Ok(ids) => r.ok("tokenizer + chat template", format!("a 2-message chat renders to {} tokens", ids.len())),
                        Err(e) => r.fail("chat template", e, "the checkpoint's chat_template must render system/user messages"),
                    }
                }
                Err(e) => r.fail(
                    "tokenizer + chat template",
                    e,
                    "the checkpoint folder needs tokenizer.json and tokenizer_config.json (chat_template) or chat_template.jinja",
                ),
            }
            match engy_core::identity::model_root(dir) {
                Ok(root) => r.ok("model_root", root),
                Err(e) => r.fail(
                    "model_root",
                    e,
                    "point --checkpoint at the model folder (config.json, *.safetensors)",
                ),
            }
            hidden = crate::hidden_size(dir);
            match hidden {
                Some(h) => r.ok("config.json hidden_size", h),
                None => r.fail(
                    "config.json hidden_size",
                    "missing",
                    "the checkpoint's config.json must carry hidden_size",
                ),
            }
        }
    }
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            r.fail("http client", e, "report this");
            return r.finish();
        }
    };
    for serve in opts.serve_urls() {
        check_serve(&mut r, &client, &serve, hidden, opts).await;
    }
    check_cells_spool(&mut r, opts);
    // The key itself is never printed, only whether the miner would start with it.
    match opts.miner_key.as_ref().filter(|k| !k.expose().is_empty()) {
        Some(_) => r.ok("MINER_KEY", "set"),
        None => r.fail(
            "MINER_KEY",
            "not set (the miner refuses to start without it)",
            "export MINER_KEY=<your miner key>",
        ),
    }
    if let Err(e) = opts.validate() {
        r.fail("settings", &e, "see docs/MINER.md \"Configuration\"");
    }
    if let Some(Err(e)) = hidden.map(|h| opts.validate_topk(h)) {
        r.fail("settings", &e, "see docs/MINER.md \"Configuration\"");
    }
    match opts.gw.as_deref().filter(|g| !g.is_empty()) {
        None => r.fail("gateway", "GW not set", "export GW=wss://<gateway-host>/gw"),
        Some(gw) => {
            let url = format!("{}/meta", crate::gateway::http_base(gw));
            match client
                .get(&url)
                .timeout(Duration::from_secs(10))
                .send()
                .await
            {
                Ok(resp) if resp.status().is_success() => match resp.json::<Value>().await {
                    Ok(v) => r.ok(
                        "gateway /meta",
                        format!(
                            "{url} → workers {}",
                            v.get("workers").cloned().unwrap_or(Value::Null)
                        ),
                    ),
                    Err(e) => r.fail(
                        "gateway /meta",
                        format!("{url}: not JSON ({e})"),
                        "check GW",
                    ),
                },
                Ok(resp) => r.fail(
                    "gateway /meta",
                    format!("{url} → HTTP {}", resp.status()),
                    "check GW; set ENGY_GW_WORKERS if /meta is not served",
                ),
                Err(e) => r.fail(
                    "gateway /meta",
                    format!("{url}: {}", crate::error_chain(&e)),
                    "check GW and outbound network access",
                ),
            }
        }
    }
    r.finish()
}

/// How long the start-up probe waits for one serve's `/get_model_info`.
pub const STARTUP_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The start-up probe of `run`: asks each serve's `/get_model_info` once (concurrently,
/// [`STARTUP_PROBE_TIMEOUT`] each) and logs one WARN per serve that does not answer 2xx,
/// with the fix. It never stops the miner: requests routed to a serve that is down get
/// error responses until it is up (sglang-native-api.md, `/get_model_info`). Returns the
/// `(serve URL, problem)` pairs it warned about.
pub async fn probe_serves(serves: &[String]) -> Vec<(String, String)> {
    let client = match reqwest::Client::builder()
        .timeout(STARTUP_PROBE_TIMEOUT)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("start-up serve probe skipped: cannot build an HTTP client ({e})");
            return Vec::new();
        }
    };
    let probes = serves.iter().map(|serve| {
        let client = client.clone();
        async move {
            let problem = match client.get(format!("{serve}/get_model_info")).send().await {
                Ok(resp) if resp.status().is_success() => return None,
                Ok(resp) => format!("HTTP {}", resp.status()),
                Err(e) => crate::error_chain(&e),
            };
            Some((serve.clone(), problem))
        }
    });
    let down: Vec<(String, String)> = futures_util::future::join_all(probes)
        .await
        .into_iter()
        .flatten()
        .collect();
    for (serve, problem) in &down {
        tracing::warn!(
            "serve {serve} does not answer /get_model_info ({problem}); the miner runs anyway and requests sent to it get error responses until it is up — fix: start sglang there with --enable-return-hidden-states, or correct --serve-url / SERVE_URL (`engy-miner check` tests it fully)"
        );
    }
    down
}

/// One line per trace kind: collected and offered, off, not applicable, or missing on the
/// serve (a `warn`, with the flag to add). docs/PROTOCOL.md §3.10.
async fn check_traces(r: &mut Report, client: &reqwest::Client, serve: &str, opts: &Opts) {
    let Some(dir) = opts.checkpoint.as_deref() else {
        return;
    };
    let shapes = TraceShapes::from_checkpoint(dir, true, true);
    let offers = offers::fetch(client, serve).await;
    let kinds = [
        (
            "routing trace",
            shapes.routing,
            opts.routing_trace.is_on(),
            offers.as_ref().map(|o| o.routing),
            "routed experts",
            "--enable-return-routed-experts",
            "ENGY_ROUTING_TRACE",
        ),
        (
            "indexer trace",
            shapes.indexer,
            opts.indexer_trace.is_on(),
            offers.as_ref().map(|o| o.indexer),
            "the indexer top-k",
            "--enable-return-indexer-topk",
            "ENGY_INDEXER_TRACE",
        ),
    ];
    for (what, shape, on, offered, name, flag, var) in kinds {
        let what = format!("serve {serve} {what}");
        let Some(shape) = shape else {
            if what.ends_with("routing trace") {
                r.ok(&what, "not collected: config.json names no MoE routing (num_hidden_layers, num_experts_per_tok, an expert count)");
            }
            continue;
        };
        match offered {
            Ok(true) if on => r.ok(
                &what,
                format!(
                    "serve offers {name} ({flag}): commitments carry a trace of {} × {} ids per token",
                    shape.layers, shape.width
                ),
            ),
            Ok(o) if !on => r.ok(
                &what,
                format!(
                    "off ({var}=off); the serve {} {name}",
                    if o { "offers" } else { "does not offer" }
                ),
            ),
            Ok(_) => r.warn(
                &what,
                format!("serve does not offer {name}: commitments carry no such trace"),
                &format!("start sglang with {flag}, or set {var}=off"),
            ),
            Err(e) => r.warn(
                &what,
                format!("cannot read the serve's server info ({e}): no trace is asked until it answers"),
                "check that /server_info (or /get_server_info) answers",
            ),
        }
    }
    if opts.cells.is_on() && shapes.routing.is_some() {
        let what = format!("serve {serve} cells hooks");
        match offers {
            Ok(o) if o.cells => r.ok(
                &what,
                "started with the engy_cells --forward-hooks: a commit pass after each generation commits its cells",
            ),
            Ok(_) => r.warn(
                &what,
                "its server info's forward_hooks names no engy_cells hook factory: commitments carry no cells",
                "start sglang with --forward-hooks \"$(engy-cells-hooks $ENGY_CELLS_SPOOL)\" (integrations/sglang/README.md), or set ENGY_CELLS=off",
            ),
            Err(e) => r.warn(
                &what,
                format!("cannot read the serve's server info ({e}): no commit pass runs until it answers"),
                "check that /server_info (or /get_server_info) answers",
            ),
        }
    }
}

/// The cells line (docs/PROTOCOL.md §10): off, or on with a spool directory the miner can
/// write (it removes the hooks' old request directories there).
fn check_cells_spool(r: &mut Report, opts: &Opts) {
    if !opts.cells.is_on() {
        r.ok("cells", "off (ENGY_CELLS=off): commitments carry no cells");
        return;
    }
    let Some(spool) = opts
        .cells_spool
        .as_deref()
        .filter(|p| !p.as_os_str().is_empty())
    else {
        r.fail(
            "cells",
            "on, but ENGY_CELLS_SPOOL is not set",
            "export ENGY_CELLS_SPOOL=<the spool directory the serve's engy_cells hooks write>",
        );
        return;
    };
    let at = spool.display();
    if !spool.is_dir() {
        r.fail(
            "cells",
            format!("on, but the spool {at} is not a directory (the hooks create it when the serve starts)"),
            "start the serve with the engy_cells hooks writing there, or correct ENGY_CELLS_SPOOL",
        );
        return;
    }
    let probe = spool.join(format!(
        ".engy-miner-check-{}",
        uuid::Uuid::new_v4().simple()
    ));
    match std::fs::write(&probe, b"") {
        Ok(()) => {
            let _ = std::fs::remove_file(&probe);
            r.ok(
                "cells",
                format!(
                    "on: spool {at} is writable; cells kept {} s, up to {} MiB",
                    opts.cells_retain_s, opts.cells_retain_mb
                ),
            );
        }
        Err(e) => r.fail(
            "cells",
            format!("on, but the spool {at} is not writable by the miner ({e})"),
            "give the miner's user write access to ENGY_CELLS_SPOOL (it removes spooled requests it has read)",
        ),
    }
}

async fn check_serve(
    r: &mut Report,
    client: &reqwest::Client,
    serve: &str,
    hidden: Option<usize>,
    opts: &Opts,
) {
    let what = format!("serve {serve} /get_model_info");
    match client
        .get(format!("{serve}/get_model_info"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
    {
        Ok(resp) if resp.status().is_success() => {
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            r.ok(
                &what,
                format!(
                    "model_path {}",
                    v.get("model_path").cloned().unwrap_or(Value::Null)
                ),
            );
            check_traces(r, client, serve, opts).await;
        }
        Ok(resp) => {
            r.fail(
                &what,
                format!("HTTP {}", resp.status()),
                "is sglang up on that port?",
            );
            return;
        }
        Err(e) => {
            r.fail(
                &what,
                crate::error_chain(&e),
                "start the sglang serve, or fix --serve-url",
            );
            return;
        }
    }
    let what = format!("serve {serve} /generate with hidden states");
    let body = json!({"input_ids":[1,2,3],"sampling_params":{"temperature":0.0,"max_new_tokens":4,"ignore_eos":true},
                      "rid":format!("engy-check-{}", uuid::Uuid::new_v4().simple()),
                      "return_hidden_states":true,"return_logprob":true});
    let bytes = match client
        .post(format!("{serve}/generate"))
        .json(&body)
        .send()
        .await
    {
        Ok(resp) => {
            let status = resp.status();
            match resp.bytes().await {
                Ok(b) if status.is_success() => b,
                Ok(b) => {
                    let msg = scan_reply(&b, HiddenMode::Skip, false)
                        .ok()
                        .and_then(|x| x.error)
                        .unwrap_or_default();
                    r.fail(
                        &what,
                        format!("HTTP {status}: {msg}"),
                        "start sglang with --enable-return-hidden-states",
                    );
                    return;
                }
                Err(e) => {
                    r.fail(
                        &what,
                        crate::error_chain(&e),
                        "the serve broke the connection",
                    );
                    return;
                }
            }
        }
        Err(e) => {
            r.fail(&what, crate::error_chain(&e), "the serve did not answer");
            return;
        }
    };
    let reply = match scan_reply(&bytes, HiddenMode::Always, false) {
        Ok(x) => x,
        Err(e) => {
            r.fail(&what, e, "the serve's reply is not sglang's /generate JSON");
            return;
        }
    };
    let rows = match reply.rows {
        Some(rows) if rows.n_rows > 0 => rows,
        _ => {
            r.fail(
                &what,
                "no hidden states in the reply",
                "start sglang with --enable-return-hidden-states; remove any hook trimming them",
            );
            return;
        }
    };
    if rows.n_rows != 4 || rows.ragged.is_some() || hidden.map(|h| h != rows.width).unwrap_or(false)
    {
        r.fail(
            &what,
            {
                let expected = match hidden {
                    Some(h) => format!("4 rows of {h} (config.json hidden_size)"),
                    None => "4 rows".to_string(),
                };
                let ragged = match rows.ragged {
                    Some((i, w)) => format!("; row {i} has {w} values"),
                    None => String::new(),
                };
                format!(
                    "{} rows of {} values, expected {expected}{ragged}",
                    rows.n_rows, rows.width
                )
            },
            "the serve must run the checkpoint given by --checkpoint, without speculative decoding",
        );
        return;
    }
    r.ok(&what, format!("4 rows of {}", rows.width));
    let what = format!("serve {serve} TOPLOC proof");
    let params = Params {
        topk: opts.toploc_topk,
        decode_batching_size: opts.toploc_dbs,
        skip_prefill: true,
    };
    let bits = Arc::new(rows.bits);
    let elements: Vec<&[u16]> = bits.chunks_exact(rows.width.max(1)).collect();
    match build_proofs_base64(&elements, Dtype::Bf16, &params) {
        Ok(proofs) => match verify_proofs_base64(&elements, Dtype::Bf16, &proofs, &params) {
            Ok(res) if res.iter().all(|v| v.exp_mismatches == 0) => {
                r.ok(&what, format!("{} proof(s) build and verify", proofs.len()))
            }
            Ok(res) => r.fail(
                &what,
                format!(
                    "verification mismatches (exp_mismatches per batch): {}",
                    res.iter()
                        .map(|v| v.exp_mismatches.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                "report this (the proof library disagrees with itself)",
            ),
            Err(e) => r.fail(&what, e, "report this"),
        },
        Err(e) => r.fail(&what, e, "hidden_size × rows must be at least TOPLOC_TOPK"),
    }
}
