//! Ports for tests that are never guessed (issue 43): a port bound and then let go ("a free
//! port") can be handed to another process before the test uses it, so a daemon under test
//! fails to bind, or a "dead" address answers. [`ReservedPort`] keeps the port bound for as
//! long as it lives.
//!
//! What Linux does with a TCP socket that is bound and never listens (the rules the tests
//! rely on; `inet_csk_get_port`, `__inet_hash_connect`):
//! * a connection to it is refused (RST: `ECONNREFUSED`), as to a stopped process;
//! * the kernel never gives the port to another socket's bind of port 0 nor to an outgoing
//!   connection's source port;
//! * another socket that sets `SO_REUSEADDR` (tokio's and std's `TcpListener::bind`, node's
//!   libuv, so the daemons under test and the chopsticks chain) may bind it and listen, and
//!   may do so again after it stopped: the port is reserved for the process the test hands it
//!   to, across restarts. A bind without `SO_REUSEADDR` fails with `EADDRINUSE`.
//!
//! A daemon the test starts in-process or that reports its bound address needs none of this:
//! bind port 0 and read the address back (the doubles' `url()`, the daemons' `metrics at
//! http://…` log line).
use std::net::SocketAddr;

/// A 127.0.0.1 port bound (`SO_REUSEADDR`) and not listening, held while this value lives.
/// Use [`ReservedPort::addr`] as an address that refuses connections, or hand
/// [`ReservedPort::port`] to a process that cannot bind port 0 and report it (see the module
/// doc for what may then bind it).
pub struct ReservedPort {
    socket: tokio::net::TcpSocket,
    addr: SocketAddr,
}

impl ReservedPort {
    /// A port of 127.0.0.1 the kernel picks.
    ///
    /// # Errors
    /// The socket or bind error.
    pub fn new() -> std::io::Result<Self> {
        Self::at(SocketAddr::from(([127, 0, 0, 1], 0)))
    }

    /// `addr` itself (one this process just stopped listening on, so it stays held).
    ///
    /// # Errors
    /// The socket or bind error (`EADDRINUSE` while a socket listens on `addr`).
    pub fn at(addr: SocketAddr) -> std::io::Result<Self> {
        let socket = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        // As a listener's bind sets it: TIME_WAIT connections of a listener just stopped on
        // `addr` do not block the bind, and the process the port is handed to can bind it.
        socket.set_reuseaddr(true)?;
        socket.bind(addr)?;
        let addr = socket.local_addr()?;
        Ok(Self { socket, addr })
    }

    /// The held address, `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The held port.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Starts listening on the held port itself (what a restarted in-process server does),
    /// with no moment in which the port is free.
    ///
    /// # Errors
    /// The listen error (another socket already listens there). Needs a tokio runtime.
    pub fn listen(self) -> std::io::Result<tokio::net::TcpListener> {
        self.socket.listen(1024)
    }
}
