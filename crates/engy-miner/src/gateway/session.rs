//! One websocket session of a leg: HELLO, heartbeats and keep-alive pings, gateway frames
//! in ([`wire::GatewayFrame`]), one task per `serve`, and its terminal frame out.
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engy_core::wire;
use futures_util::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::coalesce::Coalescer;
use super::connection::{Ws, GW_MAX_FRAME};
use super::gate;
use super::hub::Hub;
use super::{decode_frame, Frame, ServeFrame};
use crate::job::JobError;
use crate::metrics::Outcome;
use crate::serve::{StreamEvent, StreamSink};

/// One leg session's own state: its id in the hub's registry and when it was last busy.
pub(crate) struct LegState {
    id: u64,
    last_busy: Mutex<Instant>,
}

impl LegState {
    /// `(inflight, idle_seconds)` of the heartbeat (docs/PROTOCOL.md §2.2).
    fn load(&self, hub: &Hub) -> (u64, f64) {
        let inflight = hub.leg_inflight(self.id);
        let idle = if inflight > 0 {
            0.0
        } else {
            self.last_busy
                .lock()
                .map(|t| t.elapsed().as_secs_f64())
                .unwrap_or(0.0)
        };
        (inflight as u64, idle)
    }
}

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

/// One websocket session; returns why it ended.
pub(crate) async fn session(
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
        id: hub.new_leg(),
        last_busy: Mutex::new(Instant::now()),
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
    // Counted before HELLO leaves: a gateway that saw HELLO sees the leg counted.
    hub.metrics.leg_up(true);
    let _ = tx.send(Message::Text(hello.to_text().into()));
    drop(hello);
    tracing::info!(leg = %tag, max_inflight = per_leg, "HELLO sent; awaiting work");
    let heartbeat = |leg: &LegState| {
        let (inflight, idle_seconds) = leg.load(hub);
        wire::MinerFrame::Heartbeat(wire::Heartbeat {
            inflight,
            idle_seconds,
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
                        Ok(Frame::OpenCells(open)) => on_open_cells(hub, &tx, open, tag),
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
    hub.cancel_leg(leg.id, "leg ended");
    hub.metrics.leg_up(false);
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
    why
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

/// `open_cells` (docs/PROTOCOL.md §10): the retention store answers with `cells` or
/// `cells_error`, off the leg's read loop (a large opening takes a moment to encode).
fn on_open_cells(
    hub: &Arc<Hub>,
    tx: &mpsc::UnboundedSender<Message>,
    open: wire::OpenCells,
    tag: &str,
) {
    let hub = Arc::clone(hub);
    let tx = tx.clone();
    let tag = tag.to_string();
    tokio::task::spawn_blocking(move || {
        let frame = match hub.engine.cell_store() {
            Some(store) => store.open(&open.request_id, &open.challenge),
            None => {
                hub.metrics.cells_opening("unknown_request");
                wire::MinerFrame::CellsError(wire::CellsError {
                    request_id: open.request_id.clone(),
                    reason: wire::CellsRefusal::UnknownRequest,
                    error: "this miner commits no cells (ENGY_CELLS=off)".into(),
                })
            }
        };
        match &frame {
            wire::MinerFrame::Cells(c) => {
                tracing::info!(leg = %tag, request_id = %open.request_id, cells = c.openings.len(), "open_cells answered")
            }
            wire::MinerFrame::CellsError(e) => {
                tracing::warn!(leg = %tag, request_id = %open.request_id, reason = ?e.reason, error = %e.error, "open_cells refused")
            }
            _ => {}
        }
        send_frame(&tx, &frame);
    });
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
    let arrived = Instant::now();
    let request_id = wire::request_id(&request)
        .unwrap_or_else(|| Value::String(uuid::Uuid::new_v4().simple().to_string()));
    if hub.take_early_cancel(&corr_id) {
        tracing::info!(leg = %tag, %corr_id, "serve of a request cancelled just before it arrived; answering it as cancelled");
        let f = wire::Response::failed(
            &corr_id,
            request_id,
            "cancelled by the gateway before the serve arrived",
        );
        hub.metrics.request(Outcome::Refused);
        send_frame(tx, &wire::MinerFrame::Response(f));
        return;
    }
    if hub.draining.load(Ordering::SeqCst) {
        let f = wire::Response::failed(&corr_id, request_id, "miner is shutting down");
        hub.metrics.request(Outcome::Refused);
        send_frame(tx, &wire::MinerFrame::Response(f));
        return;
    }
    // Registered BEFORE the task runs: a cancel may arrive before it starts.
    let ticket = hub.register(&corr_id, leg.id);
    let job = Arc::clone(&ticket.job);
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
            hub.engine.process(&request, &request_id, &job, sink).await
        };
        co.flush();
        let (outcome, frame) = match result {
            Ok((commitment, output)) => (
                Outcome::Completed,
                Some(wire::Response::completed(
                    &corr_id, request_id, commitment, output,
                )),
            ),
            Err(JobError::Cancelled) => match job.abort_reason() {
                Some(why) => {
                    tracing::warn!(leg = %tag, %corr_id, why, "request aborted; sending an error response");
                    (
                        Outcome::Aborted,
                        Some(wire::Response::failed(&corr_id, request_id, &why)),
                    )
                }
                None => {
                    tracing::info!(leg = %tag, %corr_id, "request cancelled; nothing more is sent for it");
                    (Outcome::Cancelled, None)
                }
            },
            Err(JobError::Failed(e)) => {
                tracing::warn!(leg = %tag, %corr_id, error = %e, "request failed; sending an error response");
                (
                    Outcome::Failed,
                    Some(wire::Response::failed(&corr_id, request_id, &e)),
                )
            }
        };
        // Counted before the frame leaves: whoever saw the response sees it counted.
        hub.metrics.request(outcome);
        if outcome == Outcome::Completed {
            hub.metrics.served_in(arrived.elapsed());
        }
        if let Some(f) = frame {
            let text = wire::MinerFrame::Response(f).to_text();
            job.if_live(|| tx.send(Message::Text(text.into())));
        }
        if let Ok(mut t) = leg.last_busy.lock() {
            *t = Instant::now();
        }
        hub.finish(&ticket);
    });
}
