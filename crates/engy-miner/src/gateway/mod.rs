//! The gateway side of the miner (docs/PROTOCOL.md §2): `/meta` discovery, the leg plan,
//! and each leg's life (dial, session, re-dial with backoff and jitter).
//!
//! * [`connection`]: the only socket I/O (TCP, TLS, the [`gate`] under the websocket).
//! * [`session`]: one websocket session: HELLO, heartbeats, frames in, a request task per
//!   `serve`, frames out through one writer task.
//! * [`hub`]: what all legs share: identity, the request path, the one registry of jobs.
//! * [`coalesce`]: streamed text → `chunk` frames (§3.6).
//!
//! Each leg owns its socket writes: one writer task drains an unbounded channel of frames,
//! so a request task never touches the socket and can never block the leg's reads or its
//! heartbeats. A request's frames pass [`crate::job::Job::if_live`], atomically with
//! `cancel`, so nothing reaches the channel for a corr_id after its cancel was handled.
use std::time::{Duration, Instant};

use engy_core::wire;
use rand::Rng;
use serde_json::Value;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

pub(crate) mod coalesce;
pub(crate) mod connection;
pub mod gate;
pub mod hub;
pub(crate) mod session;

pub use connection::GW_MAX_FRAME;
pub use hub::{EarlyCancels, Hub, EARLY_CANCELS, EARLY_CANCEL_BYTES, EARLY_CANCEL_WINDOW};

/// Static identity and capacity sent in HELLO.
#[derive(Debug, Clone)]
pub struct Identity {
    /// Gateway URL (`GW`).
    pub gw: String,
    /// MINER_KEY (only ever placed in HELLO).
    pub miner_key: crate::config::Secret,
    /// Gateway model id.
    pub model: String,
    /// model_root (§4).
    pub model_root: String,
    /// `hw` object (§2.1).
    pub hw: Value,
    /// `versions` object.
    pub versions: Value,
    /// worker_name (§2.3).
    pub worker_name: String,
    /// Fresh per process.
    pub worker_id: String,
    /// Capacity fields except the per-leg `max_inflight`.
    pub max_inflight_total: u64,
    /// MAX_INPUT_TOKENS.
    pub max_input_tokens: u64,
    /// MAX_OUTPUT_TOKENS.
    pub max_output_tokens: u64,
    /// MAX_REQUEST_S.
    pub max_request_s: f64,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Streaming coalescing window.
    pub flush: Duration,
}

impl Identity {
    fn capacity(&self, per_leg: u64) -> wire::Capacity {
        wire::Capacity {
            max_inflight: per_leg,
            max_inflight_total: self.max_inflight_total,
            max_input_tokens: self.max_input_tokens,
            max_output_tokens: self.max_output_tokens,
            max_request_s: self.max_request_s,
        }
    }
}

/// `GW` as the https (or http) base for `/meta`.
pub fn http_base(gw: &str) -> String {
    let gw = gw.trim_end_matches('/');
    if let Some(r) = gw.strip_prefix("wss://") {
        format!("https://{r}")
    } else if let Some(r) = gw.strip_prefix("ws://") {
        format!("http://{r}")
    } else {
        gw.to_string()
    }
}

/// Number of gateway workers: `ENGY_GW_WORKERS`, else `/meta` `workers`, else 1.
pub async fn worker_count(gw: &str, forced: Option<usize>) -> usize {
    if let Some(n) = forced {
        return n.max(1);
    }
    let url = format!("{}/meta", http_base(gw));
    let client = match reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
    {
        Ok(c) => c,
        Err(_) => return 1,
    };
    match client.get(&url).send().await {
        Ok(r) if r.status().is_success() => match r.json::<Value>().await {
            Ok(v) => v
                .get("workers")
                .and_then(Value::as_u64)
                .map(|n| n.max(1) as usize)
                .unwrap_or(1),
            Err(_) => 1,
        },
        Ok(r) => {
            tracing::info!(%url, status = %r.status(), "gateway /meta unavailable; assuming 1 worker");
            1
        }
        Err(e) => {
            tracing::info!(%url, error = %crate::error_chain(&e), "gateway /meta unreachable; assuming 1 worker");
            1
        }
    }
}

/// The leg plan (§2): `(worker indices to dial, max_inflight per leg)`.
pub fn leg_plan(n_workers: usize, max_inflight: u64) -> (Vec<usize>, u64) {
    let n = n_workers.max(1);
    let total = max_inflight.max(1);
    if (total as usize) < n {
        let mut all: Vec<usize> = (0..n).collect();
        let mut rng = rand::thread_rng();
        // Partial Fisher–Yates: a random subset of `total` workers.
        for i in 0..total as usize {
            let j = rng.gen_range(i..n);
            all.swap(i, j);
        }
        let mut pick: Vec<usize> = all.into_iter().take(total as usize).collect();
        pick.sort_unstable();
        (pick, 1)
    } else {
        ((0..n).collect(), total / n as u64)
    }
}

/// Leg URL: `<GW>/<i>` when N > 1, else `<GW>`.
pub fn leg_url(gw: &str, i: usize, n: usize) -> String {
    if n > 1 {
        format!("{}/{i}", gw.trim_end_matches('/'))
    } else {
        gw.to_string()
    }
}

/// The gateway → miner frames, typed in [`engy_core::wire`] (docs/PROTOCOL.md §2).
pub use engy_core::wire::{
    decode_gateway_frame as decode_frame, FrameError, GatewayFrame as Frame, Serve as ServeFrame,
};

/// Run one leg forever (until `shutdown`): dial, serve the session, re-dial with backoff.
pub async fn run_leg(
    hub: Arc<Hub>,
    worker: usize,
    n_workers: usize,
    per_leg: u64,
    shutdown: CancellationToken,
) {
    let url = leg_url(&hub.id.gw, worker, n_workers);
    let tag = format!("gw{worker}");
    let mut backoff = Duration::from_millis(500);
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        let t0 = Instant::now();
        let connect = tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(30), connection::dial(&url)) => r,
            _ = shutdown.cancelled() => return,
        };
        match connect {
            Ok(Ok((ws, dropped))) => {
                let why = session::session(&hub, ws, dropped, &tag, per_leg, &shutdown).await;
                if shutdown.is_cancelled() {
                    tracing::info!(leg = %tag, "leg closed for shutdown");
                    return;
                }
                if t0.elapsed() > Duration::from_secs(10) {
                    backoff = Duration::from_millis(500);
                }
                tracing::warn!(leg = %tag, reason = %why, "session ended; re-dialing");
            }
            Ok(Err(e)) => tracing::warn!(leg = %tag, %url, error = %e, "dial failed"),
            Err(_) => tracing::warn!(leg = %tag, %url, "dial timed out after 30 s"),
        }
        // Jitter ±25 % so a fleet does not re-dial in lockstep.
        let jitter = rand::thread_rng().gen_range(0.75..1.25);
        let pause = backoff.mul_f64(jitter);
        tracing::info!(leg = %tag, pause_ms = pause.as_millis() as u64, "re-dialing after pause");
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}
