//! Opening a leg's websocket: the only socket I/O of the gateway side.
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_tungstenite::MaybeTlsStream;

use super::gate::{self, FrameGate};

pub(crate) type Ws =
    tokio_tungstenite::WebSocketStream<FrameGate<MaybeTlsStream<tokio::net::TcpStream>>>;
pub(crate) type WsError = tokio_tungstenite::tungstenite::Error;

/// Largest gateway frame a leg takes: a `serve` frame carries one chat request, far below
/// this. A larger message is dropped by the [`FrameGate`] (the leg stays up); a fragmented
/// message over [`gate::MESSAGE_CAP_FACTOR`] × this ends the leg.
pub const GW_MAX_FRAME: usize = 16 << 20;

/// Open a leg's websocket: TCP with TCP_NODELAY (a `chunk` frame must not wait for the
/// gateway's delayed ACK of the previous one: Nagle adds up to 40 ms per frame), TLS for
/// `wss://` (rustls, webpki roots), and the [`FrameGate`] under the websocket library.
/// Oversize messages the gate drops are reported on the returned receiver.
pub(crate) async fn dial(
    url: &str,
) -> Result<(Ws, mpsc::UnboundedReceiver<gate::Dropped>), WsError> {
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
pub(crate) fn tls_config() -> Result<Arc<rustls::ClientConfig>, WsError> {
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
