//! The provider API client (PROTOCOL.md §6): fetch the latest epoch payload (30 s timeout,
//! 1 MiB cap by `Content-Length` and while streaming) and the best-effort heartbeat POST.

use std::time::Duration;

use futures_util::StreamExt;

/// Timeout of the epoch fetch.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of the heartbeat POST.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// Body cap of the epoch fetch (PROTOCOL.md §6).
pub const MAX_BODY: usize = engy_core::payload::MAX_RESPONSE_BYTES;

/// Why a fetch produced no body.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// Connection, TLS or timeout failure.
    #[error("request failed: {0}")]
    Transport(String),
    /// Non-200 status.
    #[error("HTTP {0}")]
    Status(u16),
    /// The body is (or announces to be) larger than [`MAX_BODY`].
    #[error("body larger than {MAX_BODY} bytes ({0})")]
    TooLarge(String),
}

/// Describes a transport failure with its whole cause chain (reqwest's own text is only
/// "error sending request"; the cause says connection refused, DNS failure, TLS, ...).
/// The URL is stripped; a cause already contained in the text so far is not repeated.
pub fn transport_error(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// An HTTP client for the provider (rustls, no cookies, no proxies from env surprises).
pub fn client() -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .user_agent(concat!("engy-validator/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(10))
        .build()
}

/// GETs `{api}/api/subnet/v1/epoch/latest` and returns the raw body (≤ 1 MiB), within
/// [`FETCH_TIMEOUT`].
pub async fn fetch_latest(http: &reqwest::Client, api: &str) -> Result<Vec<u8>, FetchError> {
    fetch_latest_within(http, api, FETCH_TIMEOUT).await
}

/// [`fetch_latest`] with an explicit overall timeout (connect + headers + whole body).
pub async fn fetch_latest_within(
    http: &reqwest::Client,
    api: &str,
    limit: Duration,
) -> Result<Vec<u8>, FetchError> {
    let url = format!("{api}{}", engy_core::payload::EPOCH_LATEST_PATH);
    let work = async {
        let resp = http
            .get(&url)
            .send()
            .await
            .map_err(|e| FetchError::Transport(transport_error(e)))?;
        if resp.status() != reqwest::StatusCode::OK {
            return Err(FetchError::Status(resp.status().as_u16()));
        }
        if let Some(len) = resp.content_length() {
            if len > MAX_BODY as u64 {
                return Err(FetchError::TooLarge(format!("Content-Length {len}")));
            }
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| FetchError::Transport(transport_error(e)))?;
            if body.len() + chunk.len() > MAX_BODY {
                return Err(FetchError::TooLarge("while streaming".into()));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    match tokio::time::timeout(limit, work).await {
        Ok(r) => r,
        Err(_) => Err(FetchError::Transport(format!(
            "timed out after {} ms",
            limit.as_millis()
        ))),
    }
}

/// POSTs the signed heartbeat (PROTOCOL.md §6). Best effort: returns a description of the
/// outcome for the log; never fails the tick.
pub async fn post_heartbeat(
    http: &reqwest::Client,
    api: &str,
    netuid: u16,
    hotkey: &engy_core::keys::Hotkey,
    synced_epoch: Option<u64>,
    digest: Option<&str>,
    now: u64,
) -> Result<(), String> {
    use engy_core::heartbeat::{build_body, signed_headers, HEARTBEAT_PATH};
    let version = concat!("engy-lv ", env!("CARGO_PKG_VERSION"));
    let body = build_body(version, synced_epoch, digest);
    let mut req = http
        .post(format!("{api}{HEARTBEAT_PATH}"))
        .timeout(HEARTBEAT_TIMEOUT);
    for (name, value) in signed_headers(hotkey, netuid, HEARTBEAT_PATH, now, body.as_bytes()) {
        req = req.header(name, value);
    }
    match req.body(body).send().await {
        Ok(r) if r.status() == reqwest::StatusCode::OK => Ok(()),
        Ok(r) => Err(format!("HTTP {}", r.status().as_u16())),
        Err(e) => Err(transport_error(e)),
    }
}
