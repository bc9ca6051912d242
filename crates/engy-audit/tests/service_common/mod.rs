//! Shared by `serve.rs` and `serve_chain.rs`: one HTTP/1.1 exchange with the service (or the
//! node's RPC), and this test process's identity (its run nonce and the miners' hotkeys derived
//! from it, so that a PostgreSQL database shared by several runs never mixes their miners).
#![allow(dead_code)]
use std::fmt::Display;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// One HTTP/1.1 exchange (`Connection: close`) with `addr` (`host:port` or a socket address):
/// (status, body, de-chunked). A body the server refuses before it is all sent is not an error:
/// its answer is read.
pub fn http(
    addr: impl ToSocketAddrs + Display,
    method: &str,
    path: &str,
    body: &[u8],
) -> (u16, String) {
    let mut s = TcpStream::connect(&addr).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {text:?}"));
    let (headers, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if headers
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_owned()
    };
    (status, body)
}

/// A chunked transfer encoding's body, joined.
fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// This test process's id and start time.
pub fn run_nonce() -> &'static str {
    static NONCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NONCE.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{}-{t}", std::process::id())
    })
}

/// A well-formed SS58 hotkey, the miner `n` of this test run.
pub fn hotkey(n: &str) -> String {
    use sha2::Digest as _;
    let key: [u8; 32] = sha2::Sha256::digest(format!("{}/{n}", run_nonce())).into();
    engy_core::keys::ss58_encode(&key)
}
