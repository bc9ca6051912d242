//! Routing and indexer traces of one request (docs/PROTOCOL.md §3.10): what to ask each
//! `/generate` call, and the stitching of the calls' answers into one trace over positions
//! `[0, prompt + output − 1)` in the compact form of [`engy_core::trace`].
//!
//! sglang answers a call over `input_ids` (n tokens) that generated m tokens with the rows
//! of positions `[start, n + m − 1)`: the last sampled token had no forward pass
//! (`python/sglang/srt/state_capturer/base.py`, `get_topk`). For `routed_experts`, `start`
//! is the request's `routed_experts_start_len`; for `indexer_topk` it is always 0. A
//! continuation (§3.4) sends the prompt and the output so far minus its last token, so its
//! input length is exactly the number of positions the earlier calls covered: routing asks
//! `routed_experts_start_len` = that number and keeps every row; the indexer's rows before
//! it are dropped. Rows of a radix-cache hit are what sglang recorded when the cache entry
//! was computed; they are kept as sent.
//!
//! Nothing here ever fails a request: a trace that cannot be stitched is dropped
//! ([`Dropped`]) and the commitment goes out without it.
use std::path::Path;

use engy_core::trace::{sglang_int32, Trace};
use serde_json::Value;

use crate::scan::TraceText;

/// `layers × width` ids per token position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Layers per row.
    pub layers: u64,
    /// Ids per layer.
    pub width: u64,
}

impl Shape {
    /// Bytes sglang sends for `rows` rows: base64 of int32, plus the key.
    pub fn reply_bytes(&self, rows: u64) -> u64 {
        rows.saturating_mul(self.layers)
            .saturating_mul(self.width)
            .saturating_mul(4)
            .div_ceil(3)
            .saturating_mul(4)
            .saturating_add(64)
    }
}

/// The traces this miner collects, from the settings and the checkpoint's `config.json`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceShapes {
    /// MoE routing: `num_hidden_layers × num_experts_per_tok`; `None` = not collected.
    pub routing: Option<Shape>,
    /// DSA indexer: `num_indexer_layers` (else `num_hidden_layers`) × `index_topk`.
    pub indexer: Option<Shape>,
}

impl TraceShapes {
    /// The shapes `config.json` (top level, else `text_config`) declares: routing when it
    /// has `num_hidden_layers`, `num_experts_per_tok` and an expert count (`num_experts`,
    /// `n_routed_experts` or `num_local_experts`); the indexer when it has `index_topk`.
    pub fn from_config(v: &Value) -> Self {
        let field = |k: &str| {
            v.get(k)
                .or_else(|| v.get("text_config").and_then(|t| t.get(k)))
                .and_then(Value::as_u64)
                .filter(|x| *x > 0)
        };
        let layers = field("num_hidden_layers");
        let experts = field("num_experts")
            .or_else(|| field("n_routed_experts"))
            .or_else(|| field("num_local_experts"));
        let routing = match (layers, field("num_experts_per_tok"), experts) {
            (Some(layers), Some(width), Some(_)) => Some(Shape { layers, width }),
            _ => None,
        };
        let indexer = match (field("num_indexer_layers").or(layers), field("index_topk")) {
            (Some(layers), Some(width)) => Some(Shape { layers, width }),
            _ => None,
        };
        Self { routing, indexer }
    }

    /// [`TraceShapes::from_config`] of `<checkpoint>/config.json`, kept only where the
    /// setting is on; nothing when the file cannot be read (start-up already refused such
    /// a checkpoint).
    pub fn from_checkpoint(dir: &Path, routing: bool, indexer: bool) -> Self {
        let v: Value = std::fs::read(dir.join("config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null);
        let s = Self::from_config(&v);
        Self {
            routing: s.routing.filter(|_| routing),
            indexer: s.indexer.filter(|_| indexer),
        }
    }
}

/// Which trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `routed_experts` → `commitment.routing`.
    Routing,
    /// `indexer_topk` → `commitment.indexer_topk`.
    Indexer,
}

impl Kind {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Kind::Routing => "routing",
            Kind::Indexer => "indexer",
        }
    }

    /// sglang's `meta_info` key.
    pub fn field(self) -> &'static str {
        match self {
            Kind::Routing => "routed_experts",
            Kind::Indexer => "indexer_topk",
        }
    }
}

/// Why a request's commitment has no trace of a kind the miner collects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// The serve did not say it offers it (started without the flag, or its server info
    /// was unreadable): not asked.
    NotOffered,
    /// Asked, but a reply had no such field.
    Missing,
    /// A field that is not a string, not base64, not whole rows, or a negative expert id.
    Malformed(String),
    /// A call's rows do not cover the positions they must.
    Rows(String),
}

impl Dropped {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Dropped::NotOffered => "not_offered",
            Dropped::Missing => "missing",
            Dropped::Malformed(_) => "malformed",
            Dropped::Rows(_) => "rows",
        }
    }
}

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dropped::NotOffered => f.write_str("the serve does not offer it"),
            Dropped::Missing => f.write_str("the serve's reply has no such field"),
            Dropped::Malformed(e) => write!(f, "malformed field: {e}"),
            Dropped::Rows(e) => write!(f, "rows do not line up: {e}"),
        }
    }
}

/// One kind of trace across the calls of a chunked generation.
#[derive(Debug)]
pub struct TraceAcc {
    kind: Kind,
    shape: Shape,
    /// sglang's int32 ids of positions `[0, rows)`.
    ids: Vec<i32>,
    rows: u64,
    dropped: Option<Dropped>,
}

impl TraceAcc {
    /// A trace to collect; `offered` = the serve said it offers it.
    pub fn new(kind: Kind, shape: Shape, offered: bool) -> Self {
        Self {
            kind,
            shape,
            ids: Vec::new(),
            rows: 0,
            dropped: (!offered).then_some(Dropped::NotOffered),
        }
    }

    /// Which trace.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Whether the next call asks for it (nothing went wrong so far).
    pub fn asking(&self) -> bool {
        self.dropped.is_none()
    }

    /// Positions covered so far: the next call's first new position, which is
    /// `routed_experts_start_len` for routing.
    pub fn covered(&self) -> u64 {
        self.rows
    }

    /// Bytes the serve's field may take in a call of `n_input` tokens and up to `max_new`
    /// more (added to the reply cap).
    pub fn reply_bytes(&self, n_input: u64, max_new: u64) -> u64 {
        let from = match self.kind {
            Kind::Routing => self.rows.min(n_input),
            Kind::Indexer => 0,
        };
        self.shape
            .reply_bytes(n_input.saturating_add(max_new).saturating_sub(from))
    }

    /// Take one call's field: the call sent `n_input` tokens (asking from position
    /// [`TraceAcc::covered`]) and returned `n_out` output tokens. A problem drops the trace.
    pub fn add_call(&mut self, field: Option<TraceText>, n_input: u64, n_out: u64) {
        if self.dropped.is_some() {
            return;
        }
        if let Err(d) = self.take(field, n_input, n_out) {
            self.ids = Vec::new();
            self.dropped = Some(d);
        }
    }

    fn take(&mut self, field: Option<TraceText>, n_input: u64, n_out: u64) -> Result<(), Dropped> {
        let text = match field {
            None => return Err(Dropped::Missing),
            Some(TraceText::NotText) => {
                return Err(Dropped::Malformed("the value is not a string".into()))
            }
            Some(TraceText::Text(t)) => t,
        };
        let ids = sglang_int32(&text, self.shape.layers, self.shape.width)
            .map_err(|e| Dropped::Malformed(e.to_string()))?;
        let got = ids.len() as u64 / (self.shape.layers * self.shape.width);
        let start = match self.kind {
            Kind::Routing => self.rows,
            Kind::Indexer => 0,
        };
        let end = (n_input + n_out).saturating_sub(1);
        if self.rows > n_input || end < self.rows {
            return Err(Dropped::Rows(format!(
                "a call over {n_input} tokens with {n_out} new ones cannot continue a trace of {} positions",
                self.rows
            )));
        }
        if got != end - start {
            return Err(Dropped::Rows(format!(
                "{got} rows for positions [{start}, {end}) of a call over {n_input} tokens with {n_out} new ones"
            )));
        }
        let per_row = (self.shape.layers * self.shape.width) as usize;
        let skip = ((self.rows - start) as usize).saturating_mul(per_row);
        self.ids
            .extend_from_slice(ids.get(skip..).unwrap_or_default());
        self.rows = end;
        Ok(())
    }

    /// The compact trace over `[0, positions)` (= prompt with `prompt_extra`, plus output
    /// tokens, minus one), or why there is none.
    ///
    /// # Errors
    /// The [`Dropped`] reason.
    pub fn finish(self, positions: u64) -> Result<Trace, Dropped> {
        if let Some(d) = self.dropped {
            return Err(d);
        }
        if self.rows != positions {
            return Err(Dropped::Rows(format!(
                "{} positions stitched, the request has {positions}",
                self.rows
            )));
        }
        Trace::encode(
            0,
            self.shape.layers,
            self.shape.width,
            &self.ids,
            self.kind == Kind::Indexer,
        )
        .map_err(|e| Dropped::Malformed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engy_core::trace::sglang_int32_base64;
    use serde_json::json;

    const SHAPE: Shape = Shape {
        layers: 2,
        width: 2,
    };

    fn rows(from: u64, to: u64) -> Vec<i32> {
        (from..to)
            .flat_map(|p| (0..4).map(move |j| ((p * 4 + j) % 256) as i32))
            .collect()
    }

    fn text(v: &[i32]) -> Option<TraceText> {
        Some(TraceText::Text(sglang_int32_base64(v)))
    }

    #[test]
    fn routing_chunks_stitch_with_start_len() {
        // Prompt 5, chunk 3: call 1 → positions [0, 7); call 2 over 7 tokens with 3 new
        // (the overlap token first) → [7, 9).
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        assert_eq!(acc.covered(), 0);
        acc.add_call(text(&rows(0, 7)), 5, 3);
        assert_eq!(acc.covered(), 7);
        acc.add_call(text(&rows(7, 9)), 7, 3);
        let t = acc.finish(9).unwrap();
        assert_eq!(t.decode().unwrap().ids, rows(0, 9));
        assert!(!t.padded);
    }

    #[test]
    fn indexer_chunks_drop_rows_already_kept() {
        let mut acc = TraceAcc::new(Kind::Indexer, SHAPE, true);
        acc.add_call(text(&rows(0, 7)), 5, 3);
        acc.add_call(text(&rows(0, 9)), 7, 3);
        let t = acc.finish(9).unwrap();
        assert!(t.padded);
        assert_eq!(t.decode().unwrap().ids, rows(0, 9));
    }

    #[test]
    fn problems_drop_the_trace_with_a_reason() {
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        acc.add_call(text(&rows(0, 6)), 5, 3);
        assert!(!acc.asking());
        assert!(matches!(acc.finish(7), Err(Dropped::Rows(_))));
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        acc.add_call(None, 5, 3);
        assert_eq!(acc.finish(7), Err(Dropped::Missing));
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        acc.add_call(Some(TraceText::Text("%%".into())), 5, 3);
        assert!(matches!(acc.finish(7), Err(Dropped::Malformed(_))));
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        acc.add_call(Some(TraceText::NotText), 5, 3);
        assert!(matches!(acc.finish(7), Err(Dropped::Malformed(_))));
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        let mut neg = rows(0, 7);
        neg[3] = -1;
        acc.add_call(text(&neg), 5, 3);
        assert!(matches!(acc.finish(7), Err(Dropped::Malformed(_))));
        let acc = TraceAcc::new(Kind::Routing, SHAPE, false);
        assert!(!acc.asking());
        assert_eq!(acc.finish(7), Err(Dropped::NotOffered));
        // A stitched trace shorter than the request (a call was not fed).
        let mut acc = TraceAcc::new(Kind::Routing, SHAPE, true);
        acc.add_call(text(&rows(0, 7)), 5, 3);
        assert!(matches!(acc.finish(9), Err(Dropped::Rows(_))));
    }

    #[test]
    fn shapes_come_from_config_json() {
        let qwen = json!({"text_config": {"num_hidden_layers": 40, "num_experts": 256, "num_experts_per_tok": 8}});
        assert_eq!(
            TraceShapes::from_config(&qwen),
            TraceShapes {
                routing: Some(Shape {
                    layers: 40,
                    width: 8
                }),
                indexer: None
            }
        );
        let glm = json!({"num_hidden_layers": 78, "n_routed_experts": 256, "num_experts_per_tok": 8, "index_topk": 2048});
        let s = TraceShapes::from_config(&glm);
        assert_eq!(
            s.indexer,
            Some(Shape {
                layers: 78,
                width: 2048
            })
        );
        assert!(s.routing.is_some());
        let dense = json!({"num_hidden_layers": 28, "hidden_size": 1024});
        assert_eq!(TraceShapes::from_config(&dense), TraceShapes::default());
    }
}
