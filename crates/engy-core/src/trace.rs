//! Compact per-token traces a commitment may carry (docs/PROTOCOL.md §3.10): the MoE
//! routing (`commitment.routing`) and the DSA indexer's top-k (`commitment.indexer_topk`)
//! that a stock sglang serve returns, in a form several times smaller than sglang's.
//!
//! # What sglang returns (the input)
//! `meta_info["routed_experts"]` (and `meta_info["indexer_topk"]`): standard base64 of
//! little-endian `int32`, row-major `[rows, layers, width]`:
//! * routing: `layers = num_hidden_layers` (dense layers' rows are 0), `width =
//!   num_experts_per_tok`, logical expert ids in `[0, num_experts)`
//!   (`python/sglang/srt/state_capturer/routed_experts.py`, `base.py`);
//! * indexer top-k: `layers` = the indexer layers (`num_hidden_layers` for DSA models),
//!   `width = index_topk`, key positions, `-1` in the slots of a position that has fewer
//!   than `index_topk` keys (`python/sglang/srt/layers/attention/nsa/topk.py`,
//!   `_fast_topk_torch`: `masked_fill(mask, -1)`).
//!
//! [`sglang_int32`] reads that form; [`sglang_int32_base64`] writes it (the serve double).
//!
//! # The compact form ([`Trace`], the commitment's JSON)
//! ```json
//! {"start": 0, "rows": R, "layers": L, "width": K, "id_bytes": 1,
//!  "ids": "<base64>", "sha256": "<64 hex>"}
//! ```
//! plus `"padded": true` for a trace with unused slots (absent = false):
//! * `start`: the first token position covered; row `r` is position `start + r`;
//! * `rows`, `layers`, `width`: the shape;
//! * `id_bytes`: 1, 2 or 4, the smallest width that holds every stored value (u8 for up
//!   to 256 experts);
//! * `ids`: standard base64 (RFC 4648, with `=` padding) of the stored values as
//!   little-endian unsigned integers of `id_bytes` bytes, row-major `[rows, layers, width]`;
//! * `padded`: when true every stored value is the id + 1 and 0 is an unused slot
//!   (sglang's `-1`); when false (routing) the stored value is the id and no id is negative;
//! * `sha256`: lowercase hex SHA-256 of the bytes `ids` decodes to.
//!
//! [`Trace::decode`] checks every field and returns the ids as sglang's `int32` (with `-1`
//! restored in unused slots), [`Decoded`].
use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// A compact trace: ids of `rows × layers × width` slots from token position `start` on
/// (the module doc gives the encoding).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// First token position covered.
    pub start: u64,
    /// Token positions covered (`start .. start + rows`).
    pub rows: u64,
    /// Layers per row.
    pub layers: u64,
    /// Ids per (row, layer): top-k experts, or index top-k keys.
    pub width: u64,
    /// Bytes per stored value: 1, 2 or 4.
    pub id_bytes: u8,
    /// Stored values are id + 1 and 0 marks an unused slot (sglang's `-1`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub padded: bool,
    /// base64 of the stored values, little-endian, row-major `[rows, layers, width]`.
    pub ids: String,
    /// Lowercase hex SHA-256 of the decoded `ids` bytes.
    pub sha256: String,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a trace (or sglang's int32 form) cannot be read or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// `ids` (or sglang's field) is not standard base64.
    #[error("ids are not base64: {0}")]
    Base64(String),
    /// `id_bytes` other than 1, 2 or 4.
    #[error("id_bytes is {0}; it must be 1, 2 or 4")]
    IdBytes(u8),
    /// A zero `layers` or `width`, or a shape whose size overflows.
    #[error("bad shape: {0}")]
    Shape(String),
    /// The decoded bytes do not hold `rows × layers × width` values.
    #[error("ids decode to {got} bytes, the shape needs {expected}")]
    Length {
        /// Bytes decoded.
        got: u64,
        /// Bytes the shape needs.
        expected: u64,
    },
    /// `sha256` differs from the digest of the decoded bytes (or is not 64 hex digits).
    #[error("sha256 mismatch: the trace says {stated}, its ids hash to {actual}")]
    Digest {
        /// The `sha256` field.
        stated: String,
        /// SHA-256 of the decoded bytes.
        actual: String,
    },
    /// A stored value that is no `int32` id (above `i32::MAX`, after the padding shift).
    #[error("id {value} at slot {index} is too large for an int32 id")]
    IdTooLarge {
        /// Flat slot index.
        index: u64,
        /// The stored value.
        value: u64,
    },
    /// A negative id where none is allowed (routing), or below `-1` (padded traces).
    #[error("negative id {value} at slot {index}")]
    NegativeId {
        /// Flat slot index.
        index: u64,
        /// The id.
        value: i64,
    },
}

/// A decoded trace: sglang's `int32` ids, row-major `[rows, layers, width]`, `-1` in the
/// unused slots of a padded trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// First token position covered.
    pub start: u64,
    /// Token positions covered.
    pub rows: usize,
    /// Layers per row.
    pub layers: usize,
    /// Ids per (row, layer).
    pub width: usize,
    /// `rows × layers × width` ids.
    pub ids: Vec<i32>,
}

impl Decoded {
    /// The ids of token position `position` at `layer`, `width` of them; `None` outside
    /// the trace.
    pub fn at(&self, position: u64, layer: usize) -> Option<&[i32]> {
        let row = usize::try_from(position.checked_sub(self.start)?).ok()?;
        if row >= self.rows || layer >= self.layers {
            return None;
        }
        let i = (row * self.layers + layer) * self.width;
        self.ids.get(i..i + self.width)
    }
}

/// Slots of one row (`layers × width`), refusing zero and overflow.
fn row_slots(layers: u64, width: u64) -> Result<u64, TraceError> {
    if layers == 0 || width == 0 {
        return Err(TraceError::Shape(format!(
            "layers {layers} and width {width} must both be at least 1"
        )));
    }
    layers
        .checked_mul(width)
        .ok_or_else(|| TraceError::Shape(format!("{layers} layers × {width} overflows")))
}

/// Read sglang's `routed_experts` / `indexer_topk` field: base64 of little-endian `int32`
/// with `layers × width` values per row. Returns the ids; their count is a whole number of
/// rows.
///
/// # Errors
/// [`TraceError::Base64`], [`TraceError::Shape`] for a zero shape, [`TraceError::Length`]
/// when the bytes are not a whole number of rows of `int32`.
pub fn sglang_int32(b64: &str, layers: u64, width: u64) -> Result<Vec<i32>, TraceError> {
    let per_row = row_slots(layers, width)?;
    let bytes = B64
        .decode(b64)
        .map_err(|e| TraceError::Base64(e.to_string()))?;
    let row_bytes = per_row.saturating_mul(4);
    let got = bytes.len() as u64;
    if !got.is_multiple_of(row_bytes) {
        return Err(TraceError::Length {
            got,
            expected: (got / row_bytes + 1) * row_bytes,
        });
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// sglang's form of `ids`: base64 of little-endian `int32` (what the serve double sends).
pub fn sglang_int32_base64(ids: &[i32]) -> String {
    let mut bytes = Vec::with_capacity(ids.len() * 4);
    for v in ids {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    B64.encode(bytes)
}

impl Trace {
    /// Build the compact form of `ids` (sglang's `int32`, row-major `[rows, layers,
    /// width]`, `rows = ids.len() / (layers × width)`) from position `start` on. With
    /// `padded`, `-1` marks an unused slot (indexer top-k); without, every id must be ≥ 0
    /// (routing). `id_bytes` is the smallest of 1, 2, 4 that holds every stored value.
    ///
    /// # Errors
    /// [`TraceError::Shape`] for a zero shape or a count that is not a whole number of
    /// rows; [`TraceError::NegativeId`] for an id below 0 (below -1 when `padded`).
    pub fn encode(
        start: u64,
        layers: u64,
        width: u64,
        ids: &[i32],
        padded: bool,
    ) -> Result<Self, TraceError> {
        let per_row = row_slots(layers, width)?;
        let n = ids.len() as u64;
        if !n.is_multiple_of(per_row) {
            return Err(TraceError::Shape(format!(
                "{n} ids are not a whole number of rows of {layers} × {width}"
            )));
        }
        let floor: i64 = if padded { -1 } else { 0 };
        let shift: i64 = if padded { 1 } else { 0 };
        let mut max = 0u64;
        for (i, v) in ids.iter().enumerate() {
            let v = i64::from(*v);
            if v < floor {
                return Err(TraceError::NegativeId {
                    index: i as u64,
                    value: v,
                });
            }
            // v + shift ≥ 0 and ≤ i32::MAX + 1: fits u64.
            max = max.max((v + shift) as u64);
        }
        let id_bytes: u8 = if max <= u64::from(u8::MAX) {
            1
        } else if max <= u64::from(u16::MAX) {
            2
        } else {
            4
        };
        let mut bytes = Vec::with_capacity(ids.len() * usize::from(id_bytes));
        for v in ids {
            let s = (i64::from(*v) + shift) as u32;
            bytes.extend_from_slice(&s.to_le_bytes()[..usize::from(id_bytes)]);
        }
        Ok(Self {
            start,
            rows: n / per_row,
            layers,
            width,
            id_bytes,
            padded,
            sha256: hex::encode(Sha256::digest(&bytes)),
            ids: B64.encode(&bytes),
        })
    }

    /// Bytes the decoded `ids` must have: `rows × layers × width × id_bytes`.
    ///
    /// # Errors
    /// [`TraceError::IdBytes`], [`TraceError::Shape`] (zero or overflowing shape).
    pub fn byte_len(&self) -> Result<u64, TraceError> {
        if !matches!(self.id_bytes, 1 | 2 | 4) {
            return Err(TraceError::IdBytes(self.id_bytes));
        }
        row_slots(self.layers, self.width)?
            .checked_mul(self.rows)
            .and_then(|n| n.checked_mul(u64::from(self.id_bytes)))
            .ok_or_else(|| {
                TraceError::Shape(format!(
                    "{} rows × {} × {} × {} bytes overflows",
                    self.rows, self.layers, self.width, self.id_bytes
                ))
            })
    }

    /// Check every field and return the ids (the module doc gives the rules).
    ///
    /// # Errors
    /// [`TraceError::IdBytes`], [`TraceError::Shape`], [`TraceError::Base64`],
    /// [`TraceError::Length`], [`TraceError::Digest`], [`TraceError::IdTooLarge`] (a
    /// stored value above `i32::MAX`, or above `i32::MAX + 1` when padded).
    pub fn decode(&self) -> Result<Decoded, TraceError> {
        let expected = self.byte_len()?;
        let shape = |what: &str| TraceError::Shape(format!("{what} does not fit this platform"));
        let rows = usize::try_from(self.rows).map_err(|_| shape("rows"))?;
        let layers = usize::try_from(self.layers).map_err(|_| shape("layers"))?;
        let width = usize::try_from(self.width).map_err(|_| shape("width"))?;
        // A base64 text longer than the shape needs is refused before it is decoded.
        let max_text = expected.div_ceil(3).saturating_mul(4);
        if self.ids.len() as u64 > max_text {
            return Err(TraceError::Length {
                got: (self.ids.len() as u64 / 4) * 3,
                expected,
            });
        }
        let bytes = B64
            .decode(&self.ids)
            .map_err(|e| TraceError::Base64(e.to_string()))?;
        if bytes.len() as u64 != expected {
            return Err(TraceError::Length {
                got: bytes.len() as u64,
                expected,
            });
        }
        let actual = hex::encode(Sha256::digest(&bytes));
        if actual != self.sha256 {
            return Err(TraceError::Digest {
                stated: self.sha256.chars().take(80).collect(),
                actual,
            });
        }
        let k = usize::from(self.id_bytes);
        let mut ids = Vec::with_capacity(bytes.len() / k);
        for (i, c) in bytes.chunks_exact(k).enumerate() {
            let mut w = [0u8; 4];
            w[..k].copy_from_slice(c);
            let stored = u32::from_le_bytes(w);
            let id = if self.padded {
                i64::from(stored) - 1
            } else {
                i64::from(stored)
            };
            let id = i32::try_from(id).map_err(|_| TraceError::IdTooLarge {
                index: i as u64,
                value: u64::from(stored),
            })?;
            ids.push(id);
        }
        Ok(Decoded {
            start: self.start,
            rows,
            layers,
            width,
            ids,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_of_256_experts_packs_to_one_byte() {
        let ids: Vec<i32> = (0..2 * 3 * 2).map(|i| (i * 37) % 256).collect();
        let t = Trace::encode(0, 3, 2, &ids, false).unwrap();
        assert_eq!((t.rows, t.id_bytes, t.padded), (2, 1, false));
        assert_eq!(B64.decode(&t.ids).unwrap().len(), 12);
        let d = t.decode().unwrap();
        assert_eq!(d.ids, ids);
        assert_eq!(d.at(1, 2), Some(&ids[10..12]));
        assert_eq!(d.at(2, 0), None);
        let json = serde_json::to_value(&t).unwrap();
        assert!(json.get("padded").is_none(), "{json}");
    }

    #[test]
    fn padding_shifts_by_one() {
        let ids = [0, 5, -1, -1];
        let t = Trace::encode(7, 1, 2, &ids, true).unwrap();
        assert_eq!(B64.decode(&t.ids).unwrap(), vec![1, 6, 0, 0]);
        assert_eq!(t.decode().unwrap().ids, ids);
        assert_eq!(t.decode().unwrap().at(8, 0), Some(&ids[2..4]));
        assert_eq!(
            Trace::encode(0, 1, 2, &[0, -1], false),
            Err(TraceError::NegativeId {
                index: 1,
                value: -1
            })
        );
        assert_eq!(
            Trace::encode(0, 1, 2, &[0, -2], true),
            Err(TraceError::NegativeId {
                index: 1,
                value: -2
            })
        );
        // i32::MAX + 1 stored fits 4 bytes, and decodes back.
        let t = Trace::encode(0, 1, 1, &[i32::MAX], true).unwrap();
        assert_eq!(t.id_bytes, 4);
        assert_eq!(t.decode().unwrap().ids, vec![i32::MAX]);
    }

    #[test]
    fn every_malformed_field_is_a_typed_error() {
        let good = Trace::encode(0, 2, 2, &[1, 2, 300, 4, 5, 6, 7, 8], false).unwrap();
        assert_eq!(good.id_bytes, 2);
        let with = |f: &dyn Fn(&mut Trace)| {
            let mut t = good.clone();
            f(&mut t);
            t.decode()
        };
        assert_eq!(with(&|t| t.id_bytes = 3), Err(TraceError::IdBytes(3)));
        assert!(matches!(with(&|t| t.layers = 0), Err(TraceError::Shape(_))));
        assert!(matches!(
            with(&|t| t.rows = u64::MAX),
            Err(TraceError::Shape(_))
        ));
        assert!(matches!(
            with(&|t| t.ids = "!!!!".into()),
            Err(TraceError::Base64(_))
        ));
        assert!(matches!(
            with(&|t| t.rows = 3),
            Err(TraceError::Length { .. })
        ));
        assert!(matches!(
            with(&|t| t.ids.push_str("AAAA")),
            Err(TraceError::Length { .. })
        ));
        assert!(matches!(
            with(&|t| t.sha256 = "00".repeat(32)),
            Err(TraceError::Digest { .. })
        ));
        // A stored u32 above i32::MAX (built by hand, digest right).
        let bytes = u32::MAX.to_le_bytes();
        let t = Trace {
            start: 0,
            rows: 1,
            layers: 1,
            width: 1,
            id_bytes: 4,
            padded: false,
            ids: B64.encode(bytes),
            sha256: hex::encode(Sha256::digest(bytes)),
        };
        assert_eq!(
            t.decode(),
            Err(TraceError::IdTooLarge {
                index: 0,
                value: u64::from(u32::MAX)
            })
        );
    }

    #[test]
    fn sglang_form_round_trips_and_checks_whole_rows() {
        let ids = [3, 0, 255, -1, 7, 1];
        let b64 = sglang_int32_base64(&ids);
        assert_eq!(sglang_int32(&b64, 1, 3).unwrap(), ids);
        assert!(matches!(
            sglang_int32(&b64, 2, 2),
            Err(TraceError::Length { got: 24, .. })
        ));
        assert!(matches!(
            sglang_int32("a", 1, 1),
            Err(TraceError::Base64(_))
        ));
        assert!(matches!(sglang_int32("", 0, 1), Err(TraceError::Shape(_))));
        assert_eq!(sglang_int32("", 1, 1).unwrap(), Vec::<i32>::new());
    }
}
