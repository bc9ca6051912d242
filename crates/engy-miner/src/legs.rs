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

use futures_util::{SinkExt, StreamExt};
use rand::Rng;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::engine::{short, Engine, Job, JobError, StreamSink};

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
    fn capacity(&self, per_leg: u64) -> Value {
        json!({
            "max_inflight": per_leg,
            "max_inflight_total": self.max_inflight_total,
            "max_input_tokens": self.max_input_tokens,
            "max_output_tokens": self.max_output_tokens,
            "max_request_s": self.max_request_s,
        })
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

/// A gateway → miner frame (PROTOCOL.md §2, "Frames gateway → miner"), decoded from one
/// websocket text frame by [`decode_frame`].
#[derive(Debug, Clone, PartialEq)]
pub enum Frame {
    /// `serve`: run one request.
    Serve(ServeFrame),
    /// `cancel {corr_id}`: the buyer left; stop and send nothing more for it.
    Cancel {
        /// The request's correlation id (non-empty).
        corr_id: String,
    },
    /// `ping`: answer with a heartbeat.
    Ping,
    /// `reconnect`: the gateway is draining; close this leg and re-dial.
    Reconnect,
    /// `admit`: logged.
    Admit,
    /// `deny {reason}`: logged; `reason` as sent (`null` when absent).
    Deny {
        /// The gateway's reason, any JSON value.
        reason: Value,
    },
    /// A frame of another `type` (ignored; a newer gateway may send more kinds).
    Other {
        /// Its `type` ("" when it has none or it is not a string).
        kind: String,
    },
}

/// The fields of a `serve` frame (PROTOCOL.md §2): `{corr_id, request, stream?: bool}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeFrame {
    /// Correlation id of the request (non-empty).
    pub corr_id: String,
    /// The OpenAI-style chat body (`Value::Null` when absent; the request path rejects it).
    pub request: Value,
    /// Stream `chunk` frames (absent or not a bool = false).
    pub stream: bool,
}

/// Why a gateway text frame was not decoded (the frame is logged and ignored).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Not JSON, or JSON that is not an object.
    #[error("frame is not a JSON object: {0}")]
    NotAnObject(String),
    /// A `serve` or `cancel` frame without a non-empty string `corr_id`.
    #[error("{kind} frame without a corr_id")]
    NoCorrId {
        /// `"serve"` or `"cancel"`.
        kind: &'static str,
    },
}

/// Decode one websocket text frame from the gateway (PROTOCOL.md §2) into a [`Frame`].
/// Pure: no I/O, no state. Unknown `type`s are [`Frame::Other`], not errors.
///
/// # Errors
/// [`FrameError::NotAnObject`] for text that is not a JSON object;
/// [`FrameError::NoCorrId`] for a `serve` or `cancel` without a non-empty string `corr_id`.
pub fn decode_frame(text: &str) -> Result<Frame, FrameError> {
    let frame: Value =
        serde_json::from_str(text).map_err(|e| FrameError::NotAnObject(e.to_string()))?;
    let Value::Object(mut obj) = frame else {
        return Err(FrameError::NotAnObject("not an object".into()));
    };
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let corr_id = |obj: &serde_json::Map<String, Value>, kind: &'static str| {
        obj.get("corr_id")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .map(str::to_string)
            .ok_or(FrameError::NoCorrId { kind })
    };
    Ok(match kind.as_str() {
        "serve" => Frame::Serve(ServeFrame {
            corr_id: corr_id(&obj, "serve")?,
            stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
            request: obj.remove("request").unwrap_or(Value::Null),
        }),
        "cancel" => Frame::Cancel {
            corr_id: corr_id(&obj, "cancel")?,
        },
        "ping" => Frame::Ping,
        "reconnect" => Frame::Reconnect,
        "admit" => Frame::Admit,
        "deny" => Frame::Deny {
            reason: obj.remove("reason").unwrap_or(Value::Null),
        },
        _ => Frame::Other { kind },
    })
}

/// Shared state of all legs.
pub struct Hub {
    /// Identity and capacity.
    pub id: Identity,
    /// The request path.
    pub engine: Arc<Engine>,
    /// corr_id → job, for cancel.
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    /// corr_ids cancelled before their serve arrived (bounded).
    early_cancels: Mutex<VecDeque<String>>,
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
            early_cancels: Mutex::new(VecDeque::new()),
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
                let mut q = self.early_cancels.lock().unwrap_or_else(|p| p.into_inner());
                // Bounded in entries and bytes: a gateway cannot grow it with long ids.
                if corr_id.len() <= EARLY_CANCEL_BYTES {
                    q.push_back(corr_id.to_string());
                }
                while q.len() > EARLY_CANCELS
                    || q.iter().map(String::len).sum::<usize>() > EARLY_CANCEL_BYTES
                {
                    q.pop_front();
                }
                let shown = corr_id
                    .char_indices()
                    .nth(64)
                    .and_then(|(i, _)| corr_id.get(..i))
                    .unwrap_or(corr_id);
                tracing::info!(
                    corr_id = shown,
                    why,
                    "cancel for an unknown or finished request"
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

    /// Cancel every job (shutdown).
    pub fn cancel_all(&self, why: &str) {
        let ids: Vec<String> = self.jobs().keys().cloned().collect();
        for id in ids {
            self.cancel(&id, why);
        }
    }

    /// Whether a cancel arrived for `corr_id` before its `serve` (§2: "a cancel may arrive
    /// before the job has started"); consumes it.
    fn take_early_cancel(&self, corr_id: &str) -> bool {
        let mut q = self.early_cancels.lock().unwrap_or_else(|p| p.into_inner());
        match q.iter().position(|c| c == corr_id) {
            Some(i) => {
                q.remove(i);
                true
            }
            None => false,
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
            Ok(Ok((ws, _))) => {
                let why = session(&hub, ws, &tag, per_leg, &shutdown).await;
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

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

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
async fn session(
    hub: &Arc<Hub>,
    ws: Ws,
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
    let hello = json!({
        "type": "hello",
        "miner_key": hub.id.miner_key.expose(),
        "model": hub.id.model,
        "model_root": hub.id.model_root,
        "hw": hub.id.hw,
        "versions": hub.id.versions,
        "capacity": cap,
        "worker_name": hub.id.worker_name,
        "instance_id": hub.id.worker_name,
        "worker_id": hub.id.worker_id,
    });
    let _ = tx.send(Message::Text(hello.to_string().into()));
    tracing::info!(leg = %tag, max_inflight = per_leg, "HELLO sent; awaiting work");
    let heartbeat = |leg: &LegState| {
        json!({"type": "heartbeat", "inflight": leg.inflight.load(Ordering::SeqCst),
               "idle_seconds": leg.idle_seconds(), "capacity": cap})
        .to_string()
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
                            tracing::warn!(leg = %tag, %reason, "DENIED by the gateway");
                        }
                        Ok(Frame::Other { kind }) => {
                            tracing::debug!(leg = %tag, kind = %kind, "ignoring frame");
                        }
                        Err(e) => tracing::warn!(leg = %tag, error = %e, "ignoring a frame"),
                    },
                    Some(Ok(Message::Close(c))) => break format!("gateway closed the leg ({c:?})"),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => break format!("websocket error: {e}"),
                    None => break "websocket ended".to_string(),
                }
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
const EARLY_CANCELS: usize = 1024;
/// … and this many bytes of corr_ids in all (a longer corr_id is not kept).
const EARLY_CANCEL_BYTES: usize = 64 << 10;

/// Largest gateway frame (and message) a leg accepts: a `serve` frame carries one chat
/// request, far below this; anything larger is a broken or hostile gateway and ends the leg.
const GW_MAX_MESSAGE: usize = 16 << 20;

/// Open a leg's websocket with TCP_NODELAY (a `chunk` frame must not wait for the
/// gateway's delayed ACK of the previous one: Nagle adds up to 40 ms per frame) and
/// explicit frame and message caps.
async fn dial(
    url: &str,
) -> Result<
    (
        tokio_tungstenite::WebSocketStream<
            tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
        >,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ),
    tokio_tungstenite::tungstenite::Error,
> {
    let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(Some(GW_MAX_MESSAGE))
        .max_frame_size(Some(GW_MAX_MESSAGE));
    tokio_tungstenite::connect_async_with_config(url, Some(config), true).await
}

/// Coalesces streamed deltas into at most one `chunk` frame per flush window (§2).
struct Coalescer {
    job: Arc<Job>,
    tx: mpsc::UnboundedSender<Message>,
    corr_id: String,
    pending: String,
    last_flush: Option<Instant>,
    window: Duration,
}

impl Coalescer {
    /// Add a delta (an empty one is a timer tick); flush when the window has passed.
    fn push(&mut self, delta: &str) {
        self.pending.push_str(delta);
        let due = self
            .last_flush
            .map(|t| t.elapsed() >= self.window)
            .unwrap_or(true);
        if due {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let frame =
            json!({"type": "chunk", "corr_id": self.corr_id, "delta": {"content": self.pending}})
                .to_string();
        self.pending.clear();
        self.last_flush = Some(Instant::now());
        let tx = &self.tx;
        self.job.if_live(|| tx.send(Message::Text(frame.into())));
    }
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
    let request_id = request
        .get("engy_request_id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    if hub.take_early_cancel(&corr_id) {
        tracing::info!(leg = %tag, %corr_id, "serve for an already cancelled request ignored");
        return;
    }
    let job = Job::new();
    if hub.draining.load(Ordering::SeqCst) {
        let f = json!({"type":"response","corr_id":corr_id,"request_id":request_id,"commitment":null,"output":{},"error":"miner is shutting down"});
        let _ = tx.send(Message::Text(f.to_string().into()));
        return;
    }
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
            last_flush: None,
            window: hub.id.flush,
        };
        let result = {
            let mut emit = |d: &str| co.push(d);
            let sink = if stream {
                Some(StreamSink::new(&mut emit))
            } else {
                None
            };
            hub.engine.process(&request, &job, sink).await
        };
        co.flush();
        let frame = match result {
            Ok((commitment, output)) => Some(
                json!({"type":"response","corr_id":corr_id,"request_id":request_id,
                                                    "commitment":commitment,"output":output}),
            ),
            Err(JobError::Cancelled) => {
                tracing::info!(leg = %tag, %corr_id, "request cancelled; nothing more is sent for it");
                None
            }
            Err(JobError::Failed(e)) => {
                tracing::warn!(leg = %tag, %corr_id, error = %e, "request failed; sending an error response");
                Some(
                    json!({"type":"response","corr_id":corr_id,"request_id":request_id,
                            "commitment":null,"output":{},"error":short(&e)}),
                )
            }
        };
        if let Some(f) = frame {
            job.if_live(|| tx.send(Message::Text(f.to_string().into())));
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
