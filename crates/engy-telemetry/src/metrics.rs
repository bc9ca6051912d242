//! The Prometheus scrape endpoint behind a daemon's `--metrics-addr`.
//!
//! A daemon registers its metrics in a [`Registry`] at start-up, then calls [`serve`] with the
//! operator's address. `GET /metrics` answers the registry in the OpenMetrics text format
//! ([`CONTENT_TYPE`], which Prometheus scrapes natively); every other path is 404 and every
//! other method 405. The endpoint has no authentication: bind it to 127.0.0.1 or a private
//! interface (docs/SECURITY.md).
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;

/// The `Content-Type` of a scrape: OpenMetrics text 1.0.0.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The address could not be bound (in use, not local, no permission).
    #[error("cannot listen on {addr} for metrics: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The operating system's reason.
        source: std::io::Error,
    },
}

/// A running endpoint. Dropping it leaves the server running until its shutdown future
/// completes; [`MetricsServer::join`] waits for that.
#[derive(Debug)]
pub struct MetricsServer {
    local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsServer {
    /// The bound address (the real port when the operator asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Waits until the server has stopped (after the shutdown future passed to [`serve`]).
    pub async fn join(self) {
        // A panic in the server task is already reported by tokio; nothing to add here.
        let _ = self.task.await;
    }
}

/// The registry as scrape text (OpenMetrics, ending in `# EOF`).
///
/// # Errors
/// Only if a metric's encoder fails, which prometheus-client's own types never do.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)?;
    Ok(text)
}

/// Binds `addr` and serves `registry` at `GET /metrics` until `shutdown` completes.
///
/// Binding happens before this returns, so a bad `--metrics-addr` is a start-up error.
///
/// # Errors
/// [`MetricsError::Bind`] when the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<MetricsServer, MetricsError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let local_addr = listener
        .local_addr()
        .map_err(|source| MetricsError::Bind { addr, source })?;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let registry = Arc::clone(&registry);
            async move { scrape(&registry) }
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
        {
            tracing::error!("metrics endpoint on {local_addr} stopped: {e}; scrapes now fail");
        }
    });
    Ok(MetricsServer { local_addr, task })
}

fn scrape(registry: &Registry) -> Response {
    match encode(registry) {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "metrics could not be encoded\n",
        )
            .into_response(),
    }
}
