//! The frame gate: a byte stream between a leg's socket and the websocket library that
//! drops any gateway message whose first frame is over the size cap, and lets everything
//! else through unchanged (docs/SECURITY.md "gateway frames"; docs/PROTOCOL.md §2.4).
//!
//! The websocket library refuses an oversize frame by failing the whole connection, which
//! would end the leg and every request on it without a terminal frame. The gate reads
//! each frame header (RFC 6455 §5.2) itself: an oversize message is skipped without being
//! held (its payload is counted off the socket, never buffered), and its first
//! [`HEAD_BYTES`] are handed to the leg as a [`Dropped`] so it can answer the request
//! with an error `response` when the head names a `serve` and its corr_id.
//!
//! Before the first frame, the HTTP upgrade response passes through untouched (up to the
//! blank line that ends it). Writes are not touched. A message that starts under the cap
//! and grows over it in continuation frames is left to the library's message cap
//! ([`MESSAGE_CAP_FACTOR`] × the frame cap), which ends the leg.
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;

/// Bytes of a dropped message kept for the leg to read its `type` and `corr_id` from.
pub const HEAD_BYTES: usize = 4096;

/// The library's cap on a whole (fragmented) message, as a multiple of the frame cap.
pub const MESSAGE_CAP_FACTOR: usize = 4;

/// A gateway message the gate dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Its first frame's payload length in bytes.
    pub bytes: u64,
    /// The first [`HEAD_BYTES`] (or fewer) bytes of its payload.
    pub head: Vec<u8>,
}

#[derive(Debug)]
enum State {
    /// The HTTP upgrade response; `matched` bytes of `\r\n\r\n` seen.
    Handshake { matched: usize },
    /// Collecting a frame header.
    Header,
    /// Inside a frame payload: `left` bytes to go, passed or dropped.
    Payload { left: u64, drop: bool },
}

/// The gate over `S` (see the module documentation).
pub struct FrameGate<S> {
    inner: S,
    cap: u64,
    state: State,
    header: Vec<u8>,
    /// Dropping the rest of a fragmented message.
    dropping_msg: bool,
    /// Head of the message being dropped, until sent.
    head: Option<Dropped>,
    raw: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
    dropped: mpsc::UnboundedSender<Dropped>,
}

impl<S> FrameGate<S> {
    /// A gate dropping messages whose first frame exceeds `cap` bytes; each drop is sent
    /// on `dropped`.
    pub fn new(inner: S, cap: usize, dropped: mpsc::UnboundedSender<Dropped>) -> Self {
        Self {
            inner,
            cap: cap as u64,
            state: State::Handshake { matched: 0 },
            header: Vec::with_capacity(14),
            dropping_msg: false,
            head: None,
            raw: vec![0; 16 << 10],
            out: Vec::with_capacity(16 << 10),
            out_pos: 0,
            dropped,
        }
    }

    /// Header length once its first two bytes are known.
    fn header_len(h: &[u8]) -> Option<usize> {
        let b1 = *h.get(1)?;
        let ext = match b1 & 0x7f {
            126 => 2,
            127 => 8,
            _ => 0,
        };
        let mask = if b1 & 0x80 != 0 { 4 } else { 0 };
        Some(2 + ext + mask)
    }

    fn payload_len(h: &[u8]) -> u64 {
        let b1 = h.get(1).copied().unwrap_or(0);
        match b1 & 0x7f {
            126 => h
                .get(2..4)
                .map_or(0, |b| u64::from(u16::from_be_bytes([b[0], b[1]]))),
            127 => h.get(2..10).map_or(0, |b| {
                let mut a = [0u8; 8];
                a.copy_from_slice(b);
                u64::from_be_bytes(a)
            }),
            n => u64::from(n),
        }
    }

    /// Decide what a complete header means; returns whether its bytes pass.
    fn on_header(&mut self) -> bool {
        let b0 = self.header.first().copied().unwrap_or(0);
        let fin = b0 & 0x80 != 0;
        let opcode = b0 & 0x0f;
        let len = Self::payload_len(&self.header);
        let drop = if opcode >= 8 {
            false // control frames are at most 125 bytes (RFC 6455 §5.5)
        } else if opcode == 0 {
            // continuation: follows its message's fate
            let d = self.dropping_msg;
            if fin {
                self.dropping_msg = false;
            }
            d
        } else if len > self.cap {
            self.dropping_msg = !fin;
            self.head = Some(Dropped {
                bytes: len,
                head: Vec::new(),
            });
            true
        } else {
            false
        };
        self.state = State::Payload { left: len, drop };
        if len == 0 {
            self.end_payload();
        }
        !drop
    }

    fn end_payload(&mut self) {
        if let Some(d) = self.head.take() {
            let _ = self.dropped.send(d);
        }
        self.state = State::Header;
    }

    /// Run `bytes` through the state machine, appending what passes to `out`.
    fn process(&mut self, bytes: &[u8]) {
        let mut i = 0;
        while i < bytes.len() {
            match &mut self.state {
                State::Handshake { matched } => {
                    const END: &[u8; 4] = b"\r\n\r\n";
                    let b = bytes[i];
                    self.out.push(b);
                    i += 1;
                    *matched = if b == END[*matched] {
                        *matched + 1
                    } else if b == b'\r' {
                        1
                    } else {
                        0
                    };
                    if *matched == 4 {
                        self.state = State::Header;
                    }
                }
                State::Header => {
                    self.header.push(bytes[i]);
                    i += 1;
                    if Self::header_len(&self.header).is_some_and(|n| self.header.len() >= n) {
                        if self.on_header() {
                            self.out.extend_from_slice(&self.header);
                        }
                        self.header.clear();
                    }
                }
                State::Payload { left, drop } => {
                    let n = (bytes.len() - i).min(usize::try_from(*left).unwrap_or(usize::MAX));
                    let chunk = &bytes[i..i + n];
                    if *drop {
                        if let Some(d) = self.head.as_mut() {
                            let room = HEAD_BYTES.saturating_sub(d.head.len());
                            d.head.extend_from_slice(&chunk[..room.min(n)]);
                        }
                    } else {
                        self.out.extend_from_slice(chunk);
                    }
                    *left -= n as u64;
                    i += n;
                    if *left == 0 {
                        self.end_payload();
                    }
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FrameGate<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.out_pos < this.out.len() {
                let n = (this.out.len() - this.out_pos).min(buf.remaining());
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            let mut raw = std::mem::take(&mut this.raw);
            let mut rb = ReadBuf::new(&mut raw);
            let polled = Pin::new(&mut this.inner).poll_read(cx, &mut rb);
            let filled = rb.filled().len();
            match polled {
                Poll::Ready(Ok(())) if filled == 0 => {
                    this.raw = raw;
                    return Poll::Ready(Ok(())); // end of stream
                }
                Poll::Ready(Ok(())) => {
                    this.process(&raw[..filled]);
                    this.raw = raw;
                    // Everything read may have been dropped: read again rather than
                    // report an empty read (which means end of stream).
                }
                other => {
                    this.raw = raw;
                    return other;
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FrameGate<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The `corr_id` of a dropped `serve` frame, read from its head: `Some` when the head holds
/// a `"corr_id"` string without escapes and no `"type"` other than `"serve"` (only a
/// `serve` carries a payload that large; its `type` may come after the request).
pub fn dropped_serve_corr_id(head: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    let value_of = |key: &str| -> Option<String> {
        let at = text.find(&format!("\"{key}\""))? + key.len() + 2;
        let rest = text.get(at..)?.trim_start();
        let rest = rest.strip_prefix(':')?.trim_start();
        let rest = rest.strip_prefix('"')?;
        let end = rest.find('"')?;
        let v = rest.get(..end)?;
        (!v.contains('\\') && !v.is_empty() && !v.contains('\u{fffd}')).then(|| v.to_string())
    };
    if text.contains("\"type\"") && value_of("type").as_deref() != Some("serve") {
        return None;
    }
    value_of("corr_id")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn frame(opcode: u8, fin: bool, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
        match payload.len() {
            n if n < 126 => f.push(n as u8),
            n if n <= 0xffff => {
                f.push(126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        f.extend_from_slice(payload);
        f
    }

    async fn run(input: Vec<u8>, cap: usize, chunk: usize) -> (Vec<u8>, Vec<Dropped>) {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (mut w, r) = tokio::io::duplex(chunk);
        let writer = tokio::spawn(async move {
            use tokio::io::AsyncWriteExt;
            for c in input.chunks(chunk) {
                w.write_all(c).await.unwrap();
            }
        });
        let mut gate = FrameGate::new(r, cap, tx);
        let mut out = Vec::new();
        gate.read_to_end(&mut out).await.unwrap();
        writer.await.unwrap();
        let mut drops = Vec::new();
        while let Ok(d) = rx.try_recv() {
            drops.push(d);
        }
        (out, drops)
    }

    #[tokio::test]
    async fn oversize_messages_are_dropped_and_the_rest_passes() {
        let hs = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n".to_vec();
        let small = frame(1, true, br#"{"type":"ping"}"#);
        let big_payload = format!(
            r#"{{"type":"serve","corr_id":"c-9","request":{{"x":"{}"}}}}"#,
            "a".repeat(70_000)
        );
        let big = frame(1, true, big_payload.as_bytes());
        let frag = [
            frame(1, false, &[b'b'; 200]),
            frame(9, true, b"ping"),
            frame(0, true, b"tail"),
        ]
        .concat();
        let pong = frame(10, true, b"");
        let input = [
            hs.clone(),
            small.clone(),
            big,
            frag,
            small.clone(),
            pong.clone(),
        ]
        .concat();
        for chunk in [1, 7, 4096, 1 << 20] {
            let (out, drops) = run(input.clone(), 100, chunk).await;
            let want = [
                hs.clone(),
                small.clone(),
                frame(9, true, b"ping"),
                small.clone(),
                pong.clone(),
            ]
            .concat();
            assert_eq!(out, want, "chunk {chunk}");
            assert_eq!(drops.len(), 2, "chunk {chunk}");
            assert_eq!(drops[0].bytes, big_payload.len() as u64);
            assert_eq!(drops[0].head.len(), HEAD_BYTES);
            assert_eq!(
                dropped_serve_corr_id(&drops[0].head).as_deref(),
                Some("c-9")
            );
            assert_eq!(drops[1].bytes, 200);
            assert_eq!(dropped_serve_corr_id(&drops[1].head), None);
            assert_eq!(
                dropped_serve_corr_id(br#"{"corr_id":"k","request":{"#).as_deref(),
                Some("k")
            );
            assert_eq!(
                dropped_serve_corr_id(br#"{"type":"chunk","corr_id":"k"}"#),
                None
            );
        }
    }
}
