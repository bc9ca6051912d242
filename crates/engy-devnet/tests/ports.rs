//! `engy_devnet::ports::ReservedPort`, the port a test holds instead of guessing (issue 43),
//! against the kernel: what the tests that use it rely on.
use std::io::ErrorKind;
use std::net::SocketAddr;

use engy_devnet::ports::ReservedPort;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A bind of `addr` without SO_REUSEADDR, as a process that does not expect to share a
/// port binds: its error kind, `None` when it got the port.
fn plain_bind(addr: SocketAddr) -> Option<ErrorKind> {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.set_reuseaddr(false).unwrap();
    s.bind(addr).err().map(|e| e.kind())
}

#[tokio::test]
async fn a_reserved_port_refuses_connections_and_is_given_to_no_one_else() {
    let held = ReservedPort::new().unwrap();
    let addr = held.addr();
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{addr}");
    let refused = tokio::net::TcpStream::connect(addr).await.unwrap_err();
    assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "{refused}");
    assert_eq!(plain_bind(addr), Some(ErrorKind::AddrInUse));
    // The kernel's own choices (a bind of port 0, as every double and `127.0.0.1:0` daemon
    // makes) skip it.
    for _ in 0..2000 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        assert_ne!(l.local_addr().unwrap(), addr);
    }
}

/// What a daemon handed the port does (tokio's bind, as the daemons and node's libuv bind:
/// SO_REUSEADDR): it listens and answers; once it stops, the port refuses again and is still
/// held; it starts again on it.
#[tokio::test]
async fn the_process_handed_a_reserved_port_binds_it_across_restarts() {
    let held = ReservedPort::new().unwrap();
    let addr = held.addr();
    for run in 0..2u8 {
        let daemon = tokio::net::TcpListener::bind(addr).await.unwrap();
        let serve = tokio::spawn(async move {
            let (mut c, _) = daemon.accept().await.unwrap();
            c.write_all(&[run]).await.unwrap();
        });
        let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut got = [0u8; 1];
        c.read_exact(&mut got).await.unwrap();
        assert_eq!(got, [run]);
        serve.await.unwrap();
        let refused = tokio::net::TcpStream::connect(addr).await.unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused, "run {run}");
        assert_eq!(plain_bind(addr), Some(ErrorKind::AddrInUse), "run {run}");
    }
    // Listening on the held socket itself: no moment without an owner.
    let listener = held.listen().unwrap();
    assert_eq!(listener.local_addr().unwrap(), addr);
}
