//! The miner daemon, top to bottom: settings → checkpoint → node lock → serves → legs →
//! signal → drain → stop. `main.rs` only parses the command line and picks this or `check`.
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use engy_telemetry::log::LogFormat;
use tokio_util::sync::CancellationToken;

use crate::config::{self, secs, Opts};
use crate::metrics::Metrics;
use crate::{chat, check, gateway, hw, serve, worker_name};

/// Exit code for a bad configuration.
pub const EXIT_CONFIG: u8 = 2;

/// Print a fatal error once on stderr, whatever RUST_LOG says (not also logged: both go to
/// stderr): `engy-miner: <msg>`, or one JSON object under `--log-format json`
/// ([`engy_telemetry::log::fatal`]); the process then exits with `exit_code`.
pub fn fatal(format: LogFormat, msg: impl std::fmt::Display, exit_code: u8) {
    engy_telemetry::log::fatal(format, "engy-miner", &msg.to_string(), exit_code);
}

/// Print a configuration error once ([`fatal`]) and give exit code 2.
pub fn config_error(format: LogFormat, msg: impl std::fmt::Display) -> ExitCode {
    fatal(format, msg, EXIT_CONFIG);
    ExitCode::from(EXIT_CONFIG)
}

/// `engy-miner run`: check the settings and the checkpoint (exit 2 naming the variable),
/// take the node lock, dial every leg, serve until SIGTERM/SIGINT, drain, stop. The exit
/// code is the documented one (docs/MINER.md): 0 stopped cleanly or another instance runs,
/// 1 runtime failure, 2 bad configuration.
pub async fn run(opts: Opts) -> ExitCode {
    let f = opts.log_format;
    let Some(gw) = opts.gw.clone().filter(|g| !g.is_empty()) else {
        return config_error(
            f,
            "GW is not set: export GW=wss://<gateway-host>/gw (the gateway websocket URL)",
        );
    };
    if let Err(e) = crate::check_gw(&gw) {
        return config_error(f, e);
    }
    let Some(miner_key) = opts.miner_key.clone().filter(|k| !k.expose().is_empty()) else {
        return config_error(
            f,
            "MINER_KEY is not set: export MINER_KEY=<your miner key> (it is never logged)",
        );
    };
    let Some(checkpoint) = opts.checkpoint.clone() else {
        return config_error(f, "--checkpoint / CHECKPOINT is not set: the model folder with tokenizer.json and config.json");
    };
    if opts.serve_urls().is_empty() {
        return config_error(f, "--serve-url / SERVE_URL is empty");
    }
    if let Err(e) = opts.validate() {
        return config_error(f, e);
    }
    // One miner per node (§2.3): a second instance says so and exits 0. A lock file another
    // user made (a miner run as root, then one in the container as 65532, both on the host's
    // /tmp/engy_miner.singleton) is opened read-only: flock needs no write access.
    let open = |write: bool| {
        std::fs::OpenOptions::new()
            .create(write)
            .truncate(false)
            .write(write)
            .read(!write)
            .open(&opts.lock_file)
    };
    let lock_file = match open(true).or_else(|e| {
        if e.kind() == std::io::ErrorKind::PermissionDenied && opts.lock_file.is_file() {
            open(false)
        } else {
            Err(e)
        }
    }) {
        Ok(f) => f,
        Err(e) => {
            return config_error(
                f,
                format!(
                    "cannot open the lock file {}: {e}",
                    opts.lock_file.display()
                ),
            )
        }
    };
    let mut lock = fd_lock::RwLock::new(lock_file);
    let _guard = match lock.try_write() {
        Ok(g) => g,
        Err(_) => {
            tracing::info!(lock = %opts.lock_file.display(), "another engy-miner instance is running on this node; exiting");
            return ExitCode::SUCCESS;
        }
    };
    // The checkpoint must be able to serve before HELLO announces it (CHECKPOINT).
    let ckpt = match Checkpoint::load(&checkpoint) {
        Ok(c) => c,
        Err(e) => return config_error(f, e),
    };
    if let Err(e) = opts.validate_topk(ckpt.hidden) {
        return config_error(f, e);
    }
    // Metrics (off unless --metrics-addr): bound now, so a bad address is a start-up error.
    let metrics = Arc::new(Metrics::new());
    let shutdown = CancellationToken::new();
    let metrics_addr = match opts.metrics_socket() {
        Ok(a) => a,
        Err(e) => return config_error(f, e),
    };
    let _metrics_server = match metrics_addr {
        None => None,
        Some(addr) => {
            match engy_telemetry::metrics::serve(
                addr,
                metrics.registry(),
                shutdown.clone().cancelled_owned(),
            )
            .await
            {
                Ok(s) => {
                    tracing::info!(addr = %s.local_addr(), "metrics at http://{}/metrics", s.local_addr());
                    Some(s)
                }
                Err(e) => {
                    return config_error(f, format!("ENGY_METRICS_ADDR: {e} (--metrics-addr)"))
                }
            }
        }
    };
    match serve(opts, gw, miner_key, &checkpoint, ckpt, metrics, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

/// HELLO's `versions` (docs/PROTOCOL.md §2, §9): `{"engy-miner": "<version>", "commit":
/// "<git sha or unknown>", "dirty": true | false | null}` from [`engy_telemetry::build_info`].
pub fn hello_versions() -> serde_json::Value {
    let b = engy_telemetry::build_info::BUILD;
    serde_json::json!({"engy-miner": b.version, "commit": b.commit, "dirty": b.dirty_flag()})
}

/// What start-up needs from the checkpoint folder, each part proven to work.
struct Checkpoint {
    prompter: chat::Prompter,
    model_root: String,
    hidden: usize,
}

impl Checkpoint {
    /// Load the tokenizer and chat template and render a probe conversation; read
    /// `hidden_size` and `model_root`. The error names CHECKPOINT and the cause.
    fn load(dir: &Path) -> Result<Self, String> {
        let at = dir.display();
        let prompter = chat::Prompter::load(dir).map_err(|e| {
            format!("CHECKPOINT {at}: cannot load the tokenizer or chat template: {e}")
        })?;
        prompter.probe().map_err(|e| {
            format!("CHECKPOINT {at}: the chat template cannot render a system + user conversation: {e}")
        })?;
        let hidden =
            crate::checkpoint_hidden_size(dir).map_err(|e| format!("CHECKPOINT {at}: {e}"))?;
        let model_root = engy_core::identity::model_root(dir)
            .map_err(|e| format!("CHECKPOINT {at}: cannot compute model_root: {e}"))?;
        Ok(Self {
            prompter,
            model_root,
            hidden,
        })
    }
}

async fn serve(
    opts: Opts,
    gw: String,
    miner_key: config::Secret,
    checkpoint: &Path,
    ckpt: Checkpoint,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut signals = Signals::install();
    tracing::info!(checkpoint = %checkpoint.display(), hidden_size = ckpt.hidden, "checkpoint loaded; its chat template renders");
    let Checkpoint {
        prompter,
        model_root,
        hidden,
    } = ckpt;
    let prompter = Arc::new(prompter);
    let reply_cap = opts.reply_cap(hidden);
    let traces = serve::trace::TraceShapes::from_checkpoint(
        checkpoint,
        opts.routing_trace.is_on(),
        opts.indexer_trace.is_on(),
    );
    let engine = Arc::new(
        serve::Engine::new(
            serve::EngineConfig {
                model_root: model_root.clone(),
                topk: opts.toploc_topk,
                dbs: opts.toploc_dbs,
                max_tokens: opts.max_tokens,
                max_output_tokens: opts.max_output_tokens,
                gen_chunk: opts.gen_chunk,
                serve_timeout: opts.serve_timeout(),
                hidden_size: Some(hidden),
                reply_cap,
                traces,
            },
            prompter,
            &opts.serve_urls(),
            Arc::clone(&metrics),
        )?
        .with_cells(cells_pass(&opts, checkpoint, &metrics, &shutdown)),
    );
    // Best effort and in the background: one WARN per serve that is down, start-up goes on.
    tokio::spawn({
        let serves = opts.serve_urls();
        async move { check::probe_serves(&serves).await }
    });
    // Which serves offer the traces this miner collects (docs/PROTOCOL.md §3.10).
    let shape = |s: Option<serve::trace::Shape>| match s {
        Some(s) => format!("{}x{} ids per token", s.layers, s.width),
        None => "not collected".to_string(),
    };
    tracing::info!(
        routing = %shape(traces.routing), indexer = %shape(traces.indexer),
        "traces collected when a serve offers them (ENGY_ROUTING_TRACE, ENGY_INDEXER_TRACE × config.json)"
    );
    tokio::spawn({
        let engine = Arc::clone(&engine);
        async move { engine.probe_offers().await }
    });
    let (hw, gpus_unknown) = hw::detect(&opts.hw_par, opts.hw_gpus.as_deref()).await;
    if gpus_unknown {
        tracing::warn!(
            "nvidia-smi did not answer here (the miner image has none), so HELLO reports the GPUs as \"?x GPU\"; set HW_GPUS (--hw-gpus) to what the serve runs on, e.g. HW_GPUS=\"4x NVIDIA GeForce RTX 4090\""
        );
    }
    let worker_name = worker_name(&opts);
    let identity = gateway::Identity {
        gw: gw.clone(),
        miner_key,
        model: opts.model.clone(),
        model_root: model_root.clone(),
        hw: hw.clone(),
        versions: hello_versions(),
        worker_name: worker_name.clone(),
        worker_id: uuid::Uuid::new_v4().simple().to_string(),
        max_inflight_total: opts.max_inflight.max(1),
        max_input_tokens: opts.max_input_tokens,
        max_output_tokens: opts.max_output_tokens,
        max_request_s: opts.max_request_s,
        heartbeat: secs(opts.heartbeat_s).max(std::time::Duration::from_millis(100)),
        flush: secs(opts.stream_flush_s),
    };
    let n = gateway::worker_count(&gw, opts.gw_workers).await;
    let (workers, per_leg) = gateway::leg_plan(n, opts.max_inflight);
    tracing::info!(
        gw = %gw, model = %opts.model, root = %model_root.get(..12).unwrap_or(&model_root),
        serves = %opts.serve_urls().join(", "), workers = n,
        legs = %workers.iter().map(|w| w.to_string()).collect::<Vec<_>>().join(", "), leg_inflight = per_leg,
        total_inflight = per_leg * workers.len() as u64, worker_name = %worker_name,
        hidden_size = hidden, reply_cap_mb = reply_cap >> 20,
        version = engy_telemetry::build_info::LONG_VERSION, "dialing the gateway"
    );
    tracing::info!(hw = %hw, "hardware");
    let hub = gateway::Hub::new(identity, engine, metrics);
    let mut tasks = Vec::new();
    for w in workers {
        tasks.push(tokio::spawn(gateway::run_leg(
            Arc::clone(&hub),
            w,
            n,
            per_leg,
            shutdown.clone(),
        )));
    }
    signals.wait().await;
    // Graceful stop: refuse new work, let in-flight requests finish (bounded), then abort
    // the rest on the serves and close every leg.
    hub.draining.store(true, Ordering::SeqCst);
    let drain = secs(opts.drain_s);
    let n_inflight = hub.inflight();
    tracing::info!(
        inflight = n_inflight,
        drain_s = drain.as_secs_f64(),
        "signal received; draining in-flight requests, then closing the legs"
    );
    let deadline = tokio::time::Instant::now() + drain;
    if !hub.wait_idle(deadline).await {
        tracing::warn!(
            inflight = hub.inflight(),
            "drain timed out; aborting the remaining requests (each is answered with an error)"
        );
        hub.abort_all("the miner is shutting down (SIGTERM) and the drain timed out");
        // Their error responses go out before the legs close (each leg writes in order).
        let answered = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        if !hub.wait_idle(answered).await {
            tracing::warn!(
                inflight = hub.inflight(),
                "aborted requests did not finish within 5 s; closing the legs anyway"
            );
        }
    }
    shutdown.cancel();
    for t in tasks {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), t).await;
    }
    // Give abort requests a moment to leave.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    tracing::info!("stopped");
    Ok(())
}

/// The cells' commit pass when `ENGY_CELLS=on` and the checkpoint is an MoE model (else
/// `None`, with the reason logged), with its retention store and the store's sweep task.
fn cells_pass(
    opts: &Opts,
    checkpoint: &Path,
    metrics: &Arc<Metrics>,
    shutdown: &CancellationToken,
) -> Option<serve::cells::CommitPass> {
    if !opts.cells.is_on() {
        tracing::info!("cells off (ENGY_CELLS=off): commitments carry no cells");
        return None;
    }
    let spool = opts.cells_spool.clone()?;
    if serve::trace::TraceShapes::from_checkpoint(checkpoint, true, false)
        .routing
        .is_none()
    {
        tracing::warn!(checkpoint = %checkpoint.display(), "ENGY_CELLS=on but config.json names no MoE model (num_experts_per_tok and an expert count): a dense model has no cells; commitments carry none");
        return None;
    }
    let limits = crate::cell_store::Limits {
        max_age: secs(opts.cells_retain_s),
        max_bytes: opts.cells_retain_mb.saturating_mul(1 << 20),
    };
    let store = Arc::new(crate::cell_store::CellStore::new(
        limits,
        Arc::clone(metrics),
    ));
    tokio::spawn({
        let store = Arc::clone(&store);
        let shutdown = shutdown.clone();
        let every = limits.max_age.min(std::time::Duration::from_secs(10));
        async move {
            let mut tick = tokio::time::interval(every.max(std::time::Duration::from_millis(100)));
            loop {
                tokio::select! {
                    _ = tick.tick() => store.sweep(),
                    _ = shutdown.cancelled() => return,
                }
            }
        }
    });
    tracing::info!(spool = %spool.display(), retain_s = opts.cells_retain_s, retain_mb = opts.cells_retain_mb, "cells on: a commit pass after each generation on serves with the engy_cells hooks (ENGY_CELLS_SPOOL)");
    Some(serve::cells::CommitPass::new(spool, store))
}

/// SIGTERM/SIGINT listeners, installed before the slow start-up steps (`/meta`, hardware
/// probe) so that a signal arriving then is not the default "terminate at once" (exit 143)
/// but a graceful stop as soon as start-up is done.
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Signals {
                term: signal(SignalKind::terminate()).ok(),
                int: signal(SignalKind::interrupt()).ok(),
            }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn wait(&mut self) {
        #[cfg(unix)]
        {
            async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            if self.term.is_none() && self.int.is_none() {
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
            tokio::select! {
                _ = recv(&mut self.term) => {}
                _ = recv(&mut self.int) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
