//! The SSE event reader (sglang-native-api.md §2.7): `data:` lines, one JSON value each.
use super::cursor::Cur;
use super::{scan_one, HiddenMode, Reply, ReplySource, RowSink, ScanError};

/// Reads an sglang SSE stream (§2.7: `data: <json>\n\n` events, then `data: [DONE]`) one
/// event at a time as the bytes arrive, each event through the same single-pass scanner.
pub struct SseReader<S> {
    cur: Cur<S>,
    cap: usize,
}

impl<S: ReplySource> SseReader<S> {
    /// A reader over `src`; `cap` bounds each event's length in bytes: from the start of
    /// its `data:` line to the end of its JSON value.
    pub fn new(src: S, cap: usize) -> Self {
        let mut cur = Cur::new(src, cap);
        cur.line_mode = true;
        Self { cur, cap }
    }

    /// The source (e.g. to reach state it carries between events).
    pub fn source_mut(&mut self) -> &mut S {
        &mut self.cur.src
    }

    /// The next `data:` event; `Ok(None)` after `data: [DONE]` or at the end of the stream.
    /// Lines other than `data:` lines are skipped.
    ///
    /// # Errors
    /// [`ScanError`] as [`scan_reply_from`]; an event longer than the cap is
    /// [`ScanError::TooLarge`].
    pub async fn next_event(
        &mut self,
        hidden: HiddenMode,
        want_text: bool,
        sink: &mut dyn RowSink,
    ) -> Result<Option<Reply>, ScanError> {
        let c = &mut self.cur;
        loop {
            c.limit = (c.base + c.i).saturating_add(self.cap);
            // Start of a line.
            if c.avail() < 6 {
                c.fill_to(6).await?;
            }
            if c.avail() == 0 {
                return Ok(None);
            }
            if c.rest().starts_with(b"data:") {
                c.i += 5;
                if c.peek().await? == Some(b' ') {
                    c.i += 1;
                }
                c.fill_to(7).await?;
                if c.rest().starts_with(b"[DONE]") {
                    return Ok(None);
                }
                match c.peek().await? {
                    Some(b'{' | b'[') => {
                        c.abandoned = false;
                        let r = scan_one(c, hidden, want_text, sink).await?;
                        // Anything but blanks after the value makes the event unparsable
                        // JSON (as json.loads sees it): refused, never half used. An
                        // intermediate event is not read to its end (its hidden states are
                        // not needed): its line must at least end where an object ends.
                        if c.abandoned {
                            c.skip_line_ending_in_close().await?;
                        } else {
                            c.within_limit(c.pos())?;
                            c.end_of_line().await?;
                        }
                        return Ok(Some(r));
                    }
                    _ => c.skip_line().await?,
                }
            } else {
                c.skip_line().await?;
            }
        }
    }
}
