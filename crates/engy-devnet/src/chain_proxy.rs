//! A websocket JSON-RPC proxy in front of a real subtensor node (chopsticks in the tests)
//! that can refuse the next extrinsic submission the way a node's transaction pool does.
//!
//! Everything is forwarded both ways unchanged, except: once armed with
//! [`ChainProxy::reject_next_submit`], the next `author_submitAndWatchExtrinsic` /
//! `author_submitExtrinsic` request is not forwarded and is answered with a JSON-RPC error
//! shaped as Substrate's author RPC answers a pool rejection (sc-rpc-api `author::error`:
//! code 1010, message `Invalid Transaction`, data = the `InvalidTransaction`'s text, e.g.
//! `Transaction has an ancient birth block`). It models a node of a load-balanced endpoint
//! that has not seen the extrinsic's birth block yet, or one that saw its nonce used: the
//! next submission reaches the real node again.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

/// The `data` of a pool rejection for an ancient birth block (sp-runtime
/// `InvalidTransaction::AncientBirthBlock`'s text).
pub const ANCIENT_BIRTH_BLOCK: &str = "Transaction has an ancient birth block";
/// The `data` of a pool rejection for a used nonce (`InvalidTransaction::Stale`).
pub const OUTDATED: &str = "Transaction is outdated";

#[derive(Default)]
struct Shared {
    /// The node new connections go to.
    upstream: Mutex<String>,
    /// The `data` text of the armed rejection.
    armed: Mutex<Option<String>>,
    submits: AtomicU64,
    rejected: AtomicU64,
}

/// A running proxy; it stops accepting when dropped.
pub struct ChainProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ChainProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ChainProxy {
    /// Listens on 127.0.0.1 (a free port) and forwards every connection to `upstream`
    /// (`ws://…`), one upstream connection per client connection.
    pub async fn start(upstream: &str) -> std::io::Result<ChainProxy> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream.to_owned()),
            ..Shared::default()
        });
        let s = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let s = Arc::clone(&s);
                let upstream = match s.upstream.lock() {
                    Ok(u) => u.clone(),
                    Err(_) => break,
                };
                tokio::spawn(async move {
                    if let Err(e) = pump(tcp, &upstream, s).await {
                        tracing::debug!("chain proxy connection ended: {e}");
                    }
                });
            }
        });
        Ok(ChainProxy { addr, shared, task })
    }

    /// The proxy's `ws://127.0.0.1:PORT` URL.
    pub fn url(&self) -> String {
        format!("ws://{}", self.addr)
    }

    /// Refuses the next submission with a 1010 pool rejection whose data is `data`
    /// ([`ANCIENT_BIRTH_BLOCK`], [`OUTDATED`]).
    pub fn reject_next_submit(&self, data: &str) {
        if let Ok(mut a) = self.shared.armed.lock() {
            *a = Some(data.to_owned());
        }
    }

    /// Sends connections opened from now on to `upstream` (open ones stay where they are):
    /// a client that reconnects sees the other node, e.g. another runtime.
    pub fn set_upstream(&self, upstream: &str) {
        if let Ok(mut u) = self.shared.upstream.lock() {
            *u = upstream.to_owned();
        }
    }

    /// Submissions seen so far (refused ones included).
    pub fn submits(&self) -> u64 {
        self.shared.submits.load(Ordering::SeqCst)
    }

    /// Submissions refused so far.
    pub fn rejected(&self) -> u64 {
        self.shared.rejected.load(Ordering::SeqCst)
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn pump(tcp: tokio::net::TcpStream, upstream: &str, s: Arc<Shared>) -> Result<(), BoxError> {
    let client = tokio_tungstenite::accept_async(tcp).await?;
    let (node, _) = tokio_tungstenite::connect_async(upstream).await?;
    let (mut client_tx, mut client_rx) = client.split();
    let (mut node_tx, mut node_rx) = node.split();
    let (reply_tx, mut reply_rx) = tokio::sync::mpsc::unbounded_channel::<Message>();
    let down = async {
        loop {
            let msg = tokio::select! {
                m = node_rx.next() => match m { Some(Ok(m)) => m, _ => break },
                r = reply_rx.recv() => match r { Some(m) => m, None => break },
            };
            if client_tx.send(msg).await.is_err() {
                break;
            }
        }
        let _ = client_tx.close().await;
    };
    let up = async {
        while let Some(Ok(msg)) = client_rx.next().await {
            if let Message::Text(text) = &msg {
                if let Some(reply) = intercept(text.as_str(), &s) {
                    let _ = reply_tx.send(Message::text(reply));
                    continue;
                }
            }
            if node_tx.send(msg).await.is_err() {
                break;
            }
        }
        let _ = node_tx.close().await;
    };
    tokio::join!(down, up);
    Ok(())
}

/// The rejection to answer instead of forwarding `text`, when it is a submission and the
/// proxy is armed.
fn intercept(text: &str, s: &Shared) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let method = v.get("method")?.as_str()?;
    if !matches!(
        method,
        "author_submitAndWatchExtrinsic" | "author_submitExtrinsic"
    ) {
        return None;
    }
    s.submits.fetch_add(1, Ordering::SeqCst);
    let data = s.armed.lock().ok()?.take()?;
    s.rejected.fetch_add(1, Ordering::SeqCst);
    Some(
        serde_json::json!({
            "jsonrpc": "2.0",
            "id": v.get("id").cloned().unwrap_or(serde_json::Value::Null),
            "error": {"code": 1010, "message": "Invalid Transaction", "data": data},
        })
        .to_string(),
    )
}
