//! engy-devnet: the one set of protocol doubles, written to the shared spec documents and
//! reused by every test and by the devnet:
//!
//! * [`gateway`]: the engy gateway (PROTOCOL.md §2), a websocket server that records every frame.
//! * [`provider`]: the provider API (PROTOCOL.md §6), serving signed epoch payloads and faults.
//! * [`sglang`]: sglang's native HTTP API (sglang-native-api.md) over a pluggable model backend.
//! * [`chain_proxy`]: a websocket proxy in front of a real subtensor node that can refuse the
//!   next extrinsic as the node's transaction pool does (ancient birth block, outdated).
//!
//! [`audit_service`] runs the real `engy-audit serve` for the devnet (its miners' requests
//! reported to it, its per-miner table read back).
//!
//! Beside them, [`container`]: the machine's container engine for the image tests, and
//! [`ports`]: ports a test holds instead of guessing (issue 43).
pub mod audit_service;
pub mod chain_proxy;
pub mod container;
pub mod devnet;
pub mod devnet_backend;
pub mod gateway;
pub mod ports;
pub mod provider;
pub mod runbook;
pub mod sglang;

/// Serves `app` on `listener` in a background task until the returned sender is used or
/// dropped (graceful shutdown). The one server loop of the HTTP/websocket doubles.
pub(crate) fn spawn_server(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> tokio::sync::oneshot::Sender<()> {
    spawn_server_joinable(listener, app).0
}

/// [`spawn_server`], also returning the server task: it ends once the listener is closed
/// and every connection has finished (after the shutdown signal).
pub(crate) fn spawn_server_joinable(
    listener: tokio::net::TcpListener,
    app: axum::Router,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        // TCP_NODELAY on every accepted socket, as the real parts do (uvicorn under sglang:
        // asyncio sets it; the gateway): a small frame or SSE event is sent at once.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = rx.await;
            })
            .await;
    });
    (tx, task)
}
