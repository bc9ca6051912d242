//! Routed experts computed in groups: one layer's experts decoded as one stack
//! ([`Weights::stacked`]) and multiplied as batched products, a handful of kernels per layer
//! instead of a dozen per expert. This is how the auditor runs on a GPU (docs/AUDITOR.md "On a
//! GPU"); the CPU keeps the per-expert loop of [`ops::moe_dispatch`], which never decodes an
//! expert no token chose and multiplies few rows straight from the stored bytes.
//!
//! The arithmetic is the loop's, in transformers' order of rounding: per expert
//! `down(round(round(silu(gate x)) * up x))` with every product rounded to the activation dtype
//! ([`ops::swiglu_in`]); then per token the `k` outputs times their routing weights, each
//! product rounded when the model rounds it (`round_products`), summed in f32 in the token's
//! top-k order (transformers' `.sum(dim=1)`). Products run in the stack's dtype: bf16 stacks
//! (a [`Compute::Bf16`] recompute on a GPU) multiply bf16 operands with f32 accumulation, as a
//! bf16 model's `grouped_mm` does. The result is not rounded; the caller rounds the sum as its
//! model does.
use candle_core::{DType, Tensor};

use super::expert_kernels;
use super::grouped_gemm;
use super::ops;
use super::quant;
use super::{Fp8Activations, Weights};
use crate::device::phase;
use crate::{Compute, ModelError, Precision};

/// Experts batched into one product: at most this many per group. Experts are grouped by how
/// many tokens chose them (most first) and each group is padded to its largest count, so
/// groups of similar counts waste little.
const GROUP: usize = 32;

/// The largest routed-expert id [`dispatch`] takes (plus one): ids index a table, and no
/// served architecture has more than a few hundred experts a layer.
const MAX_EXPERT_ID: usize = 1 << 20;

/// The stored names of `proj` (`gate_proj`, …) of `experts`, in that order.
fn names(module: &impl Fn(usize) -> String, experts: &[usize], proj: &str) -> Vec<String> {
    experts
        .iter()
        .map(|e| format!("{}.{proj}.weight", module(*e)))
        .collect()
}

/// Starts reading the stored weights of all `experts` routed experts of one layer
/// (`module(e)` as in [`dispatch`]) in the background ([`Weights::prefetch`]), for a
/// [`dispatch`] of at least `experts / top_k` tokens (which stacks them all). The auditor calls
/// it for layer `l + 1` when layer `l` starts, so the host reads while the GPU computes. Does
/// nothing where [`grouped`] is false, nor for a projection whose stack for a dispatch with
/// `c` and `acts` is kept ([`Weights::holds_stack`]).
pub fn prefetch(
    w: &std::sync::Arc<Weights>,
    module: impl Fn(usize) -> String,
    experts: usize,
    c: Compute,
    acts: Fp8Activations,
) {
    if !grouped(w) || experts == 0 {
        return;
    }
    let all: Vec<usize> = (0..experts).collect();
    for proj in PROJECTIONS {
        let n = names(&module, &all, proj);
        let (_, wc) = stack_rule(w, &module(0), proj, c, acts);
        if w.holds_stack(&n, wc) {
            continue;
        }
        let scales = n.iter().map(|x| format!("{x}_scale_inv")).collect();
        w.prefetch(n);
        w.prefetch(scales);
    }
}

/// Whether `w`'s routed experts are computed in groups ([`dispatch`]): on a GPU, for an
/// unaltered checkpoint (the int4 cheat keeps the per-expert loop).
pub fn grouped(w: &Weights) -> bool {
    !w.device().is_cpu() && !matches!(w.precision(), Precision::Int4 { .. })
}

/// The routed experts of one MoE block on `x` `[T, hidden]`: `choice[t]` lists token `t`'s
/// `(expert, routing weight)` in top-k order; `module(e)` is expert `e`'s tensor prefix
/// (`…mlp.experts.{e}`), whose `gate_proj`/`up_proj` are `[inter, hidden]` and `down_proj`
/// `[hidden, inter]`; `experts` the layer's expert count, when known (with `T·k` at least
/// that, every expert is stacked, as [`prefetch`] reads them; also when the stacks are kept,
/// [`Weights::keeps_stacks`], so that every later pass finds them). Returns
/// `Σ_j weight_j · expert_j(x_t)` `[T, hidden]` f32, unrounded.
///
/// With `acts` [`Fp8Activations::PerTokenGroup`] (the W8A8 recompute), each block-FP8
/// projection multiplies its input rows quantised per token and group
/// ([`quant::act_quant`]) by its exact f32 dequantisation, as [`ops::swiglu_as`] does per
/// expert: `x` quantised once for gate and up, the activated product once for down (both
/// per row, so quantising before or after the rows are gathered is the same).
///
/// # Errors
/// Weight errors ([`Weights::stacked`]) and candle errors.
#[allow(clippy::too_many_arguments)]
pub fn dispatch(
    w: &Weights,
    module: impl Fn(usize) -> String,
    experts: Option<usize>,
    x: &Tensor,
    choice: &[Vec<(usize, f32)>],
    (hidden, inter): (usize, usize),
    c: Compute,
    acts: Fp8Activations,
    round_products: bool,
) -> Result<Tensor, ModelError> {
    let (t, h) = x.dims2()?;
    let dev = x.device().clone();
    // The tokens of each chosen expert (ascending expert id), indexed by id: a few
    // thousand pushes per layer, where a map's lookups cost milliseconds on the host while
    // the GPU waits.
    let ids = choice
        .iter()
        .flatten()
        .map(|&(e, _)| e + 1)
        .max()
        .unwrap_or(0);
    if ids > MAX_EXPERT_ID {
        return Err(ModelError::Shape {
            name: "routed expert id".into(),
            got: vec![ids - 1],
            want: vec![experts.unwrap_or(MAX_EXPERT_ID)],
        });
    }
    let mut per: Vec<Vec<u32>> = vec![Vec::new(); ids];
    for (tok, list) in choice.iter().enumerate() {
        for &(e, _) in list {
            per[e].push(tok as u32);
        }
    }
    let tokens: Vec<(usize, Vec<u32>)> = per
        .into_iter()
        .enumerate()
        .filter(|(_, toks)| !toks.is_empty())
        .collect();
    let k = choice.iter().map(Vec::len).max().unwrap_or(0);
    if tokens.is_empty() || k == 0 {
        return Ok(Tensor::zeros((t, h), DType::F32, &dev)?);
    }
    // How each projection is multiplied: the first chosen expert's format stands for the
    // layer's, and the stacks below hold one format or fail ([`same_rule`]).
    let first = module(tokens[0].0);
    let rule = |proj: &str| stack_rule(w, &first, proj, c, acts);
    // The stack holds every expert when most are chosen (what [`prefetch`] read ahead) or
    // when it is kept, else the chosen ones, in expert order (an id past the layer's experts,
    // from a replayed trace, then fails as a missing tensor).
    let kept = PROJECTIONS.iter().all(|p| w.keeps_stacks(rule(p).1));
    let stacked: Vec<usize> = match experts {
        Some(n) if (t * k >= n || kept) && ids <= n => (0..n).collect(),
        _ => tokens.iter().map(|(e, _)| *e).collect(),
    };
    // Each expert's entry in the stack, indexed by expert id.
    let mut at = vec![0u32; ids];
    for (i, &e) in stacked.iter().enumerate() {
        if let Some(slot) = at.get_mut(e) {
            *slot = i as u32;
        }
    }
    same_rule(w, &module, &stacked, c, acts, &first)?;
    let groups = Quantised {
        gate: rule("gate_proj").0,
        up: rule("up_proj").0,
        down: rule("down_proj").0,
    };
    let mut order = tokens;
    order.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
    // Stacks of f32 weights (the f32 and W8A8 recomputes, never kept) stay FP8 codes on a GPU
    // and each group decodes its own experts ([`Stack::Fp8`]); the rest are decoded stacks.
    let stack = |proj: &str, out: usize, inp: usize| -> Result<Stack, ModelError> {
        let n = names(&module, &stacked, proj);
        let wc = rule(proj).1;
        if wc == Compute::F32 && !w.keeps_stacks(wc) {
            if let Some(st) = w.stacked_fp8(&n, out, inp)? {
                return Ok(Stack::Fp8(st));
            }
        }
        Ok(Stack::Decoded(w.stacked(&n, out, inp, wc)?))
    };
    let (gate, up, down) = phase(&dev, "moe: expert weights", || {
        Ok((
            stack("gate_proj", inter, hidden)?,
            stack("up_proj", inter, hidden)?,
            stack("down_proj", hidden, inter)?,
        ))
    })?;

    // Rows of every expert's output, stacked: expert `order[s]`'s i-th token lands on row
    // `first_row[s] + i`. One grouped GEMM per projection where cuBLAS has it (bf16 stacks
    // on a GPU, [`grouped_gemm`]), else batched products over groups padded to their largest
    // count.
    let (outs, first_row, rows) = phase(&dev, "moe: routed experts: products", || {
        let quantised = groups.gate.is_some() || groups.up.is_some() || groups.down.is_some();
        let segs = match (quantised, &gate, &up, &down) {
            (false, Stack::Decoded(g), Stack::Decoded(u), Stack::Decoded(d)) => {
                segmented(x, &order, &at, [g, u, d], c)?
            }
            _ => None,
        };
        Ok(match segs {
            Some((y, first_row)) => {
                let rows = y.dim(0)?;
                (vec![y], first_row, rows)
            }
            None => padded(x, &order, &at, [&gate, &up, &down], c, groups)?,
        })
    })?;
    phase(&dev, "moe: routed experts: combine", || {
        combine(
            outs,
            &order,
            &first_row,
            rows,
            choice,
            (k, hidden),
            c,
            round_products,
        )
    })
}

/// The weighted sum per token of [`dispatch`] from the experts' output rows `outs`
/// (concatenated: expert `order[s]`'s i-th token on row `first_row[s] + i`, `rows` in all).
#[allow(clippy::too_many_arguments)]
fn combine(
    mut outs: Vec<Tensor>,
    order: &[(usize, Vec<u32>)],
    first_row: &[usize],
    rows: usize,
    choice: &[Vec<(usize, f32)>],
    (k, hidden): (usize, usize),
    c: Compute,
    round_products: bool,
) -> Result<Tensor, ModelError> {
    let t = choice.len();
    let Some(dev) = outs.first().map(|o| o.device().clone()) else {
        return Err(ModelError::Shape {
            name: "routed experts' outputs".into(),
            got: vec![0],
            want: vec![rows],
        });
    };
    // Each expert's slot in `order`, indexed by expert id (a lookup per routed row).
    let ids = order.iter().map(|(e, _)| e + 1).max().unwrap_or(0);
    let mut slot = vec![0usize; ids];
    for (s, (e, _)) in order.iter().enumerate() {
        slot[*e] = s;
    }
    let mut seen = vec![0usize; order.len()];
    let mut pick = vec![rows as u32; t * k];
    let mut wts = vec![0f32; t * k];
    for (tok, list) in choice.iter().enumerate() {
        for (j, &(e, wt)) in list.iter().enumerate() {
            let s = slot[e];
            pick[tok * k + j] = (first_row[s] + seen[s]) as u32;
            seen[s] += 1;
            wts[tok * k + j] = wt;
        }
    }
    // On a GPU in a bf16 recompute, one kernel ([`expert_kernels::combine`]) on the bf16
    // rows of the grouped GEMM.
    if let [y] = outs.as_slice() {
        if y.dtype() == DType::BF16 {
            let round = round_products && c == Compute::Bf16;
            if let Some(out) = expert_kernels::combine(y, &pick, &wts, k, round)? {
                return Ok(out);
            }
            outs = vec![y.to_dtype(DType::F32)?];
        }
    }
    // One zero row at the end for tokens with fewer than `k` choices.
    outs.push(Tensor::zeros((1, hidden), DType::F32, &dev)?);
    let all = Tensor::cat(&outs, 0)?;
    let picked = all
        .index_select(&Tensor::from_vec(pick, t * k, &dev)?, 0)?
        .reshape((t, k, hidden))?;
    let mut weighted = picked.broadcast_mul(&Tensor::from_vec(wts, (t, k, 1), &dev)?)?;
    if round_products {
        weighted = c.round(weighted)?;
    }
    Ok(weighted.sum(1)?)
}

/// The experts of `order` (`(expert, its tokens)`, the stack entry of each expert in `at`) on
/// their tokens' rows of `x`, as one grouped GEMM per projection of the stacks
/// `[gate, up, down]` ([`grouped_gemm::segmented`]): the outputs `[Σ tokens, hidden]` (f32;
/// bf16, the same values, where a bf16 recompute runs the steps around the GEMMs as
/// [`expert_kernels`]), in `order`, and each expert's first row. `None` where the grouped GEMM
/// does not apply.
fn segmented(
    x: &Tensor,
    order: &[(usize, Vec<u32>)],
    at: &[u32],
    [gate, up, down]: [&Tensor; 3],
    c: Compute,
) -> Result<Option<(Tensor, Vec<usize>)>, ModelError> {
    let wd = gate.dtype();
    if x.device().is_cpu() || wd != DType::BF16 || !grouped_gemm::enabled() {
        return Ok(None);
    }
    let mut first_row = Vec::with_capacity(order.len());
    let mut idx = Vec::new();
    let mut segs = Vec::with_capacity(order.len());
    for (e, toks) in order {
        first_row.push(idx.len());
        idx.extend_from_slice(toks);
        segs.push((at[*e] as usize, toks.len()));
    }
    let n = idx.len();
    let gemm = |m: &Tensor, a: &Tensor| {
        phase(x.device(), "moe: routed experts: grouped gemm", || {
            grouped_gemm::segmented(a, m, &segs)
        })
    };
    if c == Compute::Bf16 {
        // The GEMMs' bf16 outputs are the bf16 recompute's rounded products as they are: the
        // steps between them as one kernel each, where they apply.
        if let Some(xs) = expert_kernels::gather_rows_bf16(x, &idx)? {
            let (Some(g), Some(u)) = (gemm(gate, &xs)?, gemm(up, &xs)?) else {
                return Ok(None);
            };
            let Some(act) = expert_kernels::swiglu_bf16(&g, &u)? else {
                return Ok(None);
            };
            return Ok(gemm(down, &act)?.map(|y| (y, first_row)));
        }
    }
    let xs = x
        .index_select(&Tensor::from_vec(idx, n, x.device())?, 0)?
        .to_dtype(wd)?;
    let product = |m: &Tensor, a: &Tensor| -> Result<Option<Tensor>, ModelError> {
        Ok(match gemm(m, a)? {
            Some(y) => Some(c.round(y.to_dtype(DType::F32)?)?),
            None => None,
        })
    };
    let (Some(g), Some(u)) = (product(gate, &xs)?, product(up, &xs)?) else {
        return Ok(None);
    };
    let act = c.round((c.round(ops::silu(&g)?)? * u)?)?;
    Ok(product(down, &act.to_dtype(wd)?)?.map(|y| (y, first_row)))
}

/// One projection's weights for every stacked expert of a layer ([`dispatch`]).
enum Stack {
    /// Decoded, `[experts, out, inp]` in the recompute's dtype ([`Weights::stacked`]).
    Decoded(Tensor),
    /// As stored (block FP8, on a GPU): each group decodes its own experts, f32.
    Fp8(super::fp8_kernels::Fp8Stack),
}

impl Stack {
    /// The weights of stack entries `members` (in that order), `[members.len(), out, inp]`.
    fn members(&self, members: &[u32], dev: &candle_core::Device) -> Result<Tensor, ModelError> {
        Ok(match self {
            Stack::Decoded(t) => {
                let ids = Tensor::from_vec(members.to_vec(), members.len(), dev)?;
                t.index_select(&ids, 0)?
            }
            Stack::Fp8(st) => st.decode(members, DType::F32)?,
        })
    }

    /// The dtype the products multiply in.
    fn dtype(&self) -> DType {
        match self {
            Stack::Decoded(t) => t.dtype(),
            Stack::Fp8(_) => DType::F32,
        }
    }

    /// `out` of `[experts, out, inp]`.
    fn out_dim(&self) -> Result<usize, ModelError> {
        Ok(match self {
            Stack::Decoded(t) => t.dim(1)?,
            Stack::Fp8(st) => st.dims.1,
        })
    }
}

/// How [`dispatch`] multiplies projection `proj` of the expert `module` in a recompute in `c`
/// with `acts`: the activation group its input is quantised by (`Some` under W8A8 for a
/// block-FP8 weight, [`Weights::act_quant_group`]) and the compute its stack is held in
/// (such a projection multiplies the exact f32 dequantisation, as [`Weights::linear_as`];
/// any other the stack of `c`).
fn stack_rule(
    w: &Weights,
    module: &str,
    proj: &str,
    c: Compute,
    acts: Fp8Activations,
) -> (Option<usize>, Compute) {
    let group = match acts {
        Fp8Activations::PerTokenGroup => w.act_quant_group(&format!("{module}.{proj}")),
        Fp8Activations::Unquantised => None,
    };
    (group, if group.is_some() { Compute::F32 } else { c })
}

/// An expert's three projections, in [`dispatch`]'s order.
const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// Checks that every expert of `stacked` is multiplied as `first` is ([`stack_rule`]): under
/// W8A8 a layer whose experts mixed block-FP8 and other weights would have some inputs
/// quantised that the per-expert rule leaves alone. No served checkpoint mixes them; such a
/// layer is an error (no verdict), never a silently different recompute.
///
/// # Errors
/// [`ModelError::Config`] naming the first expert that differs.
fn same_rule(
    w: &Weights,
    module: &impl Fn(usize) -> String,
    stacked: &[usize],
    c: Compute,
    acts: Fp8Activations,
    first: &str,
) -> Result<(), ModelError> {
    if acts == Fp8Activations::Unquantised {
        return Ok(());
    }
    for proj in PROJECTIONS {
        let want = stack_rule(w, first, proj, c, acts);
        if let Some(e) = stacked
            .iter()
            .find(|&&e| stack_rule(w, &module(e), proj, c, acts) != want)
        {
            return Err(ModelError::Config(format!(
                "{}.{proj} is not stored as {first}.{proj} is (block FP8 or not): a layer's \
                 routed experts mix weight formats, which the W8A8 recompute does not model",
                module(*e)
            )));
        }
    }
    Ok(())
}

/// The W8A8 activation group of each projection of [`dispatch`] (`None`: unquantised).
#[derive(Clone, Copy)]
struct Quantised {
    gate: Option<usize>,
    up: Option<usize>,
    down: Option<usize>,
}

/// `x` as a projection quantising by `group` sees it ([`quant::act_quant`]), else as it is.
fn quantised(x: &Tensor, group: Option<usize>) -> Result<Tensor, ModelError> {
    Ok(match group {
        Some(g) => quant::act_quant(x, g)?,
        None => x.clone(),
    })
}

/// The padded path of [`dispatch`]: the experts of `order` in groups of up to [`GROUP`] of
/// similar load, each group's rows padded to its largest count and multiplied as one batched
/// product per projection (each input quantised first where `q` says). Returns the groups'
/// outputs (f32, padded rows included), each expert's first row, and the rows in all.
fn padded(
    x: &Tensor,
    order: &[(usize, Vec<u32>)],
    at: &[u32],
    [gate, up, down]: [&Stack; 3],
    c: Compute,
    q: Quantised,
) -> Result<(Vec<Tensor>, Vec<usize>, usize), ModelError> {
    let (_, h) = x.dims2()?;
    // Per row, so quantised once for every group's gather.
    let (xg, xu) = match (q.gate, q.up) {
        (a, b) if a == b => {
            let xq = quantised(x, a)?;
            (xq.clone(), xq)
        }
        (a, b) => (quantised(x, a)?, quantised(x, b)?),
    };
    let hidden = down.out_dim()?;
    let dev = x.device().clone();
    let mut first_row = vec![0usize; order.len()];
    let mut outs = Vec::with_capacity(order.len().div_ceil(GROUP));
    let mut rows = 0usize;
    for g0 in (0..order.len()).step_by(GROUP) {
        let n = GROUP.min(order.len() - g0);
        let cap = order[g0].1.len();
        let mut idx = Vec::with_capacity(n * cap);
        for (s, (_, toks)) in order[g0..g0 + n].iter().enumerate() {
            first_row[g0 + s] = rows + s * cap;
            idx.extend_from_slice(toks);
            // Padding rows repeat the expert's first token; they are never read back.
            idx.extend(std::iter::repeat_n(toks[0], cap - toks.len()));
        }
        rows += n * cap;
        let idx = Tensor::from_vec(idx, n * cap, &dev)?;
        let rows_of = |x: &Tensor, wd: DType| -> Result<Tensor, ModelError> {
            Ok(x.index_select(&idx, 0)?
                .to_dtype(wd)?
                .reshape((n, cap, h))?)
        };
        let members: Vec<u32> = order[g0..g0 + n].iter().map(|(e, _)| at[*e]).collect();
        let product = |m: &Stack, a: &Tensor| -> Result<Tensor, ModelError> {
            let y = a.matmul(&m.members(&members, &dev)?.transpose(1, 2)?)?;
            Ok(c.round(y.to_dtype(DType::F32)?)?)
        };
        let g = product(gate, &rows_of(&xg, gate.dtype())?)?;
        let u = product(up, &rows_of(&xu, up.dtype())?)?;
        let act = c.round((c.round(ops::silu(&g)?)? * u)?)?;
        let y = product(down, &quantised(&act, q.down)?.to_dtype(down.dtype())?)?;
        outs.push(y.reshape((n * cap, hidden))?);
    }
    Ok((outs, first_row, rows))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{open, LoadOptions};

    /// The arch fixture `case` opened for a recompute in `c`: its weights, hidden size, expert
    /// width and routed experts a layer.
    fn fixture(case: &str, c: Compute) -> (std::sync::Arc<Weights>, usize, usize, usize) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/vectors/arch")
            .join(case);
        let opts = LoadOptions {
            compute: c,
            ..LoadOptions::default()
        };
        let (cfg, w) = open(&dir, &opts).unwrap();
        let inter = cfg.usize_req("moe_intermediate_size").unwrap();
        let experts = cfg.usize_req("num_experts").unwrap();
        (w, cfg.hidden_size, inter, experts)
    }

    /// The grouped dispatch is the per-expert loop (here both on the CPU, f32 stacks), with
    /// uneven expert loads, a token with fewer choices, and both rounding modes.
    #[test]
    fn the_grouped_experts_are_the_per_expert_loop() {
        for c in [Compute::F32, Compute::Bf16] {
            let (w, hidden, inter, experts) = fixture("qwen3_5_moe", c);
            let t = 70;
            let x: Vec<f32> = (0..t * hidden)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let x = c
                .round(Tensor::from_vec(x, (t, hidden), &candle_core::Device::Cpu).unwrap())
                .unwrap();
            // Expert 0 takes every token, the others a few; token 5 has one choice only.
            let choice: Vec<Vec<(usize, f32)>> = (0..t)
                .map(|tok| {
                    let mut l = vec![(0, c.round_f32(0.375))];
                    if tok != 5 {
                        l.push((1 + (tok * 7) % (experts - 1), c.round_f32(0.625)));
                    }
                    l
                })
                .collect();
            let m = "model.layers.0.mlp.experts";
            let module = |e: usize| format!("{m}.{e}");
            let expert =
                |e: usize, rows: &Tensor| ops::swiglu_in(&w, &module(e), rows, hidden, inter, c);
            // Qwen's rounded products, and GLM's f32 sum of unrounded ones.
            for round_products in [true, false] {
                let want = if round_products {
                    ops::moe_dispatch_in(&x, &choice, c, expert).unwrap()
                } else {
                    c.round(ops::moe_dispatch(&x, &choice, expert).unwrap())
                        .unwrap()
                };
                let all = (round_products && c == Compute::Bf16).then_some(experts);
                let got = dispatch(
                    &w,
                    module,
                    all,
                    &x,
                    &choice,
                    (hidden, inter),
                    c,
                    Fp8Activations::Unquantised,
                    round_products,
                );
                let got = c.round(got.unwrap()).unwrap();
                let scale = want.abs().unwrap().max_all().unwrap();
                let scale = scale.to_scalar::<f32>().unwrap();
                let err = (got - &want).unwrap().abs().unwrap().max_all().unwrap();
                let err = err.to_scalar::<f32>().unwrap();
                // f32: summation order only; bf16: one rounding apart is 2^-8 relative.
                let tol = match c {
                    Compute::F32 => 1e-5 * scale,
                    Compute::Bf16 => 8e-3 * scale,
                };
                assert!(
                    scale > 0.0 && err <= tol,
                    "{c:?} round_products {round_products}: off by {err} (scale {scale})"
                );
            }
        }
    }
    /// Under W8A8 the grouped dispatch is the per-expert loop of [`ops::swiglu_as`] (each
    /// expert's rows quantised per token and group, the exact f32 dequantisation multiplied):
    /// the block-FP8 fixture, both rounding modes. And the quantisation is not a no-op here:
    /// the unquantised dispatch gives another answer.
    #[test]
    fn the_grouped_w8a8_experts_are_the_per_expert_loop() {
        let c = Compute::Bf16;
        let (w, hidden, inter, experts) = fixture("qwen3_5_moe_fp8", c);
        let m = "model.layers.0.mlp.experts";
        let module = |e: usize| format!("{m}.{e}");
        assert!(
            w.act_quant_group(&format!("{}.gate_proj", module(0)))
                .is_some(),
            "the fixture's experts are not block FP8"
        );
        let t = 50;
        let x: Vec<f32> = (0..t * hidden)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0)
            .collect();
        let x = c
            .round(Tensor::from_vec(x, (t, hidden), &candle_core::Device::Cpu).unwrap())
            .unwrap();
        let choice: Vec<Vec<(usize, f32)>> = (0..t)
            .map(|tok| {
                vec![
                    (tok % 3, c.round_f32(0.5)),
                    (3 + (tok * 5) % (experts - 3), c.round_f32(0.25)),
                ]
            })
            .collect();
        let acts = Fp8Activations::PerTokenGroup;
        let expert = |e: usize, rows: &Tensor| {
            ops::swiglu_as(&w, &module(e), rows, (hidden, inter), c, acts)
        };
        for round_products in [true, false] {
            let want = if round_products {
                ops::moe_dispatch_in(&x, &choice, c, expert).unwrap()
            } else {
                c.round(ops::moe_dispatch(&x, &choice, expert).unwrap())
                    .unwrap()
            };
            let run = |acts| {
                let y = dispatch(
                    &w,
                    module,
                    Some(experts),
                    &x,
                    &choice,
                    (hidden, inter),
                    c,
                    acts,
                    round_products,
                );
                c.round(y.unwrap()).unwrap()
            };
            let off = |a: &Tensor| {
                let e = (a - &want).unwrap().abs().unwrap().max_all().unwrap();
                e.to_scalar::<f32>().unwrap()
            };
            let scale = want.abs().unwrap().max_all().unwrap();
            let scale = scale.to_scalar::<f32>().unwrap();
            let got = off(&run(acts));
            // f32 summation order, then one bf16 rounding apart at most.
            assert!(
                scale > 0.0 && got <= 8e-3 * scale,
                "round_products {round_products}: off by {got} (scale {scale})"
            );
            let unquantised = off(&run(Fp8Activations::Unquantised));
            assert!(
                unquantised > got,
                "round_products {round_products}: W8A8 {got}, unquantised {unquantised}"
            );
        }
    }
}
