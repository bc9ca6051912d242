//! Gateway legs (PROTOCOL.md §2): `/meta` discovery, the leg plan, HELLO, heartbeats,
//! serve/cancel/ping/reconnect/admit/deny, reconnect with backoff and jitter.
//!
//! Each leg owns its socket writes: one writer task drains an unbounded channel of frames,
//! so a request task never touches the socket and can never block the leg's reads or its
//! heartbeats. A request's frames pass [`Job::if_live`], atomically with `cancel`, so nothing
//! reaches the channel for a corr_id after its cancel was handled.
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engy_core::wire;
use futures_util::{SinkExt, StreamExt};
use rand::Rng;
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::gate::{self, FrameGate};
use crate::job::{Job, JobError};
use crate::serve::{Engine, StreamEvent, StreamSink};
use tokio_tungstenite::MaybeTlsStream;

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

/// Shared state of all legs.
pub struct Hub {
    /// Identity and capacity.
    pub id: Identity,
    /// The request path.
    pub engine: Arc<Engine>,
    /// corr_id → job, for cancel.
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    /// corr_ids cancelled before their serve arrived (bounded).
    early_cancels: Mutex<EarlyCancels>,
    /// Requests being served, all legs.
    pub inflight: AtomicUsize,
    /// Set on SIGTERM: new serves are refused.
    pub draining: AtomicBool,
    /// Wakes the drain wait.
    pub idle: tokio::sync::Notify,
}

impl Hub {
    /// New hub.
    pub fn new(id: Identity, engine: Arc<Engine>) -> Arc<Self> {
        Arc::new(Self {
            id,
            engine,
            jobs: Mutex::new(HashMap::new()),
            early_cancels: Mutex::new(EarlyCancels::default()),
            inflight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            idle: tokio::sync::Notify::new(),
        })
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cancel one job: mark it, then abort its live serve calls on the dedicated client.
    pub fn cancel(&self, corr_id: &str, why: &str) {
        let job = self.jobs().get(corr_id).cloned();
        match job {
            Some(job) => self.cancel_job(corr_id, &job, why),
            None => {
                self.early_cancels
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(corr_id, Instant::now());
                let shown = corr_id
                    .char_indices()
                    .nth(64)
                    .and_then(|(i, _)| corr_id.get(..i))
                    .unwrap_or(corr_id);
                tracing::info!(
                    corr_id = shown,
                    why,
                    window_s = EARLY_CANCEL_WINDOW.as_secs(),
                    "cancel for a request not running here; a serve of it within the window is answered as cancelled"
                );
            }
        }
    }

    fn cancel_job(&self, corr_id: &str, job: &Job, why: &str) {
        let rids = job.cancel();
        tracing::info!(corr_id, aborting = rids.len(), why, "cancelled");
        self.engine.abort_rids(rids);
    }

    /// Unregister `job` when it ended, unless `corr_id` was served again meanwhile (a
    /// corr_id served again after its cancel is a new job, and stays cancellable).
    fn forget(&self, corr_id: &str, job: &Arc<Job>) {
        let mut jobs = self.jobs();
        if jobs.get(corr_id).is_some_and(|j| Arc::ptr_eq(j, job)) {
            jobs.remove(corr_id);
        }
    }

    /// Abort every job for `why` (a SIGTERM drain that timed out): each still answers
    /// with an error `response` (docs/PROTOCOL.md §2.6: one terminal frame per serve).
    pub fn abort_all(&self, why: &str) {
        let jobs: Vec<(String, Arc<Job>)> = self
            .jobs()
            .iter()
            .map(|(c, j)| (c.clone(), Arc::clone(j)))
            .collect();
        for (corr_id, job) in jobs {
            let rids = job.abort(why);
            tracing::info!(%corr_id, aborting = rids.len(), why, "aborted");
            self.engine.abort_rids(rids);
        }
    }

    /// Whether a cancel for `corr_id` arrived within [`EARLY_CANCEL_WINDOW`] before its
    /// `serve` (docs/PROTOCOL.md §2.5);
    /// consumes it.
    fn take_early_cancel(&self, corr_id: &str) -> bool {
        self.early_cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take(corr_id, Instant::now())
    }
}

/// How long a cancel for a request the miner is not running is remembered: a `serve` of
/// that corr_id arriving within this window is answered as cancelled (docs/PROTOCOL.md
/// §2.5); after it the memory is gone and a serve is served.
pub const EARLY_CANCEL_WINDOW: Duration = Duration::from_secs(5);

/// Cancels for corr_ids not (yet) served, bounded in time ([`EARLY_CANCEL_WINDOW`]),
/// entries ([`EARLY_CANCELS`]) and bytes ([`EARLY_CANCEL_BYTES`]): a gateway cannot grow
/// it, and a corr_id reused later is not swallowed.
#[derive(Debug, Default)]
pub struct EarlyCancels {
    q: VecDeque<(String, Instant)>,
    bytes: usize,
}

impl EarlyCancels {
    /// Remember a cancel of `corr_id` received at `now` (a corr_id longer than
    /// [`EARLY_CANCEL_BYTES`] is not kept).
    pub fn insert(&mut self, corr_id: &str, now: Instant) {
        self.expire(now);
        if corr_id.len() > EARLY_CANCEL_BYTES {
            return;
        }
        self.q.push_back((corr_id.to_string(), now));
        self.bytes += corr_id.len();
        while self.q.len() > EARLY_CANCELS || self.bytes > EARLY_CANCEL_BYTES {
            self.pop();
        }
    }

    /// Whether a cancel of `corr_id` is remembered at `now`; forgets it.
    pub fn take(&mut self, corr_id: &str, now: Instant) -> bool {
        self.expire(now);
        match self.q.iter().position(|(c, _)| c == corr_id) {
            Some(i) => {
                if let Some((c, _)) = self.q.remove(i) {
                    self.bytes -= c.len();
                }
                true
            }
            None => false,
        }
    }

    /// Entries remembered.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// No entry remembered.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }

    fn pop(&mut self) {
        if let Some((c, _)) = self.q.pop_front() {
            self.bytes -= c.len();
        }
    }

    fn expire(&mut self, now: Instant) {
        while self
            .q
            .front()
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= EARLY_CANCEL_WINDOW)
        {
            self.pop();
        }
    }
}

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
            r = tokio::time::timeout(Duration::from_secs(30), dial(&url)) => r,
            _ = shutdown.cancelled() => return,
        };
        match connect {
            Ok(Ok((ws, dropped))) => {
                let why = session(&hub, ws, dropped, &tag, per_leg, &shutdown).await;
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

type Ws = tokio_tungstenite::WebSocketStream<FrameGate<MaybeTlsStream<tokio::net::TcpStream>>>;
type WsError = tokio_tungstenite::tungstenite::Error;

/// Per-leg counters for heartbeats.
struct LegState {
    inflight: AtomicUsize,
    last_busy: Mutex<Instant>,
    /// The leg's running jobs by corr_id.
    corr_ids: Mutex<HashMap<String, Arc<Job>>>,
}

impl LegState {
    fn idle_seconds(&self) -> f64 {
        if self.inflight.load(Ordering::SeqCst) > 0 {
            0.0
        } else {
            self.last_busy
                .lock()
                .map(|t| t.elapsed().as_secs_f64())
                .unwrap_or(0.0)
        }
    }
}

/// One websocket session; returns why it ended.
/// Operator text for a gateway's close frame: `gateway closed the leg (code 1001, going
/// away: "restarting")` (RFC 6455 §7.4.1 names the codes).
fn closed_by_gateway(
    frame: Option<&tokio_tungstenite::tungstenite::protocol::CloseFrame>,
) -> String {
    let Some(f) = frame else {
        return "gateway closed the leg without a close code".to_string();
    };
    let code = u16::from(f.code);
    let name = match code {
        1000 => "normal closure",
        1001 => "going away",
        1002 => "protocol error",
        1003 => "unsupported data",
        1007 => "invalid payload",
        1008 => "policy violation",
        1009 => "message too big",
        1011 => "server error",
        1012 => "service restart",
        1013 => "try again later",
        _ => "",
    };
    let mut out = format!("gateway closed the leg (code {code}");
    if !name.is_empty() {
        out.push_str(", ");
        out.push_str(name);
    }
    let reason = f.reason.as_str();
    if !reason.is_empty() {
        out.push_str(&format!(": \"{}\"", reason.escape_debug()));
    }
    out.push(')');
    out
}

async fn session(
    hub: &Arc<Hub>,
    ws: Ws,
    mut dropped: mpsc::UnboundedReceiver<gate::Dropped>,
    tag: &str,
    per_leg: u64,
    shutdown: &CancellationToken,
) -> String {
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            let close = matches!(m, Message::Close(_));
            if sink.send(m).await.is_err() {
                return;
            }
            if close {
                return;
            }
        }
    });
    let cap = hub.id.capacity(per_leg);
    let leg = Arc::new(LegState {
        inflight: AtomicUsize::new(0),
        last_busy: Mutex::new(Instant::now()),
        corr_ids: Mutex::new(HashMap::new()),
    });
    let hello = wire::MinerFrame::Hello(wire::Hello {
        miner_key: hub.id.miner_key.expose().to_string(),
        model: hub.id.model.clone(),
        model_root: hub.id.model_root.clone(),
        hw: hub.id.hw.clone(),
        versions: hub.id.versions.clone(),
        capacity: cap.clone(),
        worker_name: hub.id.worker_name.clone(),
        instance_id: hub.id.worker_name.clone(),
        worker_id: hub.id.worker_id.clone(),
    });
    let _ = tx.send(Message::Text(hello.to_text().into()));
    drop(hello);
    tracing::info!(leg = %tag, max_inflight = per_leg, "HELLO sent; awaiting work");
    let heartbeat = |leg: &LegState| {
        wire::MinerFrame::Heartbeat(wire::Heartbeat {
            inflight: leg.inflight.load(Ordering::SeqCst) as u64,
            idle_seconds: leg.idle_seconds(),
            capacity: cap.clone(),
        })
        .to_text()
    };
    let mut hb = tokio::time::interval_at(
        tokio::time::Instant::now() + hub.id.heartbeat,
        hub.id.heartbeat.max(Duration::from_millis(100)),
    );
    let mut ka = tokio::time::interval_at(
        tokio::time::Instant::now() + Duration::from_secs(15),
        Duration::from_secs(15),
    );
    let mut last_rx = Instant::now();
    let why = loop {
        tokio::select! {
            msg = stream.next() => {
                last_rx = Instant::now();
                match msg {
                    Some(Ok(Message::Text(t))) => match decode_frame(t.as_str()) {
                        Ok(Frame::Serve(serve)) => on_serve(hub, &leg, &tx, serve, tag),
                        Ok(Frame::Cancel { corr_id }) => hub.cancel(&corr_id, "gateway cancel"),
                        Ok(Frame::Ping) => {
                            let _ = tx.send(Message::Text(heartbeat(&leg).into()));
                        }
                        Ok(Frame::Reconnect) => {
                            let _ = tx.send(Message::Close(None));
                            break "gateway asked to reconnect (draining)".to_string();
                        }
                        Ok(Frame::Admit) => tracing::info!(leg = %tag, "ADMITTED by the gateway"),
                        Ok(Frame::Deny { reason }) => {
                            let reason = reason.as_str().map_or_else(|| reason.to_string(), str::to_string);
                            tracing::warn!(leg = %tag, %reason, "DENIED by the gateway");
                        }
                        Ok(Frame::Unknown { kind }) => {
                            tracing::debug!(leg = %tag, kind = %kind, "ignoring frame");
                        }
                        Err(e) => tracing::warn!(leg = %tag, error = %e, "ignoring a frame"),
                    },
                    Some(Ok(Message::Close(c))) => break closed_by_gateway(c.as_ref()),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break format!("websocket error: {e}"),
                    None => break "websocket ended".to_string(),
                }
            }
            Some(d) = dropped.recv() => {
                last_rx = Instant::now();
                on_dropped(&tx, &d, tag);
            }
            _ = hb.tick() => {
                let _ = tx.send(Message::Text(heartbeat(&leg).into()));
            }
            _ = ka.tick() => {
                if last_rx.elapsed() > Duration::from_secs(60) {
                    break "no frame or pong from the gateway for 60 s".to_string();
                }
                let _ = tx.send(Message::Ping(Vec::new().into()));
            }
            _ = shutdown.cancelled() => {
                let _ = tx.send(Message::Close(None));
                break "shutdown".to_string();
            }
        }
        if writer.is_finished() {
            break "websocket writer failed".to_string();
        }
    };
    // Requests of this leg can no longer be answered: stop them (and their serve calls).
    let orphans: Vec<(String, Arc<Job>)> = leg
        .corr_ids
        .lock()
        .map(|s| s.iter().map(|(c, j)| (c.clone(), Arc::clone(j))).collect())
        .unwrap_or_default();
    for (c, job) in orphans {
        hub.cancel_job(&c, &job, "leg ended");
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
    why
}

/// Cancels kept for requests not (yet) served, at most this many …
pub const EARLY_CANCELS: usize = 1024;
/// … and this many bytes of corr_ids in all (a longer corr_id is not kept).
pub const EARLY_CANCEL_BYTES: usize = 64 << 10;

/// Largest gateway frame a leg takes: a `serve` frame carries one chat request, far below
/// this. A larger message is dropped by the [`FrameGate`] (the leg stays up); a fragmented
/// message over [`gate::MESSAGE_CAP_FACTOR`] × this ends the leg.
pub const GW_MAX_FRAME: usize = 16 << 20;

/// Open a leg's websocket: TCP with TCP_NODELAY (a `chunk` frame must not wait for the
/// gateway's delayed ACK of the previous one: Nagle adds up to 40 ms per frame), TLS for
/// `wss://` (rustls, webpki roots), and the [`FrameGate`] under the websocket library.
/// Oversize messages the gate drops are reported on the returned receiver.
async fn dial(url: &str) -> Result<(Ws, mpsc::UnboundedReceiver<gate::Dropped>), WsError> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let request = url.into_client_request()?;
    let uri = request.uri().clone();
    let tls = match uri.scheme_str() {
        Some("wss") => true,
        Some("ws") => false,
        _ => {
            return Err(WsError::Url(
                tokio_tungstenite::tungstenite::error::UrlError::UnsupportedUrlScheme,
            ))
        }
    };
    let host = uri
        .host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
        .ok_or(WsError::Url(
            tokio_tungstenite::tungstenite::error::UrlError::NoHostName,
        ))?;
    let port = uri.port_u16().unwrap_or(if tls { 443 } else { 80 });
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port)).await?;
    tcp.set_nodelay(true)?;
    let stream = if tls {
        let config = tls_config()?;
        let name = rustls::pki_types::ServerName::try_from(host.clone()).map_err(|_| {
            WsError::Tls(tokio_tungstenite::tungstenite::error::TlsError::InvalidDnsName)
        })?;
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await?;
        MaybeTlsStream::Rustls(tls)
    } else {
        MaybeTlsStream::Plain(tcp)
    };
    let (dropped_tx, dropped_rx) = mpsc::unbounded_channel();
    let gated = FrameGate::new(stream, GW_MAX_FRAME, dropped_tx);
    let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(GW_MAX_FRAME * gate::MESSAGE_CAP_FACTOR))
        .max_frame_size(None);
    let (ws, _) = tokio_tungstenite::client_async_with_config(request, gated, Some(config)).await?;
    Ok((ws, dropped_rx))
}

/// The TLS client configuration of every `wss://` leg (built once): rustls with ring and
/// the webpki root certificates.
fn tls_config() -> Result<Arc<rustls::ClientConfig>, WsError> {
    static CONFIG: std::sync::OnceLock<Arc<rustls::ClientConfig>> = std::sync::OnceLock::new();
    if let Some(c) = CONFIG.get() {
        return Ok(Arc::clone(c));
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| WsError::Io(std::io::Error::other(format!("TLS set-up: {e}"))))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::clone(CONFIG.get_or_init(|| Arc::new(config))))
}

/// Coalesces streamed deltas into at most one `chunk` frame per flush window per
/// `/generate` call, the first delta included, and flushes at the end of each call
/// (docs/PROTOCOL.md §3.6, as the production miner).
struct Coalescer {
    job: Arc<Job>,
    tx: mpsc::UnboundedSender<Message>,
    corr_id: String,
    pending: String,
    window_start: Instant,
    window: Duration,
}

impl Coalescer {
    fn on(&mut self, ev: StreamEvent<'_>) {
        match ev {
            StreamEvent::CallStart => self.window_start = Instant::now(),
            StreamEvent::Delta(d) => {
                self.pending.push_str(d);
                self.flush_if_due();
            }
            StreamEvent::Tick => self.flush_if_due(),
            StreamEvent::CallEnd => self.flush(),
        }
    }

    fn flush_if_due(&mut self) {
        if self.window_start.elapsed() >= self.window {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let frame = wire::MinerFrame::Chunk(wire::Chunk {
            corr_id: self.corr_id.clone(),
            delta: wire::Delta {
                content: std::mem::take(&mut self.pending),
            },
        })
        .to_text();
        self.window_start = Instant::now();
        let tx = &self.tx;
        self.job.if_live(|| tx.send(Message::Text(frame.into())));
    }
}

/// A gateway message the gate dropped for its size: logged; a `serve` whose corr_id its
/// head shows is answered with an error `response` (docs/PROTOCOL.md §2.4).
fn on_dropped(tx: &mpsc::UnboundedSender<Message>, d: &gate::Dropped, tag: &str) {
    let mib = d.bytes as f64 / f64::from(1u32 << 20);
    match gate::dropped_serve_corr_id(&d.head) {
        Some(corr_id) => {
            tracing::warn!(leg = %tag, %corr_id, bytes = d.bytes, "dropped a serve frame over the frame cap; answering it with an error");
            let f = wire::Response::failed(
                &corr_id,
                Value::String(uuid::Uuid::new_v4().simple().to_string()),
                &format!(
                    "serve frame of {mib:.1} MiB exceeds the miner's {} MiB frame cap",
                    GW_MAX_FRAME >> 20
                ),
            );
            send_frame(tx, &wire::MinerFrame::Response(f));
        }
        None => {
            tracing::warn!(leg = %tag, bytes = d.bytes, "dropped a gateway frame over the frame cap; the leg goes on")
        }
    }
}

fn send_frame(tx: &mpsc::UnboundedSender<Message>, frame: &wire::MinerFrame) {
    let _ = tx.send(Message::Text(frame.to_text().into()));
}

fn on_serve(
    hub: &Arc<Hub>,
    leg: &Arc<LegState>,
    tx: &mpsc::UnboundedSender<Message>,
    serve: ServeFrame,
    tag: &str,
) {
    let ServeFrame {
        corr_id,
        request,
        stream,
    } = serve;
    let request_id = wire::request_id(&request)
        .unwrap_or_else(|| Value::String(uuid::Uuid::new_v4().simple().to_string()));
    if hub.take_early_cancel(&corr_id) {
        tracing::info!(leg = %tag, %corr_id, "serve of a request cancelled just before it arrived; answering it as cancelled");
        let f = wire::Response::failed(
            &corr_id,
            request_id,
            "cancelled by the gateway before the serve arrived",
        );
        send_frame(tx, &wire::MinerFrame::Response(f));
        return;
    }
    if hub.draining.load(Ordering::SeqCst) {
        let f = wire::Response::failed(&corr_id, request_id, "miner is shutting down");
        send_frame(tx, &wire::MinerFrame::Response(f));
        return;
    }
    let job = Job::new();
    // Registered BEFORE the task runs: a cancel may arrive before it starts.
    hub.jobs().insert(corr_id.clone(), Arc::clone(&job));
    hub.inflight.fetch_add(1, Ordering::SeqCst);
    leg.inflight.fetch_add(1, Ordering::SeqCst);
    if let Ok(mut s) = leg.corr_ids.lock() {
        s.insert(corr_id.clone(), Arc::clone(&job));
    }
    let hub = Arc::clone(hub);
    let leg = Arc::clone(leg);
    let tx = tx.clone();
    let tag = tag.to_string();
    tracing::info!(leg = %tag, %corr_id, stream, "serve");
    tokio::spawn(async move {
        let mut co = Coalescer {
            job: Arc::clone(&job),
            tx: tx.clone(),
            corr_id: corr_id.clone(),
            pending: String::new(),
            window_start: Instant::now(),
            window: hub.id.flush,
        };
        let result = {
            let mut emit = |ev: StreamEvent<'_>| co.on(ev);
            let sink = if stream {
                Some(StreamSink::new(&mut emit))
            } else {
                None
            };
            hub.engine.process(&request, &job, sink).await
        };
        co.flush();
        let frame = match result {
            Ok((commitment, output)) => Some(wire::Response::completed(
                &corr_id, request_id, commitment, output,
            )),
            Err(JobError::Cancelled) => match job.abort_reason() {
                Some(why) => {
                    tracing::warn!(leg = %tag, %corr_id, why, "request aborted; sending an error response");
                    Some(wire::Response::failed(&corr_id, request_id, &why))
                }
                None => {
                    tracing::info!(leg = %tag, %corr_id, "request cancelled; nothing more is sent for it");
                    None
                }
            },
            Err(JobError::Failed(e)) => {
                tracing::warn!(leg = %tag, %corr_id, error = %e, "request failed; sending an error response");
                Some(wire::Response::failed(&corr_id, request_id, &e))
            }
        };
        if let Some(f) = frame {
            let text = wire::MinerFrame::Response(f).to_text();
            job.if_live(|| tx.send(Message::Text(text.into())));
        }
        hub.forget(&corr_id, &job);
        if let Ok(mut s) = leg.corr_ids.lock() {
            if s.get(&corr_id).is_some_and(|j| Arc::ptr_eq(j, &job)) {
                s.remove(&corr_id);
            }
        }
        if let Ok(mut t) = leg.last_busy.lock() {
            *t = Instant::now();
        }
        leg.inflight.fetch_sub(1, Ordering::SeqCst);
        if hub.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            hub.idle.notify_waiters();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_cancels_expire_and_are_consumed() {
        let t0 = Instant::now();
        let mut q = EarlyCancels::default();
        q.insert("a", t0);
        assert!(q.take("a", t0 + Duration::from_secs(1)));
        assert!(!q.take("a", t0 + Duration::from_secs(1)), "consumed");
        q.insert("b", t0);
        assert!(!q.take("b", t0 + EARLY_CANCEL_WINDOW), "expired");
        assert!(q.is_empty());
        for i in 0..EARLY_CANCELS + 10 {
            q.insert(&i.to_string(), t0);
        }
        assert_eq!(q.len(), EARLY_CANCELS);
        q.insert(&"x".repeat(EARLY_CANCEL_BYTES + 1), t0);
        assert_eq!(q.len(), EARLY_CANCELS);
    }
}
