//! The auditor: re-derive a commitment's hidden states from the pinned weights and check its
//! TOPLOC proofs.
//!
//! Input: a miner commitment ([`engy_core::wire::Commitment`], docs/PROTOCOL.md §3.10: `{model_root, output_token_ids, toploc:
//! {proofs, topk, decode_batching_size, skip_prefill, n_tokens, prompt_ids}}`) and a checkpoint.
//!
//! 1. Shape checks. Anything the miner got wrong in form (another `model_root`, `n_tokens` not
//!    matching the output ids or the proof count, `skip_prefill` false, a `topk` other than the
//!    model spec's `toploc_k`, bad base64, a null proof, ids outside the vocabulary, a sequence
//!    longer than the model's context) makes the verdict [`Verdict::Unproven`] with the reason:
//!    such a commitment proves nothing, but it is not evidence of swapped weights.
//! 2. ONE teacher-forced pass over `prompt_ids + output_token_ids[..n-1]`. Row `j` of the proof
//!    is the final hidden state (LM-head input) that sampled output token `j`, i.e. position
//!    `len(prompt_ids) - 1 + j` (sglang-native-api.md §2.6.1; PROTOCOL.md §3.5).
//! 3. Rows → bf16 (round to nearest even, [`engy_core::toploc::f32_to_bf16_bits`]) →
//!    [`engy_core::toploc::verify_proofs`] with `skip_prefill = true` and the commitment's
//!    `topk` / `decode_batching_size` (PROTOCOL.md §5).
//! 4. Verdict (model spec fields, PROTOCOL.md §4; engy docs/MINER.md "toploc_v: mismatch
//!    threshold, toploc_p: pass ratio required"): a batch **passes** when its
//!    `exp_mismatches <= toploc_v` and its proof is not degenerate (a modulus below `topk` or
//!    a constant polynomial: [`degenerate_proof`]); the commitment **passes** when
//!    `passing_batches / batches >= toploc_p` over its judged batches, otherwise it is a
//!    **cheat**. With the defaults (128, 40, 0.99) and fewer than 100 batches, one failing
//!    batch is a cheat. A batch is judged when it holds at least [`SPARSE_TOPK_FACTOR`] ×
//!    `topk` values ([`judged_batch`]): on every served model (hidden size ≥ 2,048) that is
//!    every batch, a one-row tail included; on smaller models a short tail batch, whose top-k
//!    reaches into values where an honest serve's rounding flips exponents, is reported but
//!    not judged, unless no batch of the commitment is large enough (then all are judged).
//! 5. Score: the mean over judged batches of `exp_mismatches / topk`, in `[0, 1]` (the SN53
//!    one-pager's "mean top-k mismatch count normalised by topk"). Reported with every verdict
//!    that got as far as verification.
//! 6. Precision ([`audit_with`], [`Recompute`]; docs/AUDITOR.md "Recomputes"): the
//!    commitment does not say whether the serve computed in bf16 (every GPU serve) or f32, and
//!    the two differ by far more than two bf16 serves do (on small MoE models, MoE and DSA
//!    top-k choices amplify bf16 rounding until a bf16 serve's batches fail an f32 recompute).
//!    So the auditor recomputes as the serve computes: in bf16 first ([`Compute::Bf16`], the
//!    architecture's own bf16 rounding points), then, when that does not pass, in f32, then
//!    in bf16 with transformers' eager attention ([`AttentionKernel::Eager`]: a serve with
//!    `attn_implementation="eager"` rounds the attention's scores and probabilities where a
//!    fused kernel does not, which on small models moves MoE and DSA choices). The
//!    commitment passes when one honest recompute explains every judged batch; the thresholds are
//!    the model spec's, unchanged. On a block-FP8 checkpoint (`quant_method: fp8`) the W8A8
//!    recompute runs second, after bf16 ([`Recompute::computes_for`]): sglang multiplies such
//!    checkpoints with every FP8 product's input rows quantised per token and per 128-group
//!    to e4m3 (`arch::quant` "W8A8"), which moves an honest serve's rows further from a bf16
//!    recompute than some weight swaps do (docs/design/w8a8.md). On a GPU an honest W8A8
//!    serve lands beyond the limits from every recompute, W8A8 included; a commitment that
//!    fails them all but is closer to the W8A8 recompute than to every unquantised one is
//!    [`Verdict::Unproven`] ([`W8A8_NOISE`], PROTOCOL.md §5.1), never a cheat. On an architecture with a
//!    DSA indexer, exact ties at the `index_topk` boundary are ties, not divergences: no serve's order among equal scores is
//!    known (`arch::TieOrder`), so when neither recompute passes with ties taken lower index
//!    first, both are run again with ties taken higher index first; each only when its
//!    lower-first pass had a selection that cut through a tie (`arch::Probe::
//!    dsa_boundary_ties`), since otherwise the higher-first pass keeps the same keys in every
//!    layer and computes the same, bit for bit. A sequence no longer than `index_topk` never
//!    cuts: every query keeps all its keys.
use serde::Serialize;

use engy_core::toploc::{self, Dtype, Params, ProofPoly};
use engy_core::wire::Commitment;

use crate::arch::{
    self, AttentionKernel, CommittedRouting, Divergence, Fp8Activations, LayerAgreement, Probe,
    RoutingCheck, TieOrder,
};
use crate::index_sets::{self, IndexSetAudit, OwnIndexSets};
use crate::{Compute, Model, ModelError, Numerics};

/// Which recomputes the auditor runs ([`audit_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// bf16 with a fused kernel's attention, then f32, then bf16 with eager attention, each
    /// only when the ones before it did not pass: a commitment passes when one passes (an
    /// honest serve computes as one of them).
    #[default]
    Auto,
    /// Only the bf16 recompute with a fused kernel's attention (one pass; the benchmarks').
    Bf16,
    /// Only the bf16 recompute with eager attention.
    #[serde(rename = "bf16-eager")]
    Bf16Eager,
    /// Only the f32 recompute.
    F32,
    /// Only the W8A8 recompute: bf16 activations with a fused kernel's attention, every
    /// product with a block-FP8 weight taking its input rows quantised per token and per
    /// 128-group to `float8_e4m3fn` as sglang's block-FP8 linear method and fused MoE do
    /// ([`arch::Fp8Activations::PerTokenGroup`]). On a checkpoint with no block-FP8 weight it
    /// computes as [`Recompute::Bf16`].
    W8a8,
}

impl Recompute {
    /// The activation dtypes and attention kernels tried, in order. The f32 recompute has one
    /// attention rule (both kernels compute the same in f32); a bf16 serve's attention rounds
    /// as a fused kernel (every GPU serve, transformers' default `sdpa`) or as transformers'
    /// `eager` attention ([`AttentionKernel`]).
    /// [`Recompute::W8a8`] lists its bf16 pass (its FP8 activation rule:
    /// [`Recompute::computes_for`]).
    pub fn computes(self) -> &'static [(Compute, AttentionKernel)] {
        const BF16_SDPA: (Compute, AttentionKernel) = (Compute::Bf16, AttentionKernel::Sdpa);
        const BF16_EAGER: (Compute, AttentionKernel) = (Compute::Bf16, AttentionKernel::Eager);
        const F32: (Compute, AttentionKernel) = (Compute::F32, AttentionKernel::Sdpa);
        match self {
            Recompute::Auto => &[BF16_SDPA, F32, BF16_EAGER],
            Recompute::Bf16 | Recompute::W8a8 => &[BF16_SDPA],
            Recompute::Bf16Eager => &[BF16_EAGER],
            Recompute::F32 => &[F32],
        }
    }

    /// [`Recompute::computes`] with the activation rule of block-FP8 products, for a
    /// checkpoint whose weights are (`fp8`) or are not block FP8. `auto` on a block-FP8
    /// checkpoint: bf16, then W8A8 (how sglang serves it), then f32, then bf16 with eager
    /// attention; elsewhere bf16, f32, bf16 with eager attention. Each after the first only
    /// when the ones before did not pass, so an honest serve costs one or two passes and a
    /// cheat at most four (eight with DSA ties both ways).
    pub fn computes_for(self, fp8: bool) -> &'static [(Compute, AttentionKernel, Fp8Activations)] {
        const A16: Fp8Activations = Fp8Activations::Unquantised;
        const A8: Fp8Activations = Fp8Activations::PerTokenGroup;
        type C = (Compute, AttentionKernel, Fp8Activations);
        const BF16_SDPA: C = (Compute::Bf16, AttentionKernel::Sdpa, A16);
        const BF16_EAGER: C = (Compute::Bf16, AttentionKernel::Eager, A16);
        const F32: C = (Compute::F32, AttentionKernel::Sdpa, A16);
        const W8A8: C = (Compute::Bf16, AttentionKernel::Sdpa, A8);
        match (self, fp8) {
            (Recompute::Auto, false) => &[BF16_SDPA, F32, BF16_EAGER],
            (Recompute::Auto, true) => &[BF16_SDPA, W8A8, F32, BF16_EAGER],
            (Recompute::Bf16, _) => &[BF16_SDPA],
            (Recompute::Bf16Eager, _) => &[BF16_EAGER],
            (Recompute::F32, _) => &[F32],
            (Recompute::W8a8, _) => &[W8A8],
        }
    }

    /// The recomputes run, in order, for an architecture with (`dsa`) or without a DSA
    /// indexer: each of [`Recompute::computes`] with DSA ties lower index first, then (DSA
    /// only) each again with ties higher index first.
    pub fn plan(self, dsa: bool) -> Vec<Numerics> {
        self.plan_for(dsa, false)
    }

    /// [`Recompute::plan_for`] for `model`'s architecture and weights: a checkpoint whose
    /// `quantization_config` names `fp8` (block FP8) also gets the W8A8 recompute under `auto`.
    /// The TOPLOC audit and the cell binding (`cells::recompute`) plan through this one place.
    pub fn plan_for_model(self, model: &Model) -> Vec<Numerics> {
        let cfg = model.config();
        let fp8 = cfg.quantization.as_ref().is_some_and(|q| q.method == "fp8");
        self.plan_for(arch::has_dsa(cfg.kind), fp8)
    }

    /// [`Recompute::plan`] for a checkpoint whose weights are (`fp8`) or are not block FP8
    /// ([`Recompute::computes_for`]).
    pub fn plan_for(self, dsa: bool, fp8: bool) -> Vec<Numerics> {
        let orders: &[TieOrder] = if dsa {
            &[TieOrder::LowerFirst, TieOrder::HigherFirst]
        } else {
            &[TieOrder::LowerFirst]
        };
        orders
            .iter()
            .flat_map(|&dsa_ties| {
                self.computes_for(fp8)
                    .iter()
                    .map(move |&(compute, attention, fp8_activations)| Numerics {
                        compute,
                        attention,
                        dsa_ties,
                        fp8_activations,
                    })
            })
            .collect()
    }
}

/// One recompute's outcome, as listed in [`AuditReport::recomputes`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RecomputeOutcome {
    /// The activation dtype of the recompute.
    pub compute: Compute,
    /// Whose attention rounding it followed (`sdpa` or `eager`).
    pub attention: AttentionKernel,
    /// The order among tied DSA index scores it took.
    pub dsa_ties: TieOrder,
    /// How its products with block-FP8 weights treated their input rows (`w8a16`, or `w8a8`
    /// as sglang serves block-FP8 checkpoints).
    pub fp8_activations: Fp8Activations,
    /// `pass` or `cheat`.
    pub verdict: &'static str,
    /// Its score (mean `exp_mismatches / topk`).
    pub score: Option<f64>,
    /// Its passing judged batches ([`BatchAudit::judged`]).
    pub passing_batches: usize,
    /// The largest `exp_mismatches` of any judged batch.
    pub max_exp_mismatches: u64,
    /// Architectures with a DSA indexer: the (row, layer) pairs whose top-k selection cut
    /// through a tie in this recompute ([`AuditReport::dsa_boundary_ties`]). When 0 (and
    /// `dsa_ties` is lower-first), the same activation dtype with ties higher-first would
    /// compute the same, so it is not run. `None` elsewhere.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dsa_boundary_ties: Option<usize>,
}

impl RecomputeOutcome {
    /// `bf16`, `f32`, `bf16/eager` (eager attention), `bf16/w8a8` (the W8A8 recompute), each
    /// with `/ties-higher-first` where DSA ties were taken higher index first.
    pub fn label(&self) -> String {
        let mut s = self.compute.label().to_string();
        if self.fp8_activations == Fp8Activations::PerTokenGroup {
            s.push_str("/w8a8");
        }
        if self.attention == AttentionKernel::Eager {
            s.push_str("/eager");
        }
        if self.dsa_ties == TieOrder::HigherFirst {
            s.push_str("/ties-higher-first");
        }
        s
    }
}

/// Thresholds of the model spec (PROTOCOL.md §4; defaults of `qwen3.6-35b-a3b`) and the
/// auditor's routing policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct AuditParams {
    /// Proof top-k the commitment must use (`toploc_k`, default 128).
    pub toploc_k: usize,
    /// Largest exponent-mismatch count a passing batch may have (`toploc_v`, default 40).
    pub toploc_v: u64,
    /// Smallest fraction of passing batches for a passing commitment (`toploc_p`, default 0.99).
    pub toploc_p: f64,
    /// How a committed routing trace is checked and replayed.
    pub routing: RoutingPolicy,
}

impl Default for AuditParams {
    fn default() -> Self {
        Self {
            toploc_k: 128,
            toploc_v: 40,
            toploc_p: 0.99,
            routing: RoutingPolicy::default(),
        }
    }
}

/// How the auditor treats a commitment's routing trace (module docs, step 7; docs/AUDITOR.md
/// "Routing").
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct RoutingPolicy {
    /// Absolute part of the near-tie margin ([`arch::Margin`]) in the architecture's score
    /// units (router logits for the Qwen MoEs, `sigmoid + e_score_correction_bias` for GLM);
    /// `None`: the architecture's calibrated default ([`default_routing_margin`]). The relative
    /// part is always [`ROUTING_MARGIN_REL`].
    pub margin: Option<f32>,
    /// Largest fraction of compared (position, MoE layer) cells outside the margin that still
    /// passes; above it the verdict is cheat, whatever TOPLOC says.
    pub max_mismatch_rate: f64,
    /// Whether near-ties are replayed: the recompute dispatches the serve's committed experts
    /// where its own scores put them within the margin.
    pub replay: bool,
    /// The serve offers routing traces (issue 39; docs/PROTOCOL.md §3.10): a trace that is
    /// missing, malformed, of another shape or that does not cover every position
    /// `[0, prompt + n − 1)` makes the verdict cheat instead of "not replayed".
    pub require_trace: bool,
}

impl Default for RoutingPolicy {
    fn default() -> Self {
        Self {
            margin: None,
            max_mismatch_rate: DEFAULT_MAX_ROUTING_MISMATCH_RATE,
            replay: true,
            require_trace: false,
        }
    }
}

/// Default [`RoutingPolicy::max_mismatch_rate`] (calibration: docs/AUDITOR.md "Routing").
pub const DEFAULT_MAX_ROUTING_MISMATCH_RATE: f64 = 0.01;

/// The calibrated absolute near-tie margin of an architecture, in its score units
/// (docs/design/routing.md: about twice the largest gap of an honest bf16 transformers serve
/// under a replayed bf16 recompute, `tests/vectors/routing-oracle`).
pub fn default_routing_margin(kind: arch::ArchKind) -> f32 {
    match kind {
        arch::ArchKind::Qwen3Moe => 0.1,
        arch::ArchKind::Qwen3_5Moe => 0.125,
        arch::ArchKind::GlmMoeDsa => 0.33,
    }
}

/// The relative part of every near-tie margin: 1/64 of the boundary score's magnitude (four
/// bf16 ulps), so that models with larger router scores get proportionally larger margins.
pub const ROUTING_MARGIN_REL: f32 = 1.0 / 64.0;

/// What the routing check found ([`AuditReport::routing`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum RoutingAudit {
    /// Routing could not be replayed: the commitment carries no trace (or none that fits the
    /// model); `reason` says which. The verdict rests on TOPLOC alone.
    NotReplayed {
        /// Why.
        reason: String,
    },
    /// The trace was checked (and near-ties replayed when the policy says so).
    Checked(RoutingSummary),
}

/// The routing check of one recompute.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoutingSummary {
    /// The near-tie margin used.
    pub margin: arch::Margin,
    /// Whether near-ties were replayed.
    pub replay: bool,
    /// Totals over all MoE layers, per (position, layer) cell.
    #[serde(flatten)]
    pub totals: LayerAgreement,
    /// Per token position (over its MoE layers).
    pub tokens: arch::TokenAgreement,
    /// `mismatch / compared` (0 when nothing was compared).
    pub mismatch_rate: f64,
    /// The policy's largest passing rate.
    pub max_mismatch_rate: f64,
    /// The largest gap among the near-ties (0 when there were none): how close the serve came
    /// to the margin.
    pub max_near_tie_gap: f32,
    /// Per MoE layer (layers with compared cells only).
    pub layers: Vec<LayerRouting>,
    /// The first mismatch in (position, layer) order.
    pub first_divergence: Option<Divergence>,
}

/// One layer's row of [`RoutingSummary::layers`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LayerRouting {
    /// Decoder layer index.
    pub layer: usize,
    /// Its counts.
    #[serde(flatten)]
    pub agreement: LayerAgreement,
}

impl RoutingSummary {
    fn of(check: &RoutingCheck, max_mismatch_rate: f64) -> Self {
        let totals = check.totals();
        let mismatch_rate = if totals.compared == 0 {
            0.0
        } else {
            totals.mismatch as f64 / totals.compared as f64
        };
        Self {
            margin: check.margin(),
            replay: check.replay(),
            totals,
            tokens: check.tokens(),
            mismatch_rate,
            max_mismatch_rate,
            max_near_tie_gap: check.near_tie_gaps().iter().copied().fold(0.0, f32::max),
            layers: check
                .layers()
                .iter()
                .enumerate()
                .filter(|(_, a)| a.compared > 0)
                .map(|(layer, &agreement)| LayerRouting { layer, agreement })
                .collect(),
            first_divergence: check.first_divergence().cloned(),
        }
    }

    /// Whether the mismatch rate is above the policy's threshold.
    pub fn is_cheat(&self) -> bool {
        self.mismatch_rate > self.max_mismatch_rate
    }
}

impl AuditParams {
    /// The TOPLOC parameters a commitment audited with `self` is proven with: top-k
    /// `toploc_k`, the commitment's `decode_batching_size`, prefill skipped (PROTOCOL.md §4;
    /// the same as [`Params::ENGY`] at the defaults).
    pub fn proof_params(&self, decode_batching_size: usize) -> Params {
        Params {
            topk: self.toploc_k,
            decode_batching_size,
            skip_prefill: true,
        }
    }
}

/// The audit outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "lowercase")]
pub enum Verdict {
    /// The proofs match the recomputed hidden states within the thresholds.
    Pass,
    /// Well-formed proofs that do not match: the serve's hidden states are not the checkpoint's.
    Cheat,
    /// The commitment could not be checked (malformed or mis-shaped); `reason` says why.
    Unproven {
        /// What is wrong with the commitment.
        reason: String,
    },
}

impl Verdict {
    /// `pass`, `cheat` or `unproven`.
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Cheat => "cheat",
            Verdict::Unproven { .. } => "unproven",
        }
    }
}

/// One decode batch's comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchAudit {
    /// Output rows in the batch.
    pub rows: usize,
    /// Top-k positions whose bf16 exponent differs (0..=topk).
    pub exp_mismatches: u64,
    /// Mean mantissa error (0..=127) over the top-k positions whose exponents match; `None`
    /// (JSON `null`) when no exponent matched, where toploc reports its 2^64 sentinel
    /// ([`toploc::NO_EXPONENT_MATCH`]).
    pub mant_err_mean: Option<f64>,
    /// Upper median of the same; `None` when no exponent matched.
    pub mant_err_median: Option<f64>,
    /// `exp_mismatches <= toploc_v`, and its proof not degenerate ([`degenerate_proof`]).
    pub pass: bool,
    /// Whether the batch counts towards the verdict and the score ([`judged_batch`]).
    pub judged: bool,
}

/// A batch is judged when it holds at least this many times `topk` values (rows × hidden
/// size): the proof's top-k then covers at most a quarter of the batch. A denser top-k reaches
/// into the bulk of the values, where an honest serve's rounding moves exponents: a one-row
/// batch of a model of hidden size 128 puts every value of the row in the top-128. Measured on
/// transformers' honest bf16 serves of the audit oracle's checkpoints (hidden 128;
/// docs/design/recomputes.md): tails of one or two rows reached
/// 55 and 61 exponent mismatches, tails of four rows or more stayed at or below 39 as full
/// batches do, and judging only tails of 16 rows or more would have let 3 more of qwen3_moe's
/// 12 small cheats (`fp8_tensor`) pass. Served models have a hidden size of at least 2,048 = 16 × 128, so
/// there every batch is judged.
pub const SPARSE_TOPK_FACTOR: usize = 4;

/// Whether a batch of `rows` rows of `hidden` values is judged ([`SPARSE_TOPK_FACTOR`]).
pub fn judged_batch(rows: usize, hidden: usize, topk: usize) -> bool {
    rows.saturating_mul(hidden) >= SPARSE_TOPK_FACTOR.saturating_mul(topk)
}

/// What [`audit`] found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditReport {
    /// The verdict (flattened into this object when serialised).
    #[serde(flatten)]
    pub verdict: Verdict,
    /// Mean `exp_mismatches / topk` over batches, in `[0, 1]`; `None` when verification did not
    /// run.
    pub score: Option<f64>,
    /// Prompt tokens (`prompt_ids`, including any `prompt_extra`).
    pub prompt_tokens: usize,
    /// Output rows proven (`n_tokens`).
    pub n_tokens: usize,
    /// Proof bytes (decoded, summed over proofs).
    pub proof_bytes: usize,
    /// Judged batches that passed ([`BatchAudit::judged`]).
    pub passing_batches: usize,
    /// Per-batch results (empty when verification did not run).
    pub batches: Vec<BatchAudit>,
    /// The thresholds applied.
    pub params: AuditParams,
    /// The activation dtype of the recompute whose batches are reported (`None` when
    /// verification did not run): the passing one, else the one with the lowest score.
    pub compute: Option<Compute>,
    /// The attention kernel of that recompute (`None` when verification did not run).
    pub attention: Option<AttentionKernel>,
    /// The DSA tie order of that recompute (`None` when verification did not run).
    pub dsa_ties: Option<TieOrder>,
    /// Architectures with a DSA indexer: the (row, layer) pairs of that recompute whose
    /// top-k selection cut through a tie, where the other tie order keeps another set
    /// ([`arch::Probe::dsa_boundary_ties`]: exact on the CPU, possibly more on a GPU, never
    /// fewer). `None` elsewhere and when verification did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dsa_boundary_ties: Option<usize>,
    /// Every recompute run, in order ([`Recompute`]); empty when verification did not run.
    pub recomputes: Vec<RecomputeOutcome>,
    /// The routing check of the reported recompute (`None` when verification did not run).
    pub routing: Option<RoutingAudit>,
    /// The DSA index-set comparison of the reported recompute (architectures with a DSA
    /// indexer; reported, not part of the verdict: [`crate::index_sets`]). `None` elsewhere
    /// and when verification did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_sets: Option<IndexSetAudit>,
}

impl AuditReport {
    /// Whether the routing check ran and found the serve's routing not the checkpoint's
    /// (a cheat whatever the TOPLOC numbers say).
    fn routing_convicts(&self) -> bool {
        matches!(&self.routing, Some(RoutingAudit::Checked(r)) if r.is_cheat())
    }

    /// The report of a commitment that could not be checked: verdict `unproven` with
    /// `reason`, no score, no batches.
    pub fn unproven(reason: impl Into<String>, params: AuditParams) -> Self {
        Self {
            verdict: Verdict::Unproven {
                reason: reason.into(),
            },
            score: None,
            prompt_tokens: 0,
            n_tokens: 0,
            proof_bytes: 0,
            passing_batches: 0,
            batches: Vec::new(),
            params,
            compute: None,
            attention: None,
            dsa_ties: None,
            dsa_boundary_ties: None,
            recomputes: Vec::new(),
            routing: None,
            index_sets: None,
        }
    }
}

/// toploc's mantissa statistic, or `None` for its "no exponent matched" sentinel (2^64,
/// [`toploc::NO_EXPONENT_MATCH`]), which is a marker, not a mean.
fn mantissa_stat(v: f64) -> Option<f64> {
    (v != toploc::NO_EXPONENT_MATCH).then_some(v)
}

/// Audits `commitment` (the §3.10 object, or any object holding it under `"commitment"`, such
/// as a gateway `response` frame) against `model`, whose checkpoint has `model_root`.
///
/// Every problem with the commitment is an [`Verdict::Unproven`] report, never an error.
///
/// # Errors
/// Only the auditor's own failures (a tensor operation failing): [`ModelError::Candle`].
pub fn audit(
    model: &Model,
    model_root: &str,
    commitment: &serde_json::Value,
    params: &AuditParams,
) -> Result<AuditReport, ModelError> {
    audit_computes(
        model,
        model_root,
        commitment,
        params,
        &[model.numerics()],
        None,
    )
}

/// [`audit`] with the recomputes `recompute` names (module docs, step 6): each is `model`'s
/// checkpoint and weights with another activation dtype ([`Model::with_compute`]); the first
/// that passes gives the verdict, otherwise the commitment is a cheat and the recompute with
/// the lowest score is the one reported. All that ran are listed in
/// [`AuditReport::recomputes`].
///
/// # Errors
/// As [`audit`], and [`ModelError::Config`] when `model` cannot be reloaded in another dtype
/// ([`Model::with_compute`]).
pub fn audit_with(
    model: &Model,
    model_root: &str,
    commitment: &serde_json::Value,
    params: &AuditParams,
    recompute: Recompute,
) -> Result<AuditReport, ModelError> {
    audit_with_routing(model, model_root, commitment, params, recompute, None)
}

/// [`audit_with`] with the serve's routing given apart from the commitment (`routing`; when
/// `None`, the commitment's own trace, if it carries one). Each recompute checks the trace
/// and, per `params.routing`, replays its near-ties (module docs, step 7).
///
/// # Errors
/// As [`audit_with`].
pub fn audit_with_routing(
    model: &Model,
    model_root: &str,
    commitment: &serde_json::Value,
    params: &AuditParams,
    recompute: Recompute,
    routing: Option<CommittedRouting>,
) -> Result<AuditReport, ModelError> {
    let plan = recompute.plan_for_model(model);
    audit_computes(model, model_root, commitment, params, &plan, routing)
}

fn audit_computes(
    model: &Model,
    model_root: &str,
    commitment: &serde_json::Value,
    params: &AuditParams,
    plan: &[Numerics],
    routing: Option<CommittedRouting>,
) -> Result<AuditReport, ModelError> {
    match checked_commitment(model, model_root, commitment, params, routing) {
        Err(report) => Ok(*report),
        Ok(checked) => run_plan(model, &checked, *params, plan, None),
    }
}

/// [`audit_with`] for several commitments of one model, their first recompute in one pass
/// over the weights ([`Model::hidden_states_probed_many`]: with streamed weights, each layer
/// read and decoded once for all of them). Each report is exactly what [`audit_with`] gives
/// for that commitment alone; a commitment whose first recompute does not pass runs the
/// rest of the plan alone. A pass that runs out of device memory runs again as two passes
/// over halves of the batch, and so on down to one commitment ([`crate::device::batch_splits`]
/// counts the splits), which, still out of memory, runs once more without the kept weights
/// as it does alone. Reports come back in the order of `commitments`.
///
/// # Errors
/// As [`audit_with`], for any of the commitments: one recompute's error fails the batch
/// (out of device memory, only when one commitment does not fit even without the kept
/// weights), so a caller wanting each commitment's own error audits them one by one then.
pub fn audit_many(
    model: &Model,
    model_root: &str,
    commitments: &[serde_json::Value],
    params: &AuditParams,
    recompute: Recompute,
) -> Result<Vec<AuditReport>, ModelError> {
    let p = *params;
    let plan = recompute.plan_for_model(model);
    let prepared: Vec<Result<Checked, Box<AuditReport>>> = commitments
        .iter()
        .map(|c| checked_commitment(model, model_root, c, params, None))
        .collect();
    let Some(&first) = plan.first() else {
        return Ok(prepared
            .into_iter()
            .map(|r| match r {
                Err(report) => *report,
                Ok(_) => AuditReport::unproven("no recompute was requested", p),
            })
            .collect());
    };
    let sibling;
    let m = if first == model.numerics() {
        model
    } else {
        sibling = model.with_numerics(first)?;
        &sibling
    };
    let checked: Vec<&Checked> = prepared.iter().filter_map(|r| r.as_ref().ok()).collect();
    let mut firsts = verify_many_fitting(model, m, &checked, p)?.into_iter();
    let mut out = Vec::with_capacity(commitments.len());
    for r in &prepared {
        out.push(match r {
            Err(report) => (**report).clone(),
            Ok(c) => {
                let Some(report) = firsts.next() else {
                    return Err(ModelError::Config(
                        "a batched recompute returned fewer reports than commitments".into(),
                    ));
                };
                run_plan(model, c, p, &plan, Some(report))?
            }
        });
    }
    Ok(out)
}

/// The commitment parsed and checked against the model ([`check_shape`]) with the routing
/// to check (`routing`, else the commitment's own trace), or the unproven report saying why
/// it cannot be audited.
fn checked_commitment(
    model: &Model,
    model_root: &str,
    commitment: &serde_json::Value,
    params: &AuditParams,
    routing: Option<CommittedRouting>,
) -> Result<Checked, Box<AuditReport>> {
    let p = *params;
    let value = match commitment.get("commitment") {
        Some(inner) if commitment.get("toploc").is_none() => inner,
        _ => commitment,
    };
    if value.is_null() {
        return Err(Box::new(AuditReport::unproven("the commitment is null", p)));
    }
    let c: Commitment = match serde_json::from_value(value.clone()) {
        Ok(c) => c,
        Err(e) => {
            return Err(Box::new(AuditReport::unproven(
                format!("malformed commitment: {e}"),
                p,
            )))
        }
    };
    let mut checked = match check_shape(model, model_root, &c, &p) {
        Ok(checked) => checked,
        Err(reason) => return Err(Box::new(AuditReport::unproven(reason, p))),
    };
    checked.routing = match routing {
        Some(r) => fits_model(model, r),
        None => committed_routing(model, &c),
    };
    Ok(checked)
}

/// Runs the recomputes of `plan` on `checked` until one passes (module docs, step 6);
/// `first`: the report of `plan[0]`, when it was computed already (a batched pass).
fn run_plan(
    model: &Model,
    checked: &Checked,
    p: AuditParams,
    plan: &[Numerics],
    mut first: Option<AuditReport>,
) -> Result<AuditReport, ModelError> {
    let mut best: Option<AuditReport> = None;
    let mut outcomes = Vec::with_capacity(plan.len());
    for &n in plan {
        // Ties higher-first change a pass only where a selection cut through a tie: when the
        // same numerics' lower-first pass counted none, this one would compute the same.
        let redundant = n.dsa_ties == TieOrder::HigherFirst
            && outcomes.iter().any(|o: &RecomputeOutcome| {
                (o.compute, o.attention, o.fp8_activations)
                    == (n.compute, n.attention, n.fp8_activations)
                    && o.dsa_ties == TieOrder::LowerFirst
                    && o.dsa_boundary_ties == Some(0)
            });
        if redundant {
            continue;
        }
        let report = match first.take() {
            Some(report) => report,
            None => {
                let sibling;
                let m = if n == model.numerics() {
                    model
                } else {
                    sibling = model.with_numerics(n)?;
                    &sibling
                };
                let dev = m.options().device.device()?;
                if !outcomes.is_empty() {
                    // The memory the last recompute's sizes left free, for this one's. Only
                    // housekeeping: a driver without memory pools cannot trim, and the audit
                    // goes on.
                    let _ = crate::device::release_pool(&dev);
                }
                let run =
                    || crate::device::phase(&dev, recompute_phase(n), || verify(m, checked, p));
                match run() {
                    // A resident GPU model keeps its bf16 weights (70 GB for a 35B model on an
                    // 80 GB card); the f32 and W8A8 recomputes that follow a failed bf16 one
                    // decode theirs per layer beside them, and at real shape that can exceed
                    // the card.
                    Err(e) if e.is_out_of_device_memory() => {
                        again_after_oom(e, run, || free_kept_weights(model, &dev))?
                    }
                    r => r?,
                }
            }
        };
        if matches!(report.verdict, Verdict::Unproven { .. }) {
            return Ok(report);
        }
        outcomes.push(RecomputeOutcome {
            compute: n.compute,
            attention: n.attention,
            dsa_ties: n.dsa_ties,
            fp8_activations: n.fp8_activations,
            verdict: report.verdict.label(),
            score: report.score,
            passing_batches: report.passing_batches,
            max_exp_mismatches: report
                .batches
                .iter()
                .filter(|b| b.judged)
                .map(|b| b.exp_mismatches)
                .max()
                .unwrap_or(0),
            dsa_boundary_ties: report.dsa_boundary_ties,
        });
        let passed = report.verdict == Verdict::Pass;
        let better = match &best {
            None => true,
            Some(b) => report.score.unwrap_or(1.0) < b.score.unwrap_or(1.0),
        };
        if passed || better {
            best = Some(report);
        }
        if passed {
            break;
        }
    }
    let Some(mut report) = best else {
        return Ok(AuditReport::unproven("no recompute was requested", p));
    };
    // The W8A8 serving-noise rule, for a cheat found by the numbers alone (a routing
    // mismatch or a withheld trace convicts on its own).
    if report.verdict == Verdict::Cheat
        && !report.routing_convicts()
        && !trace_withheld(checked, &p)
    {
        let judged = report.batches.iter().filter(|b| b.judged).count();
        let noise = if proofs_as_built(checked, &p) {
            w8a8_noise(&outcomes, p.toploc_k, judged)
        } else {
            None
        };
        if let Some(reason) = noise {
            report.verdict = Verdict::Unproven { reason };
        }
    }
    report.recomputes = outcomes;
    Ok(report)
}

/// The [`crate::device::phase`] one recompute of `auto`'s plan is timed under with
/// `ENGY_PROFILE` set, so that a profile splits an audit's time per recompute (the DSA tie
/// orders of one recompute add up under one name).
fn recompute_phase(n: Numerics) -> &'static str {
    match (n.fp8_activations, n.compute, n.attention) {
        (Fp8Activations::PerTokenGroup, _, _) => "recompute: bf16/w8a8",
        (_, Compute::F32, _) => "recompute: f32",
        (_, _, AttentionKernel::Eager) => "recompute: bf16/eager",
        _ => "recompute: bf16",
    }
}

/// The commitment's routing trace, checked against the model ([`fits_model`]), or why there is
/// none to replay.
fn committed_routing(model: &Model, c: &Commitment) -> Result<CommittedRouting, String> {
    let Some(trace) = &c.routing else {
        return Err("the commitment carries no routing trace".into());
    };
    if trace.padded {
        return Err("the routing trace is padded (unused slots); routing has none".into());
    }
    let d = trace
        .decode()
        .map_err(|e| format!("the routing trace cannot be read: {e}"))?;
    let Some(shape) = model.routing_shape() else {
        return Err("the model has no MoE layers".into());
    };
    let ids = d
        .ids
        .iter()
        .map(|&e| u32::try_from(e).unwrap_or(u32::MAX))
        .collect();
    let start = usize::try_from(d.start).map_err(|_| "the trace starts past usize".to_string())?;
    fits_model(
        model,
        CommittedRouting {
            start,
            shape: crate::arch::RoutingShape {
                layers: d.layers,
                top_k: d.width,
                ..shape
            },
            ids,
        },
    )
}

/// `r` when its shape is the model's routing shape, else why it cannot be replayed.
fn fits_model(model: &Model, r: CommittedRouting) -> Result<CommittedRouting, String> {
    let Some(shape) = model.routing_shape() else {
        return Err("the model has no MoE layers".into());
    };
    if (r.shape.layers, r.shape.top_k) != (shape.layers, shape.top_k) {
        return Err(format!(
            "the trace is [rows, {}, {}], the model routes [rows, {}, {}]",
            r.shape.layers, r.shape.top_k, shape.layers, shape.top_k
        ));
    }
    if !r.ids.len().is_multiple_of(shape.per_position().max(1)) {
        return Err(format!(
            "the trace holds {} ids, not a whole number of [{}, {}] rows",
            r.ids.len(),
            shape.layers,
            shape.top_k
        ));
    }
    Ok(CommittedRouting { shape, ..r })
}

/// A commitment that passed the shape checks.
struct Checked {
    prompt: Vec<u32>,
    output: Vec<u32>,
    proofs: Vec<ProofPoly>,
    proof_bytes: usize,
    params: Params,
    /// The serve's routing to check, or why there is none.
    routing: Result<CommittedRouting, String>,
    /// The serve's DSA index sets (`indexer_topk`), when it sent them.
    indexer_topk: Option<engy_core::trace::Trace>,
}

fn ids_in_vocab(ids: &[u32], vocab: usize, what: &str) -> Result<Vec<u32>, String> {
    ids.iter()
        .enumerate()
        .map(|(i, &id)| {
            if (id as usize) < vocab {
                Ok(id)
            } else {
                Err(format!(
                    "{what}[{i}] = {id} is outside the vocabulary (size {vocab})"
                ))
            }
        })
        .collect()
}

fn check_shape(
    model: &Model,
    model_root: &str,
    c: &Commitment,
    p: &AuditParams,
) -> Result<Checked, String> {
    let cfg = model.config();
    if c.model_root != model_root {
        return Err(format!(
            "model_root {:?} is not the checkpoint's {model_root}: the commitment is of another \
             model, or the checkpoint folder is not the one served (model_root covers \
             config.json's bytes and every *.safetensors file's name and size, PROTOCOL.md §4)",
            c.model_root
        ));
    }
    let t = &c.toploc;
    if !t.skip_prefill {
        return Err("toploc.skip_prefill is false; engy proofs use skip_prefill = true".into());
    }
    if t.topk != p.toploc_k as u64 {
        return Err(format!(
            "toploc.topk {} differs from the model spec's toploc_k {}",
            t.topk, p.toploc_k
        ));
    }
    let dbs = usize::try_from(t.decode_batching_size)
        .ok()
        .filter(|&d| d > 0)
        .ok_or_else(|| {
            format!(
                "toploc.decode_batching_size {} is invalid",
                t.decode_batching_size
            )
        })?;
    let n = usize::try_from(t.n_tokens).unwrap_or(usize::MAX);
    if n == 0 {
        return Err("toploc.n_tokens is 0: there is nothing to prove".into());
    }
    if n != c.output_token_ids.len() {
        return Err(format!(
            "toploc.n_tokens {n} differs from the {} output_token_ids",
            c.output_token_ids.len()
        ));
    }
    let want_proofs = n.div_ceil(dbs);
    if t.proofs.len() != want_proofs {
        return Err(format!(
            "{} proofs for {n} rows in batches of {dbs} (expected {want_proofs})",
            t.proofs.len()
        ));
    }
    if t.prompt_ids.is_empty() {
        return Err("toploc.prompt_ids is empty".into());
    }
    let prompt = ids_in_vocab(&t.prompt_ids, cfg.vocab_size, "prompt_ids")?;
    let output = ids_in_vocab(&c.output_token_ids, cfg.vocab_size, "output_token_ids")?;
    let positions = prompt.len() + n - 1;
    if positions > cfg.max_position_embeddings {
        return Err(format!(
            "prompt + output is {positions} positions, more than the model's {}",
            cfg.max_position_embeddings
        ));
    }
    let mut proofs = Vec::with_capacity(t.proofs.len());
    let mut proof_bytes = 0;
    for (i, b64) in t.proofs.iter().enumerate() {
        let proof = ProofPoly::from_base64(b64).map_err(|e| format!("proof {i}: {e}"))?;
        if proof.is_null() {
            return Err(format!(
                "proof {i} is a null proof (modulus 0): the miner could not build it"
            ));
        }
        proof_bytes += proof.to_bytes().len();
        proofs.push(proof);
    }
    Ok(Checked {
        prompt,
        output,
        proofs,
        proof_bytes,
        params: p.proof_params(dbs),
        routing: Err("the commitment carries no routing trace".into()),
        indexer_topk: c.indexer_topk.clone(),
    })
}

/// What a recompute pass records for one commitment besides the hidden states.
struct PassRecord {
    /// The routing check, when the commitment carries a trace that fits the model.
    check: Option<RoutingCheck>,
    attended: OwnIndexSets,
    boundary_ties: usize,
}

/// The positions of [`input_of`] whose final hidden states the proofs cover: `(first, n)`,
/// from the last prompt position (it sampled the first output token) for every output token.
fn proven_rows(c: &Checked) -> (usize, usize) {
    (c.prompt.len().saturating_sub(1), c.output.len())
}

/// The ids a teacher-forced recompute of `c` runs: the prompt, then every output token but the
/// last.
fn input_of(c: &Checked) -> Vec<u32> {
    let n = c.output.len();
    let mut input = c.prompt.clone();
    input.extend(c.output.iter().take(n.saturating_sub(1)));
    input
}

/// A probe recording into `rec` what [`judge`] reads.
fn probe_of<'a>(rec: &'a mut PassRecord, dsa: bool, c: &Checked) -> Probe<'a> {
    Probe {
        check: rec.check.as_mut(),
        attended: (dsa && c.indexer_topk.is_some()).then_some(&mut rec.attended),
        dsa_boundary_ties: dsa.then_some(&mut rec.boundary_ties),
        ..Probe::default()
    }
}

fn verify(model: &Model, c: &Checked, p: AuditParams) -> Result<AuditReport, ModelError> {
    let mut rec = pass_record(model, c, p);
    let dsa = arch::has_dsa(model.config().kind);
    let rows = model.hidden_rows_bf16_probed(
        &input_of(c),
        proven_rows(c),
        &mut probe_of(&mut rec, dsa, c),
    )?;
    judge(model, c, p, &rows, rec)
}

/// [`verify`] for several commitments, their recomputes in one pass over the weights.
fn verify_many(
    model: &Model,
    cs: &[&Checked],
    p: AuditParams,
) -> Result<Vec<AuditReport>, ModelError> {
    let dsa = arch::has_dsa(model.config().kind);
    let inputs: Vec<Vec<u32>> = cs.iter().map(|c| input_of(c)).collect();
    let mut recs: Vec<PassRecord> = cs.iter().map(|c| pass_record(model, c, p)).collect();
    let hidden = {
        let mut probes: Vec<Probe<'_>> = recs
            .iter_mut()
            .zip(cs)
            .map(|(rec, c)| probe_of(rec, dsa, c))
            .collect();
        let seqs: Vec<&[u32]> = inputs.iter().map(Vec::as_slice).collect();
        let rows: Vec<(usize, usize)> = cs.iter().map(|c| proven_rows(c)).collect();
        model.hidden_rows_bf16_probed_many(&seqs, &rows, &mut probes)?
    };
    cs.iter()
        .zip(recs)
        .zip(&hidden)
        .map(|((c, rec), h)| judge(model, c, p, h, rec))
        .collect()
}

/// [`verify_many`] on `m` (`model` or its sibling of other numerics), split in halves while
/// the device runs out of memory ([`halving_on_oom`]): a batch larger than the card holds
/// (each commitment adds its residual stream and the layer's activations to the pass) runs
/// as smaller passes, each report still exactly the commitment's own, instead of failing
/// every commitment of the batch. Each split hands the pool back and counts in
/// [`crate::device::batch_splits`]. One commitment that still runs out runs once more without
/// `model`'s kept weights, as it does audited alone ([`run_plan`]).
fn verify_many_fitting(
    model: &Model,
    m: &Model,
    cs: &[&Checked],
    p: AuditParams,
) -> Result<Vec<AuditReport>, ModelError> {
    let dev = m.options().device.device()?;
    halving_on_oom(
        cs,
        &mut |part| verify_many(m, part, p),
        &mut || {
            // Housekeeping only: a driver without memory pools cannot trim.
            let _ = crate::device::release_pool(&dev);
            crate::device::note_batch_split();
        },
        &mut || free_kept_weights(model, &dev),
    )
}

/// Drops the decoded weights `model` and its siblings keep ([`Model::drop_kept_weights`]; the
/// next pass decodes them again: slower, the same values) and hands the pool's free memory
/// back. Counts in [`crate::device::memory_retries`].
fn free_kept_weights(model: &Model, dev: &candle_core::Device) {
    model.drop_kept_weights();
    // Housekeeping only: a driver without memory pools cannot trim.
    let _ = crate::device::release_pool(dev);
    crate::device::note_memory_retry();
}

/// After `first`, an out-of-device-memory error: `free`, then `run` once more.
///
/// # Errors
/// `run`'s error, naming `first`.
fn again_after_oom<R>(
    first: ModelError,
    run: impl FnOnce() -> Result<R, ModelError>,
    free: impl FnOnce(),
) -> Result<R, ModelError> {
    free();
    run().map_err(|again| {
        ModelError::Device(format!(
            "{again} (running again without the kept weights, after: {first})"
        ))
    })
}

/// `run` over `items`; where it fails for want of device memory
/// ([`ModelError::is_out_of_device_memory`]) over more than one item, `on_split` and then
/// `run` over each half, the halves split again the same way; over a single item, `free`
/// and `run` once more ([`again_after_oom`]), the retry the item gets alone. The results come
/// in the order of `items`, whichever sizes ran.
///
/// # Errors
/// Any other error of `run`, and running out of memory over a single item twice.
fn halving_on_oom<T, R, F, S, D>(
    items: &[T],
    run: &mut F,
    on_split: &mut S,
    free: &mut D,
) -> Result<Vec<R>, ModelError>
where
    F: FnMut(&[T]) -> Result<Vec<R>, ModelError>,
    S: FnMut(),
    D: FnMut(),
{
    match run(items) {
        Err(e) if items.len() > 1 && e.is_out_of_device_memory() => {
            on_split();
            let (first, second) = items.split_at(items.len() / 2);
            let mut out = halving_on_oom(first, run, on_split, free)?;
            out.extend(halving_on_oom(second, run, on_split, free)?);
            Ok(out)
        }
        Err(e) if e.is_out_of_device_memory() => again_after_oom(e, || run(items), free),
        r => r,
    }
}

/// The routing check a pass over `c` runs, with the policy's margin.
fn pass_record(model: &Model, c: &Checked, p: AuditParams) -> PassRecord {
    let margin = arch::Margin {
        abs: p
            .routing
            .margin
            .unwrap_or_else(|| default_routing_margin(model.config().kind)),
        rel: ROUTING_MARGIN_REL,
    };
    PassRecord {
        check: c
            .routing
            .as_ref()
            .ok()
            .map(|r| RoutingCheck::new(r.clone(), margin, p.routing.replay)),
        attended: OwnIndexSets::new(),
        boundary_ties: 0,
    }
}

/// The report of one recompute of `c` from its proven rows (bf16 bits of the final hidden
/// states at [`proven_rows`]) and what the pass recorded.
fn judge(
    model: &Model,
    c: &Checked,
    p: AuditParams,
    rows: &[Vec<u16>],
    rec: PassRecord,
) -> Result<AuditReport, ModelError> {
    let n = c.output.len();
    let dsa = arch::has_dsa(model.config().kind);
    let PassRecord {
        check,
        attended,
        boundary_ties,
    } = rec;
    let index_sets = dsa.then(|| match &c.indexer_topk {
        None => IndexSetAudit::NotCompared {
            reason: "the commitment carries no indexer_topk trace".into(),
        },
        Some(t) => match index_sets::compare(t, &attended) {
            Ok(s) => IndexSetAudit::Compared(s),
            Err(reason) => IndexSetAudit::NotCompared { reason },
        },
    });
    let routing = match (&check, &c.routing) {
        (Some(ch), _) => {
            let summary = RoutingSummary::of(ch, p.routing.max_mismatch_rate);
            if summary.totals.compared == 0 {
                // A trace whose positions miss the proven ones checked nothing: say so, not
                // "0/0 cells agree".
                RoutingAudit::NotReplayed {
                    reason: "the routing trace covers no (position, MoE layer) cell of this \
                             commitment"
                        .into(),
                }
            } else {
                RoutingAudit::Checked(summary)
            }
        }
        (None, Err(reason)) => RoutingAudit::NotReplayed {
            reason: reason.clone(),
        },
        (None, Ok(_)) => RoutingAudit::NotReplayed {
            reason: "the routing check did not run".into(),
        },
    };
    // A damaged checkpoint (NaN or infinite weights, or bytes that overflow) is the
    // auditor's fault, not the miner's: no verdict on it (ModelError::NonFinite).
    // A bf16 value is not finite when its exponent bits are all ones (inf or NaN).
    if let Some(i) = rows
        .iter()
        .position(|r| r.iter().any(|&b| b & 0x7F80 == 0x7F80))
    {
        return Err(ModelError::NonFinite {
            position: proven_rows(c).0 + i,
        });
    }
    let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
    let mut report = AuditReport {
        verdict: Verdict::Pass,
        score: None,
        prompt_tokens: c.prompt.len(),
        n_tokens: n,
        proof_bytes: c.proof_bytes,
        passing_batches: 0,
        batches: Vec::new(),
        params: p,
        compute: Some(model.compute()),
        attention: Some(model.options().attention),
        dsa_ties: Some(model.options().dsa_ties),
        dsa_boundary_ties: dsa.then_some(boundary_ties),
        recomputes: Vec::new(),
        routing: Some(routing),
        index_sets,
    };
    let results = match toploc::verify_proofs(&elements, Dtype::Bf16, &c.proofs, &c.params) {
        Ok(r) => r,
        Err(e) => {
            report.verdict = Verdict::Unproven {
                reason: format!("TOPLOC verification rejected the proofs: {e}"),
            };
            return Ok(report);
        }
    };
    let dbs = c.params.decode_batching_size;
    let hidden = model.config().hidden_size;
    let rows_of = |i: usize| n.saturating_sub(i * dbs).min(dbs);
    // When no batch is large enough to judge, all are judged: there is nothing better.
    let any_judged = (0..results.len()).any(|i| judged_batch(rows_of(i), hidden, c.params.topk));
    for (i, r) in results.iter().enumerate() {
        let rows = rows_of(i);
        let built = c
            .proofs
            .get(i)
            .is_some_and(|q| !degenerate_proof(q, c.params.topk));
        let pass = r.exp_mismatches <= p.toploc_v && built;
        let judged = !any_judged || judged_batch(rows, hidden, c.params.topk);
        report.passing_batches += usize::from(pass && judged);
        report.batches.push(BatchAudit {
            rows,
            exp_mismatches: r.exp_mismatches,
            mant_err_mean: mantissa_stat(r.mant_err_mean),
            mant_err_median: mantissa_stat(r.mant_err_median),
            pass,
            judged,
        });
    }
    let judged: Vec<&BatchAudit> = report.batches.iter().filter(|b| b.judged).collect();
    let nb = judged.len().max(1) as f64;
    let topk = p.toploc_k.max(1) as f64;
    report.score = Some(
        judged
            .iter()
            .map(|b| b.exp_mismatches as f64 / topk)
            .sum::<f64>()
            / nb,
    );
    let ratio = report.passing_batches as f64 / nb;
    let routing_cheat = report.routing_convicts();
    let trace_withheld = trace_withheld(c, &p);
    report.verdict = if ratio >= p.toploc_p && !routing_cheat && !trace_withheld {
        Verdict::Pass
    } else {
        Verdict::Cheat
    };
    Ok(report)
}

/// Whether a batch's proof is one no honest build makes (PROTOCOL.md §5): a modulus below
/// `topk` (which cannot keep `topk` positions distinct) or a constant polynomial (every
/// coefficient after the first zero: the same value at every position, which an honest build
/// gives only when all `topk` top values of the batch have one bit pattern). The verdict
/// rule compares exponents only, so a constant proof at the exponent most of a model's top
/// values share matched them all: a forged proof passed. Such a batch never passes.
fn degenerate_proof(q: &ProofPoly, topk: usize) -> bool {
    usize::from(q.modulus) < topk || q.coeffs.iter().skip(1).all(|&c| c == 0)
}

/// How the reason of an `unproven` verdict given by the W8A8 serving-noise rule begins
/// (docs/PROTOCOL.md §5.1): the serve quantised its activations as W8A8 does and no
/// recompute explains it, which TOPLOC cannot tell from a weight swap.
pub const W8A8_NOISE: &str = "W8A8 serving noise";

/// A serve that offers routing traces and sent none, a bad one or a short one (issue 39):
/// a cheat whatever the numbers say.
fn trace_withheld(c: &Checked, p: &AuditParams) -> bool {
    let trace_whole = c.routing.as_ref().is_ok_and(|r| {
        r.start == 0 && r.rows() >= c.prompt.len() + c.output.len().saturating_sub(1)
    });
    p.routing.require_trace && !trace_whole
}

/// Whether the commitment's proofs are shaped as an honest miner's build makes them
/// (PROTOCOL.md §3.8, `engy_core::toploc::build_proofs`): engy's decode batching size, and
/// per batch a polynomial through its `toploc_k` top values (exactly `toploc_k`
/// coefficients, a modulus of at least `toploc_k`, under which they are distinct). The W8A8
/// serving-noise band is for honest serves, whose proofs always are; a miner who sends a
/// constant polynomial (modulus 1, one coefficient: the same exponent at every position) or
/// picks its own batching (one batch: the widest band) gets no benefit of the doubt.
fn proofs_as_built(c: &Checked, p: &AuditParams) -> bool {
    let k = p.toploc_k;
    c.params.decode_batching_size == Params::ENGY.decode_batching_size
        && c.proofs
            .iter()
            .all(|q| q.coeffs.len() == k && usize::from(q.modulus) >= k)
}

/// How many standard errors an unquantised recompute must be closer than the W8A8 one for
/// the W8A8 serving-noise rule to leave a cheat standing ([`w8a8_noise`], docs/PROTOCOL.md
/// §5.1): 3, a one-sided false-flag chance of about 0.13 % a commitment for an honest W8A8
/// serve whose comparison carries no signal, for one comparison of binomial counts (the least
/// of three unquantised recomputes and over-dispersed batches raise it, to a few tenths of a
/// percent), under the 1 % cheat rate §8's gate needs.
pub const W8A8_NOISE_Z: f64 = 3.0;

/// How many standard errors below chance the W8A8 recompute's mean must be for the W8A8
/// serving-noise band to apply ([`w8a8_noise`]): 1. The line protects the band from a serve of
/// another model, which sits near chance: random rows in place of honest W8A8 serves of the
/// small W8A8 fixture are convicted in 5 of 12 commitments (tests/w8a8.rs), far above §8's
/// 1 % gate, while an honest serve is flagged only if it is itself indistinguishable from
/// chance (a checkpoint where TOPLOC flags honest bf16 serves too).
pub const W8A8_CHANCE_Z: f64 = 1.0;

/// Why a commitment that no recompute explains is not judged a cheat: the W8A8 serving-noise
/// rule (docs/PROTOCOL.md §5.1, docs/design/w8a8.md "On a GPU").
///
/// On a GPU, an honest W8A8 serve of a block-FP8 checkpoint (sglang's numerics: every FP8
/// product's input rows quantised to e4m3 per token and per 128-group) lands further from
/// every recompute than TOPLOC's limits, which were set for bf16 serves, allow: a one-ulp
/// difference in a bf16 activation flips its e4m3 rounding (an error 32 times larger) and the
/// flips compound through the layers. Measured on an H100 (bench/RESULTS.md "W8A8 serves on
/// a GPU"), honest W8A8 serves reach 51–87 exponent mismatches in a batch against the W8A8
/// recompute (the limit is 40), 118–125 at 40 layers of real width, as far as serves with
/// 4-bit weights, so no limit on the W8A8 recompute separates them. What separates them is a
/// comparison: every such serve is closer, in its mean mismatches a batch, to the W8A8
/// recompute than to any recompute with unquantised activations (by 6 to 31 at 8 layers, by
/// 1 to 3 at 40 where every serve nears chance), while a serve with bf16 activations and other
/// weights (int4, W4A16) is closer to an unquantised one.
///
/// The cheat stands only when the closest unquantised recompute's mean `u` is below the W8A8
/// recompute's `w` by at least [`W8A8_NOISE_Z`] standard errors of that difference,
/// `u ≤ w − Z·√(2·k·q·(1−q)/n)` (`k` the proof top-k, `n` the judged batches, `q` the two
/// means' average share of `k`, kept at least half a mismatch from 0 and from `k`: each
/// mean is of `n` binomial counts of `k`). Otherwise (the W8A8 recompute closer, a tie, or a
/// difference within the noise, as when deep serves near chance) the serve may be an honest
/// W8A8 one and TOPLOC cannot tell its noise from a weight swap: the verdict is `unproven`
/// with this reason, and the cell audit (each product checked on its own, in W8A8) and the
/// routing replay are what can convict. A serve that swaps weights and also quantises its
/// activations escapes TOPLOC this way.
///
/// One more condition keeps a serve that computed something else entirely from hiding in that
/// band: the W8A8 recompute must explain it better than chance,
/// `w ≤ k·p₀ − Z_c·√(k·p₀·(1−p₀)/n)` ([`W8A8_CHANCE_Z`]) with `p₀ = 1 − 2⁻⁸` (at a position
/// of the recompute's top-k that the serve did not commit, the proof's value is noise and its
/// 8-bit exponent field matches by chance one time in 256). Honest W8A8 serves mismatch far
/// less (means of 118–122 of 128 at 40 layers of random weights, single batches up to 126,
/// where the line is 126.8 for one batch and 127.15 for four); a serve of another model,
/// which shares none of the checkpoint's top positions, sits near chance (126.7–127.4
/// measured) and is convicted in many of its commitments. The caller applies the band only to proofs shaped as an honest build makes
/// them ([`proofs_as_built`]). `None` (the cheat stands) otherwise, or when the W8A8
/// recompute or an unquantised one did not run, or `batches` is 0.
fn w8a8_noise(outcomes: &[RecomputeOutcome], topk: usize, batches: usize) -> Option<String> {
    let best = |w8a8: bool| {
        outcomes
            .iter()
            .filter(|o| (o.fp8_activations == Fp8Activations::PerTokenGroup) == w8a8)
            .filter_map(|o| o.score)
            .min_by(f64::total_cmp)
    };
    let (w, u) = (best(true)?, best(false)?);
    if batches == 0 {
        return None;
    }
    let k = topk.max(1) as f64;
    let half = 0.5 / k;
    let q = ((w + u) / 2.0).clamp(half, 1.0 - half);
    let se = (2.0 * k * q * (1.0 - q) / batches as f64).sqrt();
    let (w, u) = (w * k, u * k);
    let p0 = 1.0 - 1.0 / 256.0;
    let chance = k * p0 - W8A8_CHANCE_Z * (k * p0 * (1.0 - p0) / batches as f64).sqrt();
    (u > w - W8A8_NOISE_Z * se && w <= chance).then(|| {
        format!(
            "{W8A8_NOISE}: no recompute passes, and the serve is not closer to any recompute \
             with unquantised activations (best mean {u:.1} exponent mismatches a batch) than \
             to the W8A8 one ({w:.1}) by {W8A8_NOISE_Z} standard errors ({:.1}); TOPLOC cannot \
             judge a W8A8 serve on a GPU, the cell audit can (PROTOCOL.md §5.1)",
            W8A8_NOISE_Z * se
        )
    })
}

/// A commitment made the way an honest miner makes it (PROTOCOL.md §3.4–§3.10) from one greedy
/// generation on `model`: the decode rows (the last row of each step), bf16, TOPLOC proofs with
/// `params`. For tests and the devnet's self-check; the miner builds its own from the serve's
/// HTTP answer.
///
/// # Errors
/// [`ModelError`] from decoding; [`ModelError::Config`] when the proofs cannot be built (for
/// example `topk` larger than a batch).
pub fn commit_greedy(
    model: &Model,
    model_root: &str,
    prompt_ids: &[u32],
    max_new: usize,
    stop: &[u32],
    params: &Params,
) -> Result<serde_json::Value, ModelError> {
    let steps = model.generate(prompt_ids, max_new, stop)?;
    let rows: Vec<Vec<u16>> = steps
        .iter()
        .filter_map(|s| s.hidden.last())
        .map(|r| toploc::f32_to_bf16_bits_slice(r))
        .collect();
    let output: Vec<u32> = steps.iter().map(|s| s.token_id).collect();
    commit_rows(model_root, prompt_ids, &output, &rows, params)
}

/// A commitment (PROTOCOL.md §3.10, the schema `engy-audit audit --commitment` reads) from a
/// serve's decode rows: `rows[j]` the bf16 bits of the row that sampled `output_ids[j]`,
/// TOPLOC proofs built with `params` (PROTOCOL.md §3.8), `model_root` as given. What
/// [`commit_greedy`] commits, for rows another serve computed.
///
/// # Errors
/// [`ModelError::Config`] when the proofs cannot be built (for example `topk` larger than a
/// batch).
pub fn commit_rows(
    model_root: &str,
    prompt_ids: &[u32],
    output_ids: &[u32],
    rows: &[Vec<u16>],
    params: &Params,
) -> Result<serde_json::Value, ModelError> {
    let elements: Vec<&[u16]> = rows.iter().map(Vec::as_slice).collect();
    let proofs = toploc::build_proofs_base64(&elements, Dtype::Bf16, params)
        .map_err(|e| ModelError::Config(format!("building TOPLOC proofs: {e}")))?;
    Ok(serde_json::json!({
        "model_root": model_root,
        "output_token_ids": output_ids,
        "toploc": {
            "proofs": proofs,
            "topk": params.topk,
            "decode_batching_size": params.decode_batching_size,
            "skip_prefill": params.skip_prefill,
            "n_tokens": rows.len(),
            "prompt_ids": prompt_ids,
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch the device cannot hold is split in halves until the parts fit, every item
    /// computed once in the end and the results in the items' order; an error that is not
    /// out of memory, or out of memory on one item, is the caller's at once.
    #[test]
    fn a_batch_out_of_device_memory_runs_as_halves_in_order() {
        let oom = || ModelError::Device("CUDA_ERROR_OUT_OF_MEMORY, out of memory".into());
        let items: Vec<u32> = (0..11).collect();
        let mut sizes = Vec::new();
        let mut splits = 0;
        let out = halving_on_oom(
            &items,
            &mut |part: &[u32]| {
                sizes.push(part.len());
                if part.len() > 3 {
                    return Err(oom());
                }
                Ok(part.iter().map(|i| i * 10).collect())
            },
            &mut || splits += 1,
            &mut || panic!("no single item ran out"),
        )
        .unwrap();
        assert_eq!(out, items.iter().map(|i| i * 10).collect::<Vec<_>>());
        // 11 → 5 + 6 → (2 + 3) + (3 + 3).
        assert_eq!(sizes, [11, 5, 2, 3, 6, 3, 3]);
        assert_eq!(splits, 3);

        let mut calls = 0;
        let err = halving_on_oom(
            &items,
            &mut |_: &[u32]| -> Result<Vec<u32>, ModelError> {
                calls += 1;
                Err(ModelError::Device("an illegal address".into()))
            },
            &mut || {},
            &mut || {},
        )
        .unwrap_err();
        assert_eq!(calls, 1, "{err}");

        let mut calls = 0;
        let mut freed = 0;
        let err = halving_on_oom(
            &[7u32],
            &mut |_: &[u32]| -> Result<Vec<u32>, ModelError> {
                calls += 1;
                Err(oom())
            },
            &mut || {},
            &mut || freed += 1,
        )
        .unwrap_err();
        assert!(err.is_out_of_device_memory());
        assert!(err.to_string().contains("running again"), "{err}");
        assert_eq!((calls, freed), (2, 1));
    }

    /// A resident model's kept weights can leave no room for even one commitment's pass:
    /// alone it runs again without them ([`run_plan`]), and in a batch it must too, or the
    /// batch fails where each commitment alone passes.
    #[test]
    fn a_single_commitment_out_of_memory_in_a_batch_runs_again_without_the_kept_weights() {
        let oom = || ModelError::Device("CUDA_ERROR_OUT_OF_MEMORY, out of memory".into());
        // A device of 3 slots, all of them held by the kept weights until they are freed.
        let kept = std::cell::Cell::new(3usize);
        let items: Vec<u32> = (0..4).collect();
        let mut sizes = Vec::new();
        let mut splits = 0;
        let mut freed = 0;
        let out = halving_on_oom(
            &items,
            &mut |part: &[u32]| {
                sizes.push(part.len());
                if part.len() + kept.get() > 3 {
                    return Err(oom());
                }
                Ok(part.iter().map(|i| i + 100).collect())
            },
            &mut || splits += 1,
            &mut || {
                freed += 1;
                kept.set(0);
            },
        )
        .unwrap();
        assert_eq!(out, [100, 101, 102, 103]);
        // 4 → 2 → 1 out of memory, freed, 1 again; then 1 and the second half's 2 fit.
        assert_eq!(sizes, [4, 2, 1, 1, 1, 2]);
        assert_eq!((splits, freed), (2, 1));
    }

    fn outcome(fp8_activations: Fp8Activations, compute: Compute, score: f64) -> RecomputeOutcome {
        RecomputeOutcome {
            compute,
            attention: AttentionKernel::Sdpa,
            dsa_ties: TieOrder::LowerFirst,
            fp8_activations,
            verdict: "cheat",
            score: Some(score),
            passing_batches: 0,
            max_exp_mismatches: 0,
            dsa_boundary_ties: None,
        }
    }

    /// The W8A8 noise rule's comparison (PROTOCOL.md §5.1): the cheat stands only when an
    /// unquantised recompute is closer than the W8A8 one by at least 3 standard errors of the
    /// difference (here, 5 batches of top-128: about 10.7 mismatches a batch near half); a
    /// closer W8A8, a tie, a difference within the noise or two means near chance leave the
    /// serve `unproven`; a W8A8 mean no better than chance (another model's serve), or no W8A8
    /// or unquantised recompute, leaves the cheat.
    #[test]
    fn w8a8_noise_convicts_only_when_an_unquantised_recompute_is_significantly_closer() {
        use Fp8Activations::{PerTokenGroup as W8a8, Unquantised as Plain};
        let k = 128.0;
        let pair = |w: f64, u: f64| {
            [
                outcome(Plain, Compute::Bf16, u / k),
                outcome(W8a8, Compute::Bf16, w / k),
                outcome(Plain, Compute::F32, (u + 5.0).min(k) / k),
            ]
        };
        let reason = w8a8_noise(&pair(64.0, 70.4), 128, 5).unwrap();
        assert!(reason.starts_with(W8A8_NOISE), "{reason}");
        assert!(
            reason.contains("64.0") && reason.contains("70.4"),
            "{reason}"
        );
        // A tie, and an unquantised recompute closer by less than 3 standard errors (10.7).
        assert!(w8a8_noise(&pair(64.0, 64.0), 128, 5).is_some());
        assert!(w8a8_noise(&pair(64.0, 54.0), 128, 5).is_some());
        // Closer by more than 3 standard errors: the cheat stands.
        assert_eq!(w8a8_noise(&pair(64.0, 53.0), 128, 5), None);
        // More batches, a smaller standard error (about 4.8 with 25): 10 is enough.
        assert_eq!(w8a8_noise(&pair(64.0, 54.0), 128, 25), None);
        // Two means near chance (but the W8A8 recompute still better than chance): unproven.
        assert!(w8a8_noise(&pair(125.0, 125.0), 128, 5).is_some());
        // At chance against the W8A8 recompute too (127.5 of 128: another model's serve), or
        // above the chance line (127.18 for 5 batches, 126.79 for one): the cheat stands.
        assert_eq!(w8a8_noise(&pair(127.5, 127.5), 128, 5), None);
        assert_eq!(w8a8_noise(&pair(127.2, 127.9), 128, 5), None);
        assert!(w8a8_noise(&pair(127.1, 127.9), 128, 5).is_some());
        assert_eq!(w8a8_noise(&pair(126.8, 127.9), 128, 1), None);
        assert!(w8a8_noise(&pair(126.0, 126.5), 128, 1).is_some());
        let no_w8a8 = [
            outcome(Plain, Compute::Bf16, 0.5),
            outcome(Plain, Compute::F32, 0.7),
        ];
        assert_eq!(w8a8_noise(&no_w8a8, 128, 5), None);
        let only_w8a8 = [outcome(W8a8, Compute::Bf16, 0.5)];
        assert_eq!(w8a8_noise(&only_w8a8, 128, 5), None);
        assert_eq!(w8a8_noise(&pair(64.0, 70.4), 128, 0), None);
    }
}
