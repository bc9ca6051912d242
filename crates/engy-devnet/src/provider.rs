//! The provider API double (PROTOCOL.md §6): real HTTP on 127.0.0.1 serving
//! `GET /api/subnet/v1/epoch/latest` with payloads signed by a given master key, and
//! recording every `POST /api/subnet/v1/validator/heartbeat` (verified with engy-core).
//!
//! Faults are switchable at any time ([`Fault`]): HTTP 500, a response that never comes,
//! a slowloris body, oversize bodies (announced by `Content-Length` or only while
//! streaming), a malformed body, and a replay of an older published epoch.
//!
//! ```no_run
//! # async fn demo(master: engy_core::keys::Hotkey) -> std::io::Result<()> {
//! use engy_devnet::provider::{Fault, ProviderDouble};
//! let p = ProviderDouble::start(master, 53).await?;
//! p.publish(7, &[("5F...".to_string(), 65535)]);
//! let api = p.url(); // http://127.0.0.1:PORT, the validator's ENGY_SN53_API
//! p.set_fault(Fault::Status500);
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use engy_core::heartbeat::{verify_signed_request, SignedBy, HEARTBEAT_PATH};
use engy_core::keys::Hotkey;
use engy_core::payload::{build_result_json, sign_payload, EPOCH_LATEST_PATH, MAX_RESPONSE_BYTES};

/// How the epoch endpoint misbehaves.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Fault {
    /// Serve the current payload (or 404 when nothing is published).
    #[default]
    None,
    /// `500 Internal Server Error`.
    Status500,
    /// Accept the request and never answer.
    Hang,
    /// Send `200` and the first bytes of the payload, then one byte every `interval`, never
    /// finishing.
    Slowloris {
        /// Delay between bytes.
        interval: Duration,
    },
    /// `Content-Length` announces more than 1 MiB (the body is actually sent).
    OversizeByHeader,
    /// No `Content-Length`; a chunked body that grows past 1 MiB.
    OversizeStreaming,
    /// `200` with a body that is not JSON.
    Malformed,
    /// Serve the (still genuinely signed) payload of an older published epoch.
    Replay {
        /// The epoch to serve; it must have been published before.
        epoch: u64,
    },
    /// Serve these exact bytes with `200`.
    Raw(Vec<u8>),
}

/// One heartbeat POST as received.
#[derive(Debug, Clone)]
pub struct RecordedHeartbeat {
    /// Request headers, lowercase names.
    pub headers: BTreeMap<String, String>,
    /// The exact body bytes.
    pub body: Vec<u8>,
    /// The §6 signature check: who signed, or why it failed.
    pub verified: Result<SignedBy, String>,
}

#[derive(Default)]
struct Inner {
    /// Published payload bodies by epoch.
    published: BTreeMap<u64, String>,
    /// The epoch served when there is no fault.
    current: Option<u64>,
    fault: Fault,
    heartbeats: Vec<RecordedHeartbeat>,
    heartbeat_status: u16,
    /// Record each heartbeat, then never answer.
    heartbeat_hang: bool,
    fetches: u64,
}

struct Shared {
    master: Hotkey,
    netuid: u16,
    inner: Mutex<Inner>,
    /// `true` while epoch GETs are held ([`ProviderDouble::hold_fetches`]).
    hold: tokio::sync::watch::Sender<bool>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means a test thread panicked; the data is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running provider double; the server stops when this is dropped.
pub struct ProviderDouble {
    shared: Arc<Shared>,
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ProviderDouble {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ProviderDouble {
    /// Binds 127.0.0.1 on a free port and serves payloads signed by `master` for `netuid`.
    /// Must be called inside a tokio runtime.
    pub async fn start(master: Hotkey, netuid: u16) -> std::io::Result<ProviderDouble> {
        let shared = Arc::new(Shared {
            master,
            netuid,
            inner: Mutex::new(Inner {
                heartbeat_status: 200,
                ..Inner::default()
            }),
            hold: tokio::sync::watch::Sender::new(false),
        });
        let app = Router::new()
            .route(EPOCH_LATEST_PATH, get(epoch_latest))
            .route(HEARTBEAT_PATH, post(heartbeat))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!("provider double stopped: {e}");
            }
        });
        Ok(ProviderDouble { shared, addr, task })
    }

    /// Base URL (`http://127.0.0.1:PORT`), the validator's `ENGY_SN53_API`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The master hotkey's SS58, the validator's `ENGY_SN53_MASTER_HOTKEY`.
    pub fn master_ss58(&self) -> String {
        self.shared.master.ss58()
    }

    /// Signs and publishes `weights` as `epoch` and makes it the served epoch. Returns the
    /// body served.
    pub fn publish(&self, epoch: u64, weights: &[(String, u16)]) -> String {
        let result_json = build_result_json(self.shared.netuid, epoch, weights);
        let body = sign_payload(&self.shared.master, self.shared.netuid, epoch, &result_json);
        let mut g = self.shared.lock();
        g.published.insert(epoch, body.clone());
        g.current = Some(epoch);
        body
    }

    /// Switches the epoch endpoint's behaviour.
    pub fn set_fault(&self, fault: Fault) {
        self.shared.lock().fault = fault;
    }

    /// The status the heartbeat endpoint answers with (default 200).
    pub fn set_heartbeat_status(&self, status: u16) {
        self.shared.lock().heartbeat_status = status;
    }

    /// When `true`, the heartbeat endpoint records each POST and then never answers.
    pub fn set_heartbeat_hang(&self, hang: bool) {
        self.shared.lock().heartbeat_hang = hang;
    }

    /// When `true`, each epoch GET is counted ([`ProviderDouble::fetches`]) and then held
    /// without an answer until this is set back to `false`; it is then answered as the
    /// fault and published epoch are at that moment. A test uses it to stop a validator
    /// tick at a known point (the fetch in progress) and let it go on later.
    pub fn hold_fetches(&self, hold: bool) {
        self.shared.hold.send_replace(hold);
    }

    /// Every heartbeat POST received so far.
    pub fn heartbeats(&self) -> Vec<RecordedHeartbeat> {
        self.shared.lock().heartbeats.clone()
    }

    /// Number of epoch GETs received so far.
    pub fn fetches(&self) -> u64 {
        self.shared.lock().fetches
    }
}

fn status(code: StatusCode, text: &'static str) -> Response {
    (code, text).into_response()
}

fn json(body: Vec<u8>) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR, "build"))
}

async fn epoch_latest(State(shared): State<Arc<Shared>>) -> Response {
    shared.lock().fetches += 1;
    let mut hold = shared.hold.subscribe();
    // Err only when the sender is gone, which cannot happen while `shared` lives.
    let _ = hold.wait_for(|held| !*held).await;
    let (fault, current) = {
        let g = shared.lock();
        let current = g.current.and_then(|e| g.published.get(&e).cloned());
        let fault = g.fault.clone();
        let current = match &fault {
            Fault::Replay { epoch } => g.published.get(epoch).cloned(),
            _ => current,
        };
        (fault, current)
    };
    match fault {
        Fault::Status500 => status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "provider double: fault 500",
        ),
        Fault::Hang => {
            std::future::pending::<()>().await;
            status(StatusCode::OK, "")
        }
        Fault::Malformed => json(b"{\"v\":1,\"netuid\":53, this is not json".to_vec()),
        Fault::Raw(bytes) => json(bytes),
        Fault::OversizeByHeader => {
            let body = vec![b' '; MAX_RESPONSE_BYTES + 1];
            json(body)
        }
        Fault::OversizeStreaming => {
            let chunk = Bytes::from(vec![b' '; 64 * 1024]);
            let n = MAX_RESPONSE_BYTES / chunk.len() + 2;
            let stream = futures_util::stream::iter(
                (0..n).map(move |_| Ok::<Bytes, Infallible>(chunk.clone())),
            );
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR, "build"))
        }
        Fault::Slowloris { interval } => {
            let head = Bytes::from_static(b"{\"v\":1,");
            let stream = futures_util::stream::unfold(Some(head), move |first| async move {
                match first {
                    Some(h) => Some((Ok::<Bytes, Infallible>(h), None)),
                    None => {
                        tokio::time::sleep(interval).await;
                        Some((Ok(Bytes::from_static(b" ")), None))
                    }
                }
            });
            Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR, "build"))
        }
        Fault::None | Fault::Replay { .. } => match current {
            Some(body) => json(body.into_bytes()),
            None => status(StatusCode::NOT_FOUND, "provider double: nothing published"),
        },
    }
}

async fn heartbeat(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let map: BTreeMap<String, String> = headers
        .iter()
        .filter_map(|(k, v)| Some((k.as_str().to_ascii_lowercase(), v.to_str().ok()?.to_owned())))
        .collect();
    let verified = verify_signed_request(
        |name| map.get(&name.to_ascii_lowercase()).map(String::as_str),
        shared.netuid,
        "POST",
        HEARTBEAT_PATH,
        &body,
    )
    .map_err(|e| e.to_string());
    let (code, hang) = {
        let mut g = shared.lock();
        let code = g.heartbeat_status;
        g.heartbeats.push(RecordedHeartbeat {
            headers: map.clone(),
            body: body.to_vec(),
            verified,
        });
        (code, g.heartbeat_hang)
    };
    if hang {
        std::future::pending::<()>().await;
    }
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, "").into_response()
}
