//! The daemon: start-up order, signals and shutdown.
//!
//! 1. settings checked ([`ServeArgs::check`]); the logger (`ENGY_LOG` filter, text or JSON
//!    on standard error);
//! 2. the database opened and migrated ([`Store::open`]); the beacon (chain or fixed);
//! 3. the API bound and served (the log line `listening` carries the bound `addr`), so
//!    reports are taken while the models load;
//! 4. the sampler; then per device the models opened (resident) and a worker started.
//!
//! SIGTERM or SIGINT: the API stops taking connections, the sampler stops, each worker
//! claims nothing more and finishes the audit in hand within `--drain-s` or gives its job
//! back ([`crate::worker`]); then the process exits 0.
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;

use crate::config::{BeaconConfig, Config, ServeArgs};
use crate::intake::{router, AppState};
use crate::metrics::Metrics;
use crate::sampling::{Beacon, FixedBeacon, Sampler};
use crate::store::Store;
use crate::worker::{open_model, LoadedModel, Worker};
use engy_telemetry::log::{LogConfig, LogTarget};

/// Exit code when the service could not start or stopped on an error (1); a usage error is
/// the binary's (3).
pub const EXIT_FAILED: u8 = 1;
/// Exit code of a setting that is not usable.
pub const EXIT_USAGE: u8 = 3;

/// How often the sampler looks for decisions to make.
const SAMPLE_EVERY: Duration = Duration::from_millis(250);

/// Runs `engy-audit serve` until SIGTERM (exit codes: 0 stopped cleanly, 1 failed, 3 a
/// setting not usable).
pub fn main(args: &ServeArgs) -> ExitCode {
    let log = LogConfig {
        filter_var: "ENGY_LOG",
        default_filter: "info",
        format: args.log_format,
        target: LogTarget::Stderr,
    };
    if let Err(e) = engy_telemetry::log::init(&log) {
        engy_telemetry::log::fatal(
            args.log_format,
            "engy-audit serve",
            &e.to_string(),
            EXIT_USAGE,
        );
        return ExitCode::from(EXIT_USAGE);
    }
    let cfg = match args.check() {
        Ok(c) => c,
        Err(e) => {
            engy_telemetry::log::fatal(args.log_format, "engy-audit serve", &e.0, EXIT_USAGE);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("engy-audit serve: error: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_FAILED);
        }
    };
    match rt.block_on(run(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            engy_telemetry::log::fatal(
                args.log_format,
                "engy-audit serve",
                &engy_telemetry::cli::error_line(e.as_ref()),
                EXIT_FAILED,
            );
            ExitCode::from(EXIT_FAILED)
        }
    }
}

/// The service with checked settings, until SIGTERM / SIGINT.
///
/// # Errors
/// The database, the beacon or the address cannot be used.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let store = Store::open(&cfg.db).await?;
    tracing::info!(
        db = %crate::store::redact(&cfg.db),
        engine = ?store.engine(),
        build = %engy_telemetry::build_info::BUILD.describe("engy-audit"),
        "database open"
    );
    let beacon: Arc<dyn Beacon> = match &cfg.beacon {
        BeaconConfig::Fixed(b) => {
            tracing::warn!(
                "a fixed beacon: every sampling decision is predictable (devnet, tests)"
            );
            Arc::new(FixedBeacon(*b))
        }
        BeaconConfig::Chain(url) => Arc::new(
            crate::beacon::ChainBeacon::connect(url)
                .await
                .with_context(|| format!("--chain / ENGY_AUDIT_CHAIN {url}"))?,
        ),
    };
    let mut registry = prometheus_client::registry::Registry::with_prefix("engy_audit");
    engy_telemetry::build_info::register(&mut registry, &engy_telemetry::build_info::BUILD);
    let metrics = Arc::new(Metrics::register(&mut registry));
    let model_states = Arc::new(Mutex::new(
        cfg.models
            .keys()
            .map(|k| (k.clone(), "loading".to_owned()))
            .collect::<BTreeMap<_, _>>(),
    ));
    let state = Arc::new(AppState {
        store: store.clone(),
        models: cfg.models.keys().cloned().collect(),
        max_report_bytes: cfg.max_report_bytes,
        window_ms: cfg.window_ms,
        min_sample: cfg.floor,
        beacon: beacon.clone(),
        metrics: metrics.clone(),
        registry: Arc::new(registry),
        model_states: model_states.clone(),
        workers: cfg.devices.len(),
    });
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| {
            format!(
                "cannot listen on {} (--listen / ENGY_AUDIT_LISTEN)",
                cfg.listen
            )
        })?;
    let local = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut api_stop = stop_rx.clone();
    let api = tokio::spawn(async move {
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                let _ = api_stop.wait_for(|s| *s).await;
            })
            .await
    });
    tracing::info!(addr = %local, "listening");

    let sampler = Sampler {
        store: store.clone(),
        beacon,
        rate: cfg.sample_rate,
        floor: cfg.floor,
        window_ms: cfg.window_ms,
    };
    let sampler = tokio::spawn(sampler.run(SAMPLE_EVERY, stop_rx.clone()));

    let signals = tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("stopping: SIGTERM or SIGINT");
        let _ = stop_tx.send(true);
    });

    let mut workers = Vec::new();
    for (i, device) in cfg.devices.iter().copied().enumerate() {
        let mut held = BTreeMap::new();
        for (name, dir) in &cfg.models {
            let (n, d) = (name.clone(), dir.clone());
            let spec = cfg.specs.get(name).cloned();
            let opened =
                tokio::task::spawn_blocking(move || open_model(&n, &d, spec.as_deref(), device))
                    .await;
            let opened: anyhow::Result<LoadedModel> =
                opened.unwrap_or_else(|e| Err(anyhow::anyhow!("loading task ended: {e}")));
            let line = match opened {
                Ok(m) => {
                    tracing::info!(model = %name, %device, model_root = %m.model_root, "model loaded");
                    held.insert(name.clone(), Arc::new(m));
                    format!("loaded on {device}")
                }
                Err(e) => {
                    let error = engy_telemetry::cli::error_line(e.as_ref());
                    tracing::error!(
                        model = %name, %device, %error,
                        "model not loaded: its jobs stay queued until a worker that holds it \
                         claims them"
                    );
                    format!("not loaded on {device}: {error}")
                }
            };
            if let Ok(mut m) = model_states.lock() {
                // A model loaded on any device counts as loaded.
                let keep = m.get(name).is_some_and(|s| s.starts_with("loaded"));
                if !keep {
                    m.insert(name.clone(), line);
                }
            }
        }
        let worker = Worker {
            id: format!(
                "{}-{device}-{i}-{}",
                std::process::id(),
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ),
            store: store.clone(),
            models: held,
            params: cfg.params,
            lease_ms: cfg.lease_ms,
            drain: cfg.drain,
            batch: cfg.batch,
            metrics: metrics.clone(),
            gateway: cfg.gateway.as_deref().map(crate::challenge::Gateway::new),
            challenge_deadline: cfg.challenge_deadline,
            cells_n: cfg.cells_n,
        };
        workers.push(tokio::spawn(worker.run(stop_rx.clone())));
        if *stop_rx.borrow() {
            break;
        }
    }

    let served = api.await;
    for w in workers {
        let _ = w.await;
    }
    let _ = sampler.await;
    signals.abort();
    store.close().await;
    tracing::info!("stopped");
    match served {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(anyhow::Error::new(e).context("the API server failed")),
        Err(e) => Err(anyhow::anyhow!("the API task ended: {e}")),
    }
}

use engy_telemetry::prometheus_client;

/// Waits for SIGTERM or SIGINT.
async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
