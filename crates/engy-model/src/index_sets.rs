//! The DSA index-set comparison of an audit (issue 23 part A, docs/AUDITOR.md "DSA index
//! sets"): the key positions a serve's DSA indexer kept for each (token position, layer), from
//! the commitment's `indexer_topk` trace (docs/PROTOCOL.md §3.10), against the positions the
//! auditor's own recompute kept.
//!
//! Per (position, layer) the **overlap** is `|committed ∩ own| / |own|` (1 when the recompute
//! kept no key): the share of the keys the auditor attends that the serve attended too. It is
//! reported, not part of the verdict: sglang's trace may hold KV-slot rather than position
//! indices on some attention backends (PROTOCOL.md §3.10), and no honest serve's trace has been
//! measured yet to calibrate a threshold on.
use std::collections::BTreeMap;

use engy_core::trace::Trace;
use serde::Serialize;

/// The index sets a recompute kept, by (absolute position, decoder layer), each sorted
/// ascending ([`crate::arch::Probe::attended`]).
pub type OwnIndexSets = BTreeMap<(usize, usize), Vec<usize>>;

/// What the comparison found ([`crate::audit::AuditReport::index_sets`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum IndexSetAudit {
    /// The trace was compared.
    Compared(IndexSetSummary),
    /// Nothing was compared, and why.
    NotCompared {
        /// Why.
        reason: String,
    },
}

/// The comparison's counts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IndexSetSummary {
    /// (position, layer) pairs present in both the trace and the recompute.
    pub compared: u64,
    /// Pairs whose sets are equal.
    pub identical: u64,
    /// Mean overlap over the compared pairs, in `[0, 1]`.
    pub mean_overlap: f64,
    /// The lowest overlap and where (`None` when nothing was compared).
    pub worst: Option<WorstSet>,
    /// Mean overlap per decoder layer, layers in ascending order.
    pub per_layer: Vec<(usize, f64)>,
}

/// The (position, layer) of the lowest overlap.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorstSet {
    /// Token position.
    pub position: usize,
    /// Decoder layer.
    pub layer: usize,
    /// `|committed ∩ own| / |own|`.
    pub overlap: f64,
}

/// Compares `trace` (the commitment's `indexer_topk`; its layer `l` is decoder layer `l`, as
/// sglang writes it for GLM-5) with `own`.
///
/// # Errors
/// Why the trace cannot be compared: it does not decode, or it covers none of the positions
/// and layers the recompute ran.
pub fn compare(trace: &Trace, own: &OwnIndexSets) -> Result<IndexSetSummary, String> {
    let d = trace
        .decode()
        .map_err(|e| format!("the indexer_topk trace cannot be read: {e}"))?;
    let mut per_layer: BTreeMap<usize, (f64, u64)> = BTreeMap::new();
    let (mut compared, mut identical, mut sum) = (0u64, 0u64, 0f64);
    let mut worst: Option<WorstSet> = None;
    for (&(position, layer), mine) in own {
        let Some(slots) = d.at(position as u64, layer) else {
            continue;
        };
        let mut theirs: Vec<usize> = slots
            .iter()
            .filter_map(|&i| usize::try_from(i).ok())
            .collect();
        theirs.sort_unstable();
        theirs.dedup();
        let shared = mine
            .iter()
            .filter(|k| theirs.binary_search(k).is_ok())
            .count();
        let overlap = if mine.is_empty() {
            1.0
        } else {
            shared as f64 / mine.len() as f64
        };
        compared += 1;
        identical += u64::from(theirs == *mine);
        sum += overlap;
        let e = per_layer.entry(layer).or_default();
        e.0 += overlap;
        e.1 += 1;
        if worst.as_ref().is_none_or(|w| overlap < w.overlap) {
            worst = Some(WorstSet {
                position,
                layer,
                overlap,
            });
        }
    }
    if compared == 0 {
        return Err(format!(
            "the indexer_topk trace (positions {}..{}, {} layers) covers none of the recompute's \
             positions and layers",
            d.start,
            d.start + d.rows as u64,
            d.layers
        ));
    }
    Ok(IndexSetSummary {
        compared,
        identical,
        mean_overlap: sum / compared as f64,
        worst,
        per_layer: per_layer
            .into_iter()
            .map(|(l, (s, n))| (l, s / n as f64))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(rows: &[[&[i32]; 2]], width: usize) -> Trace {
        let mut ids = Vec::new();
        for row in rows {
            for layer in row {
                let mut v = layer.to_vec();
                v.resize(width, -1);
                ids.extend(v);
            }
        }
        Trace::encode(0, 2, width as u64, &ids, true).unwrap()
    }

    #[test]
    fn equal_sets_overlap_fully_and_a_moved_key_is_counted() {
        let own: OwnIndexSets = [
            ((0, 0), vec![0]),
            ((0, 1), vec![0]),
            ((1, 0), vec![0, 1]),
            ((1, 1), vec![0, 1]),
        ]
        .into();
        // Same sets, sglang's order and padding.
        let same = trace(&[[&[0], &[0]], [&[1, 0], &[0, 1]]], 3);
        let s = compare(&same, &own).unwrap();
        assert_eq!((s.compared, s.identical, s.mean_overlap), (4, 4, 1.0));
        // Position 1, layer 1 kept key 1 where the recompute kept 0 and 1: overlap 1/2.
        let moved = trace(&[[&[0], &[0]], [&[1, 0], &[1]]], 3);
        let s = compare(&moved, &own).unwrap();
        assert_eq!((s.compared, s.identical), (4, 3));
        assert_eq!(
            s.worst,
            Some(WorstSet {
                position: 1,
                layer: 1,
                overlap: 0.5
            })
        );
        assert_eq!(s.per_layer, vec![(0, 1.0), (1, 0.75)]);
    }

    #[test]
    fn a_trace_outside_the_recompute_is_not_compared() {
        let own: OwnIndexSets = [((5, 0), vec![0])].into();
        let t = trace(&[[&[0], &[0]]], 1);
        let e = compare(&t, &own).unwrap_err();
        assert!(e.contains("covers none"), "{e}");
    }
}
