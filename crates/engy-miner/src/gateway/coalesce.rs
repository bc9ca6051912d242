//! Streamed text → `chunk` frames (docs/PROTOCOL.md §3.6).
use std::sync::Arc;
use std::time::{Duration, Instant};

use engy_core::wire;
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::Message;

use crate::job::Job;
use crate::serve::StreamEvent;

/// Coalesces streamed deltas into at most one `chunk` frame per flush window per
/// `/generate` call, the first delta included, and flushes at the end of each call
/// (docs/PROTOCOL.md §3.6, as the production miner).
pub(crate) struct Coalescer {
    pub(crate) job: Arc<Job>,
    pub(crate) tx: mpsc::UnboundedSender<Message>,
    pub(crate) corr_id: String,
    pub(crate) pending: String,
    pub(crate) window_start: Instant,
    pub(crate) window: Duration,
}

impl Coalescer {
    pub(crate) fn on(&mut self, ev: StreamEvent<'_>) {
        match ev {
            StreamEvent::CallStart => self.window_start = Instant::now(),
            StreamEvent::Delta(d) => {
                self.pending.push_str(d);
                self.flush_if_due();
            }
            StreamEvent::Tick => self.flush_if_due(),
            StreamEvent::CallEnd => self.flush(),
        }
    }

    pub(crate) fn flush_if_due(&mut self) {
        if self.window_start.elapsed() >= self.window {
            self.flush();
        }
    }

    pub(crate) fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let frame = wire::MinerFrame::Chunk(wire::Chunk {
            corr_id: self.corr_id.clone(),
            delta: wire::Delta {
                content: std::mem::take(&mut self.pending),
            },
        })
        .to_text();
        self.window_start = Instant::now();
        let tx = &self.tx;
        self.job.if_live(|| tx.send(Message::Text(frame.into())));
    }
}
