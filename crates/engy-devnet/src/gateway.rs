//! The gateway double: engy's miner gateway as docs/PROTOCOL.md §2 describes it.
//!
//! * `GET /meta` answers `{"workers": N}` (or 404 when `meta` is off, so a miner falls back
//!   to N = 1).
//! * Websocket legs: `/` when N = 1, else `/<i>` for `i < N` (JSON text frames, each with a
//!   `"type"`).
//! * Every frame in either direction is recorded ([`Frame`]), with the connection and
//!   worker index, so tests can wait on what a miner sent ([`GatewayDouble::wait_for`]).
//! * On command it sends `serve`, `cancel`, `ping`, `reconnect`, `admit`, `deny`,
//!   `open_cells` (the cell challenge, docs/PROTOCOL.md §10; the answer is read with
//!   [`GatewayDouble::wait_cells`]), or drops a connection without a close frame
//!   ([`GatewayDouble::drop_conn`]).
//! * Frames are the types of [`engy_core::wire`]: the double writes [`GatewayFrame`]s and
//!   reads the miner's with [`Frame::miner_frame`] (strict: unknown fields refused).
//! * [`GatewayDouble::submit`] routes a chat request like the gateway does: to the live,
//!   HELLO'd leg with the most free capacity (`capacity.max_inflight` minus outstanding).
//! * `POST /v1/open_cells` is the audit service's call (docs/PROTOCOL.md §11.3): the double
//!   sends `open_cells` on a live leg of the named miner (its `miner_key` registered with
//!   [`GatewayDouble::register_miner`]) and answers with what came back by the deadline.
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engy_core::wire::{CellChallenge, GatewayFrame, OpenCells, Serve};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};

/// Direction of a recorded frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Sent by the miner.
    FromMiner,
    /// Sent by the gateway double.
    ToMiner,
}

/// One recorded frame (or connection event).
#[derive(Debug, Clone)]
pub struct Frame {
    /// Connection id (1, 2, … in accept order).
    pub conn: u64,
    /// Worker index the leg dialed (`0` for the single-worker path `/`).
    pub worker: usize,
    /// Direction.
    pub dir: Dir,
    /// The frame. Non-JSON text is recorded as `{"type":"<non-json>","raw":…}`; connection
    /// end as `{"type":"<closed>"}` (direction `FromMiner`).
    pub value: Value,
    /// When it was recorded.
    pub at: Instant,
}

impl Frame {
    /// The frame's `"type"`, or `""`.
    pub fn kind(&self) -> &str {
        self.value.get("type").and_then(Value::as_str).unwrap_or("")
    }
    /// The frame read strictly as one of the miner's wire frames
    /// ([`engy_core::wire::MinerFrame::parse_strict`]: unknown types and fields refused).
    ///
    /// # Errors
    /// The serde error.
    pub fn miner_frame(&self) -> Result<engy_core::wire::MinerFrame, serde_json::Error> {
        serde_json::from_value(self.value.clone())
    }

    /// The frame's `"corr_id"`, or `""`.
    pub fn corr_id(&self) -> &str {
        self.value
            .get("corr_id")
            .and_then(Value::as_str)
            .unwrap_or("")
    }
}

/// A connection as the double sees it.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    /// Connection id.
    pub id: u64,
    /// Worker index.
    pub worker: usize,
    /// Still open.
    pub alive: bool,
    /// The HELLO frame, once received.
    pub hello: Option<Value>,
}

impl ConnInfo {
    /// `hello.capacity.max_inflight`, or 0.
    pub fn max_inflight(&self) -> u64 {
        self.hello
            .as_ref()
            .and_then(|h| h.pointer("/capacity/max_inflight"))
            .and_then(Value::as_u64)
            .unwrap_or(0)
    }
}

/// Configuration of the double.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Number of gateway workers (`/meta` answer and leg paths).
    pub workers: usize,
    /// Serve `/meta` (off = 404, the miner then assumes one worker).
    pub meta: bool,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            workers: 1,
            meta: true,
        }
    }
}

enum Cmd {
    Send(Value),
    /// Several frames written back to back, flushed once.
    SendTogether(Vec<Value>),
    /// A websocket close frame with this code and reason, then the socket closes.
    Close(u16, String),
    Drop,
}

struct Conn {
    worker: usize,
    tx: mpsc::UnboundedSender<Cmd>,
    alive: bool,
    hello: Option<Value>,
}

struct Inner {
    cfg: GatewayConfig,
    frames: Mutex<Vec<Frame>>,
    conns: Mutex<HashMap<u64, Conn>>,
    next_id: Mutex<u64>,
    /// corr_id → conn for requests without a terminal response yet.
    outstanding: Mutex<HashMap<String, u64>>,
    /// miner_key → hotkey (SS58), as the gateway's registry maps them.
    miners: Mutex<HashMap<String, String>>,
    changed: watch::Sender<u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Inner {
    fn record(&self, conn: u64, worker: usize, dir: Dir, value: Value) {
        // Before any lock: the time the frame arrived, not when the log was free.
        let at = Instant::now();
        if dir == Dir::FromMiner {
            match value.get("type").and_then(Value::as_str) {
                Some("hello") => {
                    if let Some(c) = lock(&self.conns).get_mut(&conn) {
                        c.hello = Some(value.clone());
                    }
                }
                Some("response") => {
                    if let Some(id) = value.get("corr_id").and_then(Value::as_str) {
                        lock(&self.outstanding).remove(id);
                    }
                }
                _ => {}
            }
        }
        lock(&self.frames).push(Frame {
            conn,
            worker,
            dir,
            value,
            at,
        });
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// A running gateway double on 127.0.0.1. Dropping it stops the server (open legs end).
pub struct GatewayDouble {
    addr: SocketAddr,
    inner: Arc<Inner>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for GatewayDouble {
    fn drop(&mut self) {
        for c in lock(&self.inner.conns).values() {
            let _ = c.tx.send(Cmd::Drop);
        }
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
    }
}

impl GatewayDouble {
    /// Start on an ephemeral port of 127.0.0.1.
    ///
    /// # Errors
    /// The bind error.
    pub async fn start(cfg: GatewayConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        Self::start_on(listener, cfg)
    }

    /// Start on an already bound listener.
    ///
    /// # Errors
    /// The listener's `local_addr` error.
    pub fn start_on(listener: TcpListener, cfg: GatewayConfig) -> std::io::Result<Self> {
        let addr = listener.local_addr()?;
        let (changed, _) = watch::channel(0);
        let inner = Arc::new(Inner {
            cfg,
            frames: Mutex::new(Vec::new()),
            conns: Mutex::new(HashMap::new()),
            next_id: Mutex::new(0),
            outstanding: Mutex::new(HashMap::new()),
            miners: Mutex::new(HashMap::new()),
            changed,
        });
        let app = Router::new()
            .route("/meta", get(meta))
            .route("/v1/open_cells", post(open_cells_call))
            .route("/", get(ws_root))
            .route("/{worker}", get(ws_worker))
            .with_state(Arc::clone(&inner));
        let tx = crate::spawn_server(listener, app);
        Ok(Self {
            addr,
            inner,
            shutdown: Some(tx),
        })
    }

    /// The miner's `GW`: `ws://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every frame so far.
    pub fn frames(&self) -> Vec<Frame> {
        lock(&self.inner.frames).clone()
    }

    /// Every connection so far.
    pub fn conns(&self) -> Vec<ConnInfo> {
        let mut v: Vec<ConnInfo> = lock(&self.inner.conns)
            .iter()
            .map(|(id, c)| ConnInfo {
                id: *id,
                worker: c.worker,
                alive: c.alive,
                hello: c.hello.clone(),
            })
            .collect();
        v.sort_by_key(|c| c.id);
        v
    }

    /// Live connections that have sent HELLO.
    pub fn live_legs(&self) -> Vec<ConnInfo> {
        self.conns()
            .into_iter()
            .filter(|c| c.alive && c.hello.is_some())
            .collect()
    }

    /// Wait until `pred` over (frames, connections) returns `Some`, re-checking on every
    /// recorded change; `None` after `timeout`.
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&[Frame], &[ConnInfo]) -> Option<T>,
    ) -> Option<T> {
        let mut rx = self.inner.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let conns = self.conns();
            {
                let frames = lock(&self.inner.frames);
                if let Some(v) = pred(&frames, &conns) {
                    return Some(v);
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// Wait for `n` live HELLO'd legs.
    pub async fn wait_legs(&self, n: usize, timeout: Duration) -> Option<Vec<ConnInfo>> {
        self.wait_for(timeout, |_, conns| {
            let live: Vec<ConnInfo> = conns
                .iter()
                .filter(|c| c.alive && c.hello.is_some())
                .cloned()
                .collect();
            (live.len() >= n).then_some(live)
        })
        .await
    }

    /// Wait for the terminal `response` frame of `corr_id`.
    pub async fn wait_response(&self, corr_id: &str, timeout: Duration) -> Option<Value> {
        self.wait_for(timeout, |frames, _| {
            frames
                .iter()
                .find(|f| {
                    f.dir == Dir::FromMiner && f.kind() == "response" && f.corr_id() == corr_id
                })
                .map(|f| f.value.clone())
        })
        .await
    }

    /// Registers a miner: legs whose `hello.miner_key` is `miner_key` are those of `hotkey`
    /// (the gateway's own registry; `POST /v1/open_cells` names miners by hotkey).
    pub fn register_miner(&self, miner_key: &str, hotkey: &str) {
        lock(&self.inner.miners).insert(miner_key.to_owned(), hotkey.to_owned());
    }

    /// `open_cells {request_id, seed, n}` on `conn`: challenge the cells the miner committed
    /// for `request_id` (docs/PROTOCOL.md §10).
    pub fn open_cells(&self, conn: u64, request_id: Value, seed: [u8; 32], n: u64) -> bool {
        let frame = GatewayFrame::OpenCells(OpenCells {
            request_id,
            challenge: Ok(CellChallenge { seed, n }),
        });
        self.send(conn, frame.to_value())
    }

    /// Wait for the miner's answer to an `open_cells` of `request_id`: the first `cells` or
    /// `cells_error` frame carrying it after the `skip` earlier answers about it.
    pub async fn wait_cells(
        &self,
        request_id: &Value,
        skip: usize,
        timeout: Duration,
    ) -> Option<Value> {
        self.wait_for(timeout, |frames, _| {
            frames
                .iter()
                .filter(|f| {
                    f.dir == Dir::FromMiner
                        && matches!(f.kind(), "cells" | "cells_error")
                        && f.value.get("request_id") == Some(request_id)
                })
                .nth(skip)
                .map(|f| f.value.clone())
        })
        .await
    }

    /// Every `chunk` frame of `corr_id`, in order.
    pub fn chunks(&self, corr_id: &str) -> Vec<Value> {
        lock(&self.inner.frames)
            .iter()
            .filter(|f| f.dir == Dir::FromMiner && f.kind() == "chunk" && f.corr_id() == corr_id)
            .map(|f| f.value.clone())
            .collect()
    }

    /// Every frame the miner sent about `corr_id`.
    pub fn frames_for(&self, corr_id: &str) -> Vec<Frame> {
        lock(&self.inner.frames)
            .iter()
            .filter(|f| f.dir == Dir::FromMiner && f.corr_id() == corr_id)
            .cloned()
            .collect()
    }

    /// Send a raw frame on `conn`; false if the connection is gone.
    pub fn send(&self, conn: u64, frame: Value) -> bool {
        let conns = lock(&self.inner.conns);
        match conns.get(&conn) {
            Some(c) if c.alive => c.tx.send(Cmd::Send(frame)).is_ok(),
            _ => false,
        }
    }

    /// Send several raw frames on `conn` back to back with one flush, so they reach the
    /// miner in one read (as a busy gateway's frames may); false if the connection is gone.
    pub fn send_together(&self, conn: u64, frames: Vec<Value>) -> bool {
        let conns = lock(&self.inner.conns);
        match conns.get(&conn) {
            Some(c) if c.alive => c.tx.send(Cmd::SendTogether(frames)).is_ok(),
            _ => false,
        }
    }

    /// `serve {corr_id, request, stream}` on `conn`.
    pub fn serve(&self, conn: u64, corr_id: &str, request: Value, stream: bool) -> bool {
        lock(&self.inner.outstanding).insert(corr_id.to_string(), conn);
        let frame = GatewayFrame::Serve(Serve {
            corr_id: corr_id.to_string(),
            request,
            stream,
        });
        self.send(conn, frame.to_value())
    }

    /// `cancel {corr_id}` on `conn` (the gateway stops waiting for it).
    pub fn cancel(&self, conn: u64, corr_id: &str) -> bool {
        lock(&self.inner.outstanding).remove(corr_id);
        self.send(
            conn,
            GatewayFrame::Cancel {
                corr_id: corr_id.to_string(),
            }
            .to_value(),
        )
    }

    /// `ping` on `conn`.
    pub fn ping(&self, conn: u64) -> bool {
        self.send(conn, GatewayFrame::Ping.to_value())
    }

    /// `reconnect` on `conn` (gateway draining).
    pub fn reconnect(&self, conn: u64) -> bool {
        self.send(conn, GatewayFrame::Reconnect.to_value())
    }

    /// `admit` on `conn`.
    pub fn admit(&self, conn: u64) -> bool {
        self.send(conn, GatewayFrame::Admit.to_value())
    }

    /// `deny {reason}` on `conn`.
    pub fn deny(&self, conn: u64, reason: &str) -> bool {
        self.send(
            conn,
            GatewayFrame::Deny {
                reason: Value::String(reason.to_string()),
            }
            .to_value(),
        )
    }

    /// Close `conn` with a websocket close frame (RFC 6455 §5.5.1: `code`, `reason`), as a
    /// gateway does when it restarts (1001 "going away") or refuses a leg.
    pub fn close(&self, conn: u64, code: u16, reason: &str) -> bool {
        lock(&self.inner.conns)
            .get(&conn)
            .map(|c| c.tx.send(Cmd::Close(code, reason.to_string())).is_ok())
            .unwrap_or(false)
    }

    /// Drop `conn` abruptly: the socket closes without a close frame.
    pub fn drop_conn(&self, conn: u64) -> bool {
        lock(&self.inner.conns)
            .get(&conn)
            .map(|c| c.tx.send(Cmd::Drop).is_ok())
            .unwrap_or(false)
    }

    /// Route a chat request as the gateway does: to the live HELLO'd leg with the most free
    /// capacity (`max_inflight` − outstanding). Returns `(conn, corr_id)`, or `None` when
    /// no leg has room.
    pub fn submit(&self, request: Value, stream: bool) -> Option<(u64, String)> {
        let outstanding: HashMap<u64, u64> = {
            let mut m = HashMap::new();
            for c in lock(&self.inner.outstanding).values() {
                *m.entry(*c).or_insert(0) += 1;
            }
            m
        };
        let best = self
            .live_legs()
            .into_iter()
            .map(|c| {
                let used = outstanding.get(&c.id).copied().unwrap_or(0);
                (c.max_inflight().saturating_sub(used), c.id)
            })
            .filter(|(free, _)| *free > 0)
            .max_by_key(|(free, id)| (*free, std::cmp::Reverse(*id)))?;
        let corr = uuid::Uuid::new_v4().simple().to_string();
        self.serve(best.1, &corr, request, stream)
            .then_some((best.1, corr))
    }
}

/// `POST /v1/open_cells` (docs/PROTOCOL.md §11.3): `{request_id, hotkey, seed, n,
/// deadline_ms}`. Within `deadline_ms` the double waits for a live leg of `hotkey` (the leg
/// that answered `request_id` first, else the lowest), sends `open_cells {request_id, seed,
/// n}` on it and waits for the miner's `cells` / `cells_error` about `request_id`: `200
/// {"cells": frame}` or `200 {"cells_error": frame}`, `504 {"error": "deadline"}` when
/// nothing came; `400 {"error", "field"}` for a call it cannot read.
async fn open_cells_call(State(st): State<Arc<Inner>>, body: axum::body::Bytes) -> Response {
    let bad = |field: &str, error: String| {
        (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": error, "field": field})),
        )
            .into_response()
    };
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return bad("body", "not JSON".into());
    };
    let Some(request_id) = v.get("request_id").filter(|r| !r.is_null()).cloned() else {
        return bad("request_id", "missing".into());
    };
    let Some(hotkey) = v.get("hotkey").and_then(Value::as_str).map(str::to_owned) else {
        return bad("hotkey", "missing or not a string".into());
    };
    let seed = match v
        .get("seed")
        .and_then(Value::as_str)
        .map(engy_core::commit::parse_digest)
    {
        Some(Ok(s)) => s,
        _ => return bad("seed", "not 64 hex characters".into()),
    };
    let Some(n) = v.get("n").and_then(Value::as_u64) else {
        return bad("n", "not an unsigned integer".into());
    };
    let Some(deadline_ms) = v.get("deadline_ms").and_then(Value::as_u64) else {
        return bad("deadline_ms", "not an unsigned integer".into());
    };
    let deadline = tokio::time::Instant::now() + Duration::from_millis(deadline_ms);
    let mut rx = st.changed.subscribe();
    let mut sent: Option<usize> = None;
    loop {
        {
            let frames = lock(&st.frames);
            let answers = |f: &&Frame| {
                f.dir == Dir::FromMiner
                    && matches!(f.kind(), "cells" | "cells_error")
                    && f.value.get("request_id") == Some(&request_id)
            };
            match sent {
                Some(before) => {
                    if let Some(f) = frames.iter().filter(answers).nth(before) {
                        let key = f.kind().to_owned();
                        return axum::Json(json!({ key: f.value.clone() })).into_response();
                    }
                }
                None => {
                    let before = frames.iter().filter(answers).count();
                    let answered_on = frames
                        .iter()
                        .find(|f| {
                            f.dir == Dir::FromMiner
                                && f.kind() == "response"
                                && f.value.get("request_id") == Some(&request_id)
                        })
                        .map(|f| f.conn);
                    drop(frames);
                    let miners = lock(&st.miners).clone();
                    let conns = lock(&st.conns);
                    let mut legs: Vec<u64> = conns
                        .iter()
                        .filter(|(_, c)| {
                            c.alive
                                && c.hello
                                    .as_ref()
                                    .and_then(|h| h.get("miner_key"))
                                    .and_then(Value::as_str)
                                    .and_then(|k| miners.get(k))
                                    == Some(&hotkey)
                        })
                        .map(|(id, _)| *id)
                        .collect();
                    legs.sort_by_key(|id| (Some(*id) != answered_on, *id));
                    if let Some(conn) = legs.first().and_then(|id| conns.get(id)) {
                        let frame = GatewayFrame::OpenCells(OpenCells {
                            request_id: request_id.clone(),
                            challenge: Ok(CellChallenge { seed, n }),
                        });
                        if conn.tx.send(Cmd::Send(frame.to_value())).is_ok() {
                            sent = Some(before);
                        }
                    }
                }
            }
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            _ => {
                return (
                    StatusCode::GATEWAY_TIMEOUT,
                    axum::Json(json!({"error": "deadline"})),
                )
                    .into_response()
            }
        }
    }
}

async fn meta(State(st): State<Arc<Inner>>) -> Response {
    if st.cfg.meta {
        axum::Json(json!({"workers": st.cfg.workers})).into_response()
    } else {
        StatusCode::NOT_FOUND.into_response()
    }
}

async fn ws_root(State(st): State<Arc<Inner>>, ws: WebSocketUpgrade) -> Response {
    ws.on_upgrade(move |s| conn_task(st, 0, s))
}

async fn ws_worker(
    State(st): State<Arc<Inner>>,
    Path(worker): Path<String>,
    ws: WebSocketUpgrade,
) -> Response {
    match worker.parse::<usize>() {
        Ok(i) if i < st.cfg.workers => ws.on_upgrade(move |s| conn_task(st, i, s)),
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn conn_task(st: Arc<Inner>, worker: usize, socket: WebSocket) {
    let (tx, mut rx) = mpsc::unbounded_channel::<Cmd>();
    let id = {
        let mut n = lock(&st.next_id);
        *n += 1;
        *n
    };
    lock(&st.conns).insert(
        id,
        Conn {
            worker,
            tx,
            alive: true,
            hello: None,
        },
    );
    st.changed.send_modify(|v| *v = v.wrapping_add(1));
    let (mut sink, mut stream) = socket.split();
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                Some(Cmd::Send(v)) => {
                    st.record(id, worker, Dir::ToMiner, v.clone());
                    if sink.send(Message::Text(v.to_string().into())).await.is_err() {
                        break;
                    }
                }
                Some(Cmd::SendTogether(vs)) => {
                let mut ok = true;
                for v in vs {
                    st.record(id, worker, Dir::ToMiner, v.clone());
                    if sink.feed(Message::Text(v.to_string().into())).await.is_err() {
                        ok = false;
                        break;
                    }
                }
                if !ok || sink.flush().await.is_err() {
                    break;
                }
            }
                Some(Cmd::Close(code, reason)) => {
                    let frame = axum::extract::ws::CloseFrame { code, reason: reason.into() };
                    let _ = sink.send(Message::Close(Some(frame))).await;
                    break;
                }
                Some(Cmd::Drop) | None => break,
            },
            msg = stream.next() => match msg {
                Some(Ok(Message::Text(t))) => {
                    let v = serde_json::from_str::<Value>(t.as_str())
                        .unwrap_or_else(|_| json!({"type":"<non-json>","raw":t.as_str()}));
                    st.record(id, worker, Dir::FromMiner, v);
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
        }
    }
    if let Some(c) = lock(&st.conns).get_mut(&id) {
        c.alive = false;
    }
    st.record(id, worker, Dir::FromMiner, json!({"type":"<closed>"}));
}
