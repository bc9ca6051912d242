//! What a forward pass records or follows besides its hidden states: each decoder layer's
//! residual output, the experts every MoE layer routed each row to, and a check of those
//! choices against a serve's committed routing trace.
//!
//! * A serve records its routing ([`RoutingRecord`]) in sglang's layout: expert ids row-major
//!   `[positions, num_hidden_layers, num_experts_per_tok]`, in the order the router chose them,
//!   with the rows of dense layers left 0 (sglang's capture buffer is zero-initialised and only
//!   MoE layers write it).
//! * An auditor checks a committed trace ([`RoutingCheck`]): for every (position, MoE layer) the
//!   committed expert *set* is compared with its own top-k. A different set whose experts are
//!   all within `margin` of the auditor's own top-k boundary is a near-tie (the serve's numerics
//!   flipped a choice that was nearly tied), anything else a mismatch. With `replay`, a near-tie
//!   is followed: the layer dispatches the committed experts, weighted by the auditor's own
//!   router scores, so the recompute stays on the serve's path (docs/AUDITOR.md "Routing").
//!
//! Scores are in the unit the architecture's rule ranks by ([`RouteScores`]): router logits for
//! the softmax top-k routers of Qwen3-MoE / Qwen3.5-MoE (ranking by probability is ranking by
//! logit), `sigmoid(logit) + e_score_correction_bias` for GLM's router.
use std::collections::BTreeMap;

use candle_core::Tensor;
use serde::Serialize;

/// The shape of a routing trace (sglang's `routed_experts`, `[rows, layers, top_k]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RoutingShape {
    /// `num_hidden_layers` (dense layers included; their rows are 0).
    pub layers: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// Routed experts per MoE layer (ids are `0..experts`).
    pub experts: usize,
}

impl RoutingShape {
    /// Ids per position: `layers * top_k`.
    pub fn per_position(&self) -> usize {
        self.layers * self.top_k
    }
}

/// The expert ids a forward pass routed each position to, by absolute position.
#[derive(Debug, Clone)]
pub struct RoutingRecord {
    shape: RoutingShape,
    by_position: BTreeMap<usize, Vec<u32>>,
}

impl RoutingRecord {
    /// An empty record for a model of `shape`.
    pub fn new(shape: RoutingShape) -> Self {
        Self {
            shape,
            by_position: BTreeMap::new(),
        }
    }

    /// The shape it records.
    pub fn shape(&self) -> RoutingShape {
        self.shape
    }

    /// Records that MoE layer `layer` routed the row at absolute position `first + i` to
    /// `chosen[i]` (at most `top_k` ids, in choice order). A layer index outside the shape is
    /// ignored.
    pub fn put(&mut self, layer: usize, first: usize, chosen: &[Vec<usize>]) {
        let s = self.shape;
        if layer >= s.layers {
            return;
        }
        for (i, ids) in chosen.iter().enumerate() {
            let row = self
                .by_position
                .entry(first + i)
                .or_insert_with(|| vec![0; s.per_position()]);
            let at = layer * s.top_k;
            for (j, &e) in ids.iter().take(s.top_k).enumerate() {
                row[at + j] = e as u32;
            }
        }
    }

    /// The ids of positions `start..end`, row-major `[end - start, layers, top_k]`; positions
    /// never recorded are all 0 (as a dense model's trace would be).
    pub fn ids(&self, start: usize, end: usize) -> Vec<u32> {
        let per = self.shape.per_position();
        let mut out = Vec::with_capacity(end.saturating_sub(start) * per);
        for p in start..end {
            match self.by_position.get(&p) {
                Some(row) => out.extend_from_slice(row),
                None => out.extend(std::iter::repeat_n(0, per)),
            }
        }
        out
    }

    /// The positions recorded, in ascending order.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_position.keys().copied()
    }
}

/// A serve's committed routing: expert ids of positions `start..start + rows`, row-major
/// `[rows, layers, top_k]` as decoded from the commitment's trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedRouting {
    /// Absolute position of the first row.
    pub start: usize,
    /// The shape the ids have.
    pub shape: RoutingShape,
    /// `rows * layers * top_k` ids.
    pub ids: Vec<u32>,
}

impl CommittedRouting {
    /// Rows covered.
    pub fn rows(&self) -> usize {
        self.ids.len() / self.shape.per_position().max(1)
    }

    /// The committed ids of (`position`, `layer`), or `None` when the trace does not cover it.
    pub fn at(&self, position: usize, layer: usize) -> Option<&[u32]> {
        let s = self.shape;
        let row = position.checked_sub(self.start)?;
        if row >= self.rows() || layer >= s.layers {
            return None;
        }
        let at = row * s.per_position() + layer * s.top_k;
        self.ids.get(at..at + s.top_k)
    }
}

/// Agreement counts of one decoder layer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LayerAgreement {
    /// (position, layer) cells compared.
    pub compared: usize,
    /// Cells whose committed set is the auditor's own top-k.
    pub agree: usize,
    /// Cells with a different set within the margin of the auditor's top-k boundary.
    pub near_tie: usize,
    /// Cells with a different set outside the margin (or ids that are no expert).
    pub mismatch: usize,
    /// Near-ties whose committed experts the recompute dispatched ([`RoutingCheck::replay`]).
    pub replayed: usize,
}

/// The first disagreement outside the margin, in (position, layer) order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// Absolute token position.
    pub position: usize,
    /// Decoder layer.
    pub layer: usize,
    /// The committed ids.
    pub committed: Vec<u32>,
    /// The auditor's own top-k, in choice order.
    pub own: Vec<u32>,
    /// How far the committed set is from being the top-k (score units of the architecture;
    /// infinite for an id that is no expert or a repeated id).
    pub gap: f32,
}

/// How far below the own top-k boundary a committed expert may score and still be a near-tie:
/// `abs + rel · |s_k|`, where `s_k` is the auditor's own k-th score (bf16 rounding noise grows
/// with the magnitude of the scores it rounds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Margin {
    /// Absolute part, in the architecture's score units.
    pub abs: f32,
    /// Relative part, a fraction of the boundary score's magnitude.
    pub rel: f32,
}

impl Margin {
    /// The margin at a boundary score `kth` (just `abs` when `kth` is not finite).
    pub fn at(&self, kth: f32) -> f32 {
        if kth.is_finite() {
            self.abs + self.rel * kth.abs()
        } else {
            self.abs
        }
    }
}

/// The comparison of a forward pass's routing with a committed trace (module docs).
#[derive(Debug, Clone)]
pub struct RoutingCheck {
    committed: CommittedRouting,
    margin: Margin,
    replay: bool,
    /// Dispatch the committed experts whatever the classification (a cell check).
    dispatch_committed: bool,
    layers: Vec<LayerAgreement>,
    first: Option<Divergence>,
    near_tie_gaps: Vec<f32>,
    /// Per compared position: (any near-tie, any mismatch) over its MoE layers.
    positions: BTreeMap<usize, (bool, bool)>,
}

/// Agreement counted per token position (over all its MoE layers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TokenAgreement {
    /// Positions with at least one compared MoE layer.
    pub compared: usize,
    /// Positions whose every compared layer agrees exactly.
    pub agree: usize,
    /// Positions with a near-tie and no mismatch.
    pub near_tie: usize,
    /// Positions with at least one mismatch.
    pub mismatch: usize,
}

impl RoutingCheck {
    /// A check of `committed` with near-tie `margin` (score units of the architecture), which
    /// follows near-ties when `replay`.
    pub fn new(committed: CommittedRouting, margin: Margin, replay: bool) -> Self {
        let layers = vec![LayerAgreement::default(); committed.shape.layers];
        Self {
            committed,
            margin,
            replay,
            dispatch_committed: false,
            layers,
            first: None,
            near_tie_gaps: Vec::new(),
            positions: BTreeMap::new(),
        }
    }

    /// This check, classifying as before but dispatching the committed experts on every
    /// compared row, mismatches included: what a cell check needs (the block output the serve
    /// claims to have computed, and the class of its routing, from one pass).
    pub fn dispatching_committed(mut self) -> Self {
        self.dispatch_committed = true;
        self
    }

    /// The agreement per token position.
    pub fn tokens(&self) -> TokenAgreement {
        let mut t = TokenAgreement::default();
        for &(near, mismatch) in self.positions.values() {
            t.compared += 1;
            if mismatch {
                t.mismatch += 1;
            } else if near {
                t.near_tie += 1;
            } else {
                t.agree += 1;
            }
        }
        t
    }

    /// The gap of every near-tie, in the order met (for calibrating the margin).
    pub fn near_tie_gaps(&self) -> &[f32] {
        &self.near_tie_gaps
    }

    /// Whether near-ties are followed.
    pub fn replay(&self) -> bool {
        self.replay
    }

    /// The near-tie margin.
    pub fn margin(&self) -> Margin {
        self.margin
    }

    /// Counts per decoder layer (dense layers stay all 0).
    pub fn layers(&self) -> &[LayerAgreement] {
        &self.layers
    }

    /// The first mismatch in (position, layer) order, if any.
    pub fn first_divergence(&self) -> Option<&Divergence> {
        self.first.as_ref()
    }

    /// The totals over all layers.
    pub fn totals(&self) -> LayerAgreement {
        self.layers
            .iter()
            .fold(LayerAgreement::default(), |a, l| LayerAgreement {
                compared: a.compared + l.compared,
                agree: a.agree + l.agree,
                near_tie: a.near_tie + l.near_tie,
                mismatch: a.mismatch + l.mismatch,
                replayed: a.replayed + l.replayed,
            })
    }

    /// Compares one MoE layer's rows (positions `first..`) and returns the choice each row
    /// dispatches: the committed experts on a replayed near-tie, else the auditor's own.
    fn decide(
        &mut self,
        layer: usize,
        first: usize,
        scores: &RouteScores<'_>,
        own: Vec<Vec<usize>>,
    ) -> Vec<Vec<usize>> {
        let mut used = Vec::with_capacity(own.len());
        for (i, mine) in own.into_iter().enumerate() {
            let pos = first + i;
            let Some(committed) = self.committed.at(pos, layer).map(<[u32]>::to_vec) else {
                used.push(mine);
                continue;
            };
            let Some(stats) = self.layers.get_mut(layer) else {
                used.push(mine);
                continue;
            };
            stats.compared += 1;
            let token = self.positions.entry(pos).or_default();
            let rank = scores.row(i);
            if same_set(&committed, &mine) {
                stats.agree += 1;
                used.push(mine);
                continue;
            }
            // An id that is no expert, or repeats, has an infinite gap: never a near-tie.
            let gap = set_gap(rank, &committed);
            let kth = mine
                .iter()
                .filter_map(|&e| rank.get(e).copied())
                .fold(f32::INFINITY, f32::min);
            if gap.is_finite() && gap <= self.margin.at(kth) {
                token.0 = true;
                stats.near_tie += 1;
                self.near_tie_gaps.push(gap);
                if self.replay {
                    stats.replayed += 1;
                    used.push(committed.iter().map(|&e| e as usize).collect());
                    continue;
                }
            } else {
                token.1 = true;
                stats.mismatch += 1;
                let earlier = self
                    .first
                    .as_ref()
                    .is_none_or(|d| (pos, layer) < (d.position, d.layer));
                if earlier {
                    self.first = Some(Divergence {
                        position: pos,
                        layer,
                        committed: committed.clone(),
                        own: mine.iter().map(|&e| e as u32).collect(),
                        gap,
                    });
                }
            }
            if self.dispatch_committed {
                used.push(committed.iter().map(|&e| e as usize).collect());
            } else {
                used.push(mine);
            }
        }
        used
    }
}

/// The scores an MoE layer's routing rule ranks experts by, `[rows][experts]`; experts the rule
/// excludes (GLM's dropped groups) are `-inf`.
#[derive(Debug, Clone, Copy)]
pub struct RouteScores<'a> {
    rows: &'a [Vec<f32>],
}

impl<'a> RouteScores<'a> {
    /// Scores of `rows` rows.
    pub fn new(rows: &'a [Vec<f32>]) -> Self {
        Self { rows }
    }

    fn row(&self, i: usize) -> &[f32] {
        self.rows.get(i).map(Vec::as_slice).unwrap_or(&[])
    }
}

fn same_set(committed: &[u32], own: &[usize]) -> bool {
    let mut a: Vec<usize> = committed.iter().map(|&e| e as usize).collect();
    let mut b = own.to_vec();
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

/// How far `set` is from being a top-`set.len()` of `rank`: the best score outside it minus the
/// worst inside it (≤ 0 when it is a top-k; exactly 0 on a tie at the boundary). Infinite when
/// an id is no expert, is repeated, or has a non-finite score.
pub fn set_gap(rank: &[f32], set: &[u32]) -> f32 {
    let mut inside = vec![false; rank.len()];
    let mut worst_in = f32::INFINITY;
    for &e in set {
        let Some(&s) = rank.get(e as usize) else {
            return f32::INFINITY;
        };
        if inside[e as usize] || !s.is_finite() {
            return f32::INFINITY;
        }
        inside[e as usize] = true;
        worst_in = worst_in.min(s);
    }
    let best_out = rank
        .iter()
        .zip(&inside)
        .filter(|(_, &i)| !i)
        .map(|(&s, _)| s)
        .fold(f32::NEG_INFINITY, f32::max);
    best_out - worst_in
}

/// What a forward pass records or follows besides its hidden states (module docs). The default
/// records and follows nothing.
#[derive(Debug, Default)]
pub struct Probe<'a> {
    /// When given, each decoder layer's residual output `[rows, hidden]` (before the final
    /// norm) is pushed in layer order.
    pub layers: Option<&'a mut Vec<Tensor>>,
    /// When given, the experts each MoE layer dispatched for each row.
    pub routing: Option<&'a mut RoutingRecord>,
    /// When given, each MoE layer's own choice is checked against a committed trace (and
    /// near-ties followed when the check replays).
    pub check: Option<&'a mut RoutingCheck>,
    /// When given, each MoE layer's router logits (f32 widening of what the router computed)
    /// by (absolute position, layer).
    pub router_logits: Option<&'a mut BTreeMap<(usize, usize), Vec<f32>>>,
    /// When given, each MoE block's input and output, in the order the layers ran.
    pub blocks: Option<&'a mut Vec<BlockIo>>,
    /// When given with `blocks`, only these (absolute position, layer) rows are kept, each as
    /// its own one-row [`BlockIo`] (copied out, so a sampled audit holds `n` rows, not every
    /// layer's `[rows, hidden]`).
    pub block_rows: Option<&'a std::collections::BTreeSet<(usize, usize)>>,
    /// When given, the key positions each DSA layer kept for each row (sorted ascending), by
    /// (absolute position, layer) ([`crate::index_sets`]).
    pub attended: Option<&'a mut crate::index_sets::OwnIndexSets>,
    /// When given, increased by the (row, layer) pairs whose DSA top-k selection cuts through
    /// a tie (layers with their own indexer; the other [`super::TieOrder`] keeps another set
    /// there): exact on the host ([`super::ops::topk_cuts_tie`]), never fewer on a GPU
    /// ([`super::dsa_kernels::rows_cutting_ties`]). Left alone by architectures without DSA.
    /// 0 after a pass means the pass with the other tie order computes the same, bit for bit.
    pub dsa_boundary_ties: Option<&'a mut usize>,
    /// When given, each MoE block's shared-expert output `[rows, hidden]` (after its gate,
    /// where the architecture gates it), in the order the layers ran; nothing from
    /// architectures without a shared expert. The cell check splits `y`'s error between the
    /// routed and the shared part with it ([`crate::cells::CellCheck::y_bias_shared`]).
    pub shared: Option<&'a mut Vec<Tensor>>,
}

/// One MoE block's input and output over the rows of one forward call (the material of a
/// sampled-audit cell, specs/CELLS.md §2).
#[derive(Debug, Clone)]
pub struct BlockIo {
    /// Decoder layer.
    pub layer: usize,
    /// Absolute position of the first row.
    pub first: usize,
    /// The block's input (post-attention norm output), `[rows, hidden]`.
    pub x: Tensor,
    /// The block's output (routed + shared experts), `[rows, hidden]`.
    pub y: Tensor,
}

impl Probe<'_> {
    /// A probe that pushes residual outputs into `layers` (or nothing when `None`).
    pub fn with_layers(layers: Option<&mut Vec<Tensor>>) -> Probe<'_> {
        Probe {
            layers,
            ..Probe::default()
        }
    }

    /// Records the key positions a DSA layer kept for rows `first ..` when asked to.
    pub(crate) fn push_attended(&mut self, layer: usize, first: usize, sel: &[Vec<usize>]) {
        if let Some(a) = self.attended.as_deref_mut() {
            for (r, keys) in sel.iter().enumerate() {
                let mut k = keys.clone();
                k.sort_unstable();
                a.insert((first + r, layer), k);
            }
        }
    }

    /// Pushes a block's shared-expert output into [`Probe::shared`] when it is given.
    pub(crate) fn push_shared(&mut self, shared: &Tensor) {
        if let Some(v) = self.shared.as_deref_mut() {
            v.push(shared.clone());
        }
    }

    /// Records an MoE block's input and output when asked to.
    pub(crate) fn push_block(&mut self, layer: usize, first: usize, x: &Tensor, y: &Tensor) {
        let Some(b) = self.blocks.as_deref_mut() else {
            return;
        };
        let Some(keep) = self.block_rows else {
            b.push(BlockIo {
                layer,
                first,
                x: x.clone(),
                y: y.clone(),
            });
            return;
        };
        let rows = x.dims().first().copied().unwrap_or(0);
        for i in 0..rows {
            if !keep.contains(&(first + i, layer)) {
                continue;
            }
            // A row that cannot be copied is left out; the caller reports it missing.
            let row = |t: &Tensor| t.narrow(0, i, 1).and_then(|r| r.copy());
            if let (Ok(x), Ok(y)) = (row(x), row(y)) {
                b.push(BlockIo {
                    layer,
                    first: first + i,
                    x,
                    y,
                });
            }
        }
    }

    /// Pushes a layer's residual output when asked to.
    pub(crate) fn push_layer(&mut self, x: &Tensor) {
        if let Some(l) = self.layers.as_deref_mut() {
            l.push(x.clone());
        }
    }

    /// Whether [`Probe::route`] reads the router's scores (a routing check, or a record of the
    /// router's logits): the router must then keep every row's logits
    /// ([`super::ops::softmax_route_in`]'s `full_rows`).
    pub(crate) fn wants_scores(&self) -> bool {
        self.check.is_some() || self.router_logits.is_some()
    }

    /// The routing an MoE layer dispatches for its rows at positions `first..`: its own top-k
    /// `own` (choice order), or a replayed committed set ([`RoutingCheck`]); recorded when a
    /// record is kept.
    pub(crate) fn route(
        &mut self,
        layer: usize,
        first: usize,
        logits: &[Vec<f32>],
        scores: RouteScores<'_>,
        own: Vec<Vec<usize>>,
    ) -> Vec<Vec<usize>> {
        if let Some(rec) = self.router_logits.as_deref_mut() {
            for (i, row) in logits.iter().enumerate() {
                rec.insert((first + i, layer), row.clone());
            }
        }
        let used = match self.check.as_deref_mut() {
            Some(c) => c.decide(layer, first, &scores, own),
            None => own,
        };
        if let Some(r) = self.routing.as_deref_mut() {
            r.put(layer, first, &used);
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> RoutingShape {
        RoutingShape {
            layers: 2,
            top_k: 2,
            experts: 4,
        }
    }

    #[test]
    fn gap_is_zero_at_a_tie_and_positive_off_the_top() {
        let r = [0.5, 0.4, 0.4, 0.1];
        assert!(set_gap(&r, &[0, 1]) <= 0.0);
        assert_eq!(set_gap(&r, &[0, 2]), 0.0);
        assert!((set_gap(&r, &[0, 3]) - 0.3).abs() < 1e-6);
        assert_eq!(set_gap(&r, &[0, 0]), f32::INFINITY);
        assert_eq!(set_gap(&r, &[0, 9]), f32::INFINITY);
    }

    #[test]
    fn check_counts_agree_near_tie_and_mismatch_and_replays_near_ties() {
        // Row 0: agree (set order differs); row 1: near tie; row 2: mismatch.
        let committed = CommittedRouting {
            start: 10,
            shape: shape(),
            ids: vec![1, 0, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0],
        };
        let scores = vec![
            vec![0.9, 0.8, 0.1, 0.0],
            vec![0.9, 0.5, 0.49, 0.0],
            vec![0.9, 0.8, 0.1, 0.0],
        ];
        let own = vec![vec![0, 1], vec![0, 1], vec![0, 1]];
        let margin = Margin {
            abs: 0.05,
            rel: 0.0,
        };
        let mut check = RoutingCheck::new(committed, margin, true);
        let mut probe = Probe {
            check: Some(&mut check),
            ..Probe::default()
        };
        let used = probe.route(0, 10, &scores, RouteScores::new(&scores), own);
        assert_eq!(used, vec![vec![0, 1], vec![0, 2], vec![0, 1]]);
        let l0 = check.layers()[0];
        assert_eq!(
            (l0.compared, l0.agree, l0.near_tie, l0.mismatch),
            (3, 1, 1, 1)
        );
        assert_eq!(l0.replayed, 1);
        let d = check.first_divergence().cloned();
        assert_eq!(d.map(|d| (d.position, d.layer)), Some((12, 0)));
    }

    #[test]
    fn dispatching_committed_follows_even_a_mismatch_and_still_counts_it() {
        let committed = CommittedRouting {
            start: 0,
            shape: shape(),
            ids: vec![0, 3, 0, 0],
        };
        let scores = vec![vec![0.9, 0.8, 0.1, 0.0]];
        let margin = Margin {
            abs: 0.05,
            rel: 0.0,
        };
        let mut check = RoutingCheck::new(committed, margin, true).dispatching_committed();
        let mut probe = Probe {
            check: Some(&mut check),
            ..Probe::default()
        };
        let used = probe.route(0, 0, &scores, RouteScores::new(&scores), vec![vec![0, 1]]);
        assert_eq!(used, vec![vec![0, 3]]);
        assert_eq!(check.totals().mismatch, 1);
    }

    #[test]
    fn record_is_row_major_with_dense_layers_zero() {
        let mut r = RoutingRecord::new(shape());
        r.put(1, 5, &[vec![3, 1], vec![2, 0]]);
        assert_eq!(r.ids(5, 7), vec![0, 0, 3, 1, 0, 0, 2, 0]);
        assert_eq!(r.ids(7, 8), vec![0, 0, 0, 0]);
    }
}
