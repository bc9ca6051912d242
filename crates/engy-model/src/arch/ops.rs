//! The f32 building blocks the architectures share, each with transformers' semantics.
//!
//! Shapes: a sequence is `[T, H]` (one batch row); attention heads are `[heads, T, d]`.
//!
//! The `*_in` variants take the activation dtype ([`Compute`]) and round where transformers'
//! module rounds when the model runs in bf16 (every op's output in the model dtype, f32
//! accumulation inside each op; docs/design/recomputes.md). With [`Compute::F32`] they
//! are exactly the plain f32 functions.
use candle_core::{DType, Device, Tensor, D};

use crate::{Compute, ModelError};

use super::norm_kernels::{self, NormRule};
use super::{TieOrder, Weights};

/// `x · Wᵀ`: `x` `[T, in]`, `w` `[out, in]` (nn.Linear without bias) → `[T, out]`.
///
/// # Errors
/// A candle error on mismatched widths.
pub fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(&w.t()?)
}

/// `x · Wᵀ` from the transposed weight `wt` `[in, out]` ([`Weights::projection_t`]).
///
/// # Errors
/// A candle error on mismatched widths.
pub fn linear_t(x: &Tensor, wt: &Tensor) -> candle_core::Result<Tensor> {
    x.matmul(wt)
}

/// RMSNorm whose weight multiplies (Llama / Qwen3 / GLM): `x * rsqrt(mean(x²) + eps) * w`
/// over the last dimension. On a GPU one kernel ([`norm_kernels::rms_norm`], candle's
/// arithmetic bit for bit).
///
/// # Errors
/// A candle error on a shape mismatch.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let rule = NormRule {
        one_plus: false,
        round_normed: false,
        round_out: false,
    };
    norm_by_rule(x, w, eps, rule)
}

/// The RMSNorm `rule` as candle operations, or as one kernel where that applies
/// ([`norm_kernels::rms_norm`]).
fn norm_by_rule(x: &Tensor, w: &Tensor, eps: f64, rule: NormRule) -> candle_core::Result<Tensor> {
    if let Some((_, y)) = norm_kernels::rms_norm(x, None, w, eps, rule)? {
        return Ok(y);
    }
    let round = |t: Tensor, on: bool| if on { Compute::Bf16.round(t) } else { Ok(t) };
    let x = x.contiguous()?;
    let var = x.sqr()?.mean_keepdim(D::Minus1)?;
    let n = round(
        x.broadcast_mul(&(var + eps)?.sqrt()?.recip()?)?,
        rule.round_normed,
    )?;
    let w = if rule.one_plus { (w + 1.0)? } else { w.clone() };
    round(n.broadcast_mul(&w)?, rule.round_out)
}

/// RMSNorm of transformers' Llama-style modules (`LlamaRMSNorm`, `Qwen3MoeRMSNorm`,
/// `DeepseekV3RMSNorm`, `GlmMoeDsaRMSNorm`) in the activation dtype `c`: the row is normalised
/// in f32, rounded to `c`, then multiplied by the weight in `c`
/// (`self.weight * hidden_states.to(input_dtype)`), so bf16 rounds twice.
///
/// # Errors
/// A candle error on a shape mismatch.
pub fn rms_norm_in(x: &Tensor, w: &Tensor, eps: f64, c: Compute) -> candle_core::Result<Tensor> {
    let bf16 = c == Compute::Bf16;
    let rule = NormRule {
        one_plus: false,
        round_normed: bf16,
        round_out: bf16,
    };
    norm_by_rule(x, w, eps, rule)
}

/// Zero-centred RMSNorm (Qwen3.5 / Qwen3-Next `Qwen3_5MoeRMSNorm`):
/// `x * rsqrt(mean(x²) + eps) * (1 + w)`.
///
/// # Errors
/// A candle error on a shape mismatch.
pub fn rms_norm_1p(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    rms_norm_1p_in(x, w, eps, Compute::F32)
}

/// The rule of [`rms_norm_1p_in`] for `c`.
fn rule_1p(c: Compute) -> NormRule {
    NormRule {
        one_plus: true,
        round_normed: false,
        round_out: c == Compute::Bf16,
    }
}

/// [`rms_norm_1p`] in the activation dtype `c`: `Qwen3_5MoeRMSNorm` normalises and multiplies
/// by `1 + w` in f32 (`self._norm(x.float()) * (1.0 + self.weight.float())`) and rounds once
/// (`.type_as(x)`), unlike the Llama-style [`rms_norm_in`].
///
/// # Errors
/// A candle error on a shape mismatch.
pub fn rms_norm_1p_in(x: &Tensor, w: &Tensor, eps: f64, c: Compute) -> candle_core::Result<Tensor> {
    norm_by_rule(x, w, eps, rule_1p(c))
}

/// A residual add and the [`rms_norm_1p_in`] after it: `s = c.round(x + y)` (the residual
/// stream in the activation dtype) and its norm, returned as `(s, norm)`. On a GPU one kernel
/// and one pass ([`norm_kernels::rms_norm`]), the same values as the two steps apart.
///
/// # Errors
/// A candle error on a shape mismatch.
pub fn add_rms_norm_1p_in(
    x: &Tensor,
    y: &Tensor,
    w: &Tensor,
    eps: f64,
    c: Compute,
) -> candle_core::Result<(Tensor, Tensor)> {
    let round_sum = c == Compute::Bf16;
    if let Some((Some(s), n)) = norm_kernels::rms_norm(x, Some((y, round_sum)), w, eps, rule_1p(c))?
    {
        return Ok((s, n));
    }
    let s = c.round((x + y)?)?;
    let n = rms_norm_1p_in(&s, w, eps, c)?;
    Ok((s, n))
}

/// LayerNorm with weight and bias over the last dimension (biased variance).
///
/// # Errors
/// A candle error on a shape mismatch.
pub fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let x = x.contiguous()?;
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_mul(&(var + eps)?.sqrt()?.recip()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

/// A SwiGLU MLP as [`swiglu`] in the activation dtype `c`: each projection's output, the
/// activation and the product are rounded to `c` (transformers' `down_proj(act_fn(gate_proj(x))
/// * up_proj(x))` in a bf16 model).
///
/// # Errors
/// Weight errors and candle errors.
pub fn swiglu_in(
    w: &Weights,
    module: &str,
    x: &Tensor,
    hidden: usize,
    inter: usize,
    c: Compute,
) -> Result<Tensor, ModelError> {
    if c == Compute::F32 {
        return swiglu(w, module, x, hidden, inter);
    }
    let g = c.round(w.linear_in(&format!("{module}.gate_proj"), x, inter, hidden, c)?)?;
    let u = c.round(w.linear_in(&format!("{module}.up_proj"), x, inter, hidden, c)?)?;
    let h = c.round((c.round(silu(&g)?)? * u)?)?;
    Ok(c.round(w.linear_in(&format!("{module}.down_proj"), &h, hidden, inter, c)?)?)
}

/// [`swiglu_in`] as a serve whose products with block-FP8 weights treat their input rows as
/// `acts` says ([`Weights::linear_as`]): with [`super::Fp8Activations::PerTokenGroup`], `x`
/// is quantised once per row for `gate_proj` and `up_proj` and the activated product once for
/// `down_proj` (sglang's fused MoE quantises the expert's input and its `silu(g)·u` the same
/// way). With [`super::Fp8Activations::Unquantised`], exactly [`swiglu_in`].
///
/// # Errors
/// Weight errors and candle errors.
pub fn swiglu_as(
    w: &Weights,
    module: &str,
    x: &Tensor,
    (hidden, inter): (usize, usize),
    c: Compute,
    acts: super::Fp8Activations,
) -> Result<Tensor, ModelError> {
    if acts == super::Fp8Activations::Unquantised {
        return swiglu_in(w, module, x, hidden, inter, c);
    }
    let lin = |name: &str, x: &Tensor, out: usize, inp: usize| {
        w.linear_as(&format!("{module}.{name}"), x, out, inp, c, acts)
    };
    let g = c.round(lin("gate_proj", x, inter, hidden)?)?;
    let u = c.round(lin("up_proj", x, inter, hidden)?)?;
    let h = c.round((c.round(silu(&g)?)? * u)?)?;
    Ok(c.round(lin("down_proj", &h, hidden, inter)?)?)
}

/// `x * sigmoid(x)`.
///
/// # Errors
/// Candle errors only.
pub fn silu(x: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::ops::silu(x)
}

/// `1 / (1 + exp(-x))`.
///
/// # Errors
/// Candle errors only.
pub fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::ops::sigmoid(x)
}

/// A SwiGLU MLP `down(silu(gate x) * up x)` whose three projections are fetched from `w` under
/// `module` (`<module>.{gate,up,down}_proj.weight`, width `inter`), each product by [`Weights::linear`].
///
/// # Errors
/// Weight errors and candle errors.
pub fn swiglu(
    w: &Weights,
    module: &str,
    x: &Tensor,
    hidden: usize,
    inter: usize,
) -> Result<Tensor, ModelError> {
    let g = w.linear(&format!("{module}.gate_proj"), x, inter, hidden)?;
    let u = w.linear(&format!("{module}.up_proj"), x, inter, hidden)?;
    let h = (silu(&g)? * u)?;
    w.linear(&format!("{module}.down_proj"), &h, hidden, inter)
}

/// The additive causal mask `[t, off + t]` for `t` new positions after `off` cached ones (0
/// where key `j <= off + i`, −inf elsewhere) on `device`, or `None` for a single new position.
///
/// # Errors
/// Candle errors only.
pub fn causal_mask(t: usize, off: usize, device: &Device) -> candle_core::Result<Option<Tensor>> {
    if t <= 1 {
        return Ok(None);
    }
    // Built where it is used (on a GPU, no host loop over t × (off + t) entries and no copy).
    let total = off + t;
    let keys = Tensor::arange(0u32, total as u32, device)?.unsqueeze(0)?;
    let queries = Tensor::arange(off as u32, total as u32, device)?.unsqueeze(1)?;
    let future = keys.broadcast_gt(&queries)?;
    let blocked = Tensor::full(f32::NEG_INFINITY, (t, total), device)?;
    let open = Tensor::zeros((t, total), DType::F32, device)?;
    Ok(Some(future.where_cond(&blocked, &open)?))
}

/// RoPE tables for positions `off .. off + t`: `cos`, `sin` `[t, dim/2]` with
/// `inv_freq[i] = theta^(-2i/dim)` computed in f32 as transformers does
/// (`1 / theta ** (arange(0, dim, 2) / dim)`), angle `pos * inv_freq[i]` in f32; computed on
/// the host, placed on `device`.
///
/// # Errors
/// Candle errors only.
pub fn rope_tables(
    theta: f64,
    dim: usize,
    off: usize,
    t: usize,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let half = dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            1.0 / (theta as f32).powf(e)
        })
        .collect();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in off..off + t {
        for &f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, half), device)?,
        Tensor::from_vec(sin, (t, half), device)?,
    ))
}

/// Rotate-half RoPE (`q * cos + rotate_half(q) * sin`) on the first `cos.dim(1) * 2` features
/// of `x` `[heads, t, d]`, the rest passed through (partial rotary).
///
/// # Errors
/// Candle errors only.
pub fn rope_half(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let rot = cos.dim(1)? * 2;
    let xr = x.narrow(D::Minus1, 0, rot)?.contiguous()?.unsqueeze(0)?;
    let y = candle_nn::rotary_emb::rope(&xr, &cos.contiguous()?, &sin.contiguous()?)?.squeeze(0)?;
    if rot == d {
        return Ok(y);
    }
    Tensor::cat(&[&y, &x.narrow(D::Minus1, rot, d - rot)?], D::Minus1)
}

/// [`rope_half`] in the activation dtype `c`: with [`Compute::Bf16`], `cos`/`sin` are rounded
/// to bf16 (transformers' rotary embedding returns them in the model dtype) and each product
/// and the sum are rounded (`q * cos + rotate_half(q) * sin` on bf16 tensors); the features
/// past the rotary part pass through.
///
/// # Errors
/// Candle errors only.
pub fn rope_half_in(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    c: Compute,
) -> candle_core::Result<Tensor> {
    if c == Compute::F32 {
        return rope_half(x, cos, sin);
    }
    let d = x.dim(D::Minus1)?;
    let half = cos.dim(1)?;
    let rot = half * 2;
    let full = |t: &Tensor| -> candle_core::Result<Tensor> {
        let t = c.round(t.clone())?;
        Tensor::cat(&[&t, &t], D::Minus1)
    };
    let (cos, sin) = (full(cos)?, full(sin)?);
    let xr = x.narrow(D::Minus1, 0, rot)?.contiguous()?;
    let rotated = Tensor::cat(
        &[
            &xr.narrow(D::Minus1, half, half)?.neg()?,
            &xr.narrow(D::Minus1, 0, half)?,
        ],
        D::Minus1,
    )?;
    let y =
        c.round((c.round(xr.broadcast_mul(&cos)?)? + c.round(rotated.broadcast_mul(&sin)?)?)?)?;
    if rot == d {
        return Ok(y);
    }
    Tensor::cat(&[&y, &x.narrow(D::Minus1, rot, d - rot)?], D::Minus1)
}

/// Interleaved (GPT-J) RoPE on the whole last dimension of `x` `[heads, t, d]`: pair
/// `(x[2i], x[2i+1])` rotated by `inv_freq[i]`; output in the same interleaved order.
///
/// # Errors
/// Candle errors only.
pub fn rope_interleaved(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let xr = x.contiguous()?.unsqueeze(0)?;
    candle_nn::rotary_emb::rope_i(&xr, &cos.contiguous()?, &sin.contiguous()?)?.squeeze(0)
}

/// Eager softmax attention with grouped KV heads: `q` `[h, t, d]`, `k` `[kv, s, d]`, `v`
/// `[kv, s, dv]`, `mask` `[t, s]` additive → `[t, h * dv]` (heads concatenated, head-major
/// per row, as transformers' `attn_output.transpose(1, 2).reshape`).
///
/// # Errors
/// Candle errors on inconsistent shapes.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    attention_blocked(q, k, v, scale, mask, q.dim(1)?)
}

/// [`attention`] over the query rows in blocks of `block` rows (at least 1), to bound the
/// scores held at once to `[h, block, s]`: the same operations on each block, so every row
/// gets the values one call over all rows gives (rows are independent), but the keys are
/// transposed and the KV heads expanded once for all blocks, not once a block (at GLM-5's
/// 64 heads and 4,096 keys that copy is 256 MiB). It is [`attention_eager_in`] in f32, where
/// every rounding of the eager rule is the identity.
///
/// # Errors
/// Candle errors on inconsistent shapes.
pub fn attention_blocked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    block: usize,
) -> candle_core::Result<Tensor> {
    attention_eager_in(q, k, v, scale, mask, block, Compute::F32)
}

/// The keys expanded to the `h` query heads and transposed, `[h, d, s]`, and the values
/// expanded, `[h, s, dv]`, both contiguous (grouped KV heads: `k` `[kv, s, d]`, `v`
/// `[kv, s, dv]`).
fn keys_t(h: usize, k: &Tensor, v: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (kv, s, d) = k.dims3()?;
    let dv = v.dim(2)?;
    let rep = h / kv.max(1);
    let expand = |z: &Tensor, w: usize| -> candle_core::Result<Tensor> {
        if rep == 1 {
            return Ok(z.clone());
        }
        z.unsqueeze(1)?.expand((kv, rep, s, w))?.reshape((h, s, w))
    };
    Ok((
        expand(k, d)?.t()?.contiguous()?,
        expand(v, dv)?.contiguous()?,
    ))
}

/// The scaled, masked scores `[h, t, s]` of [`attention`] and the values expanded to the `h`
/// query heads `[h, s, dv]`.
fn scores(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (kt, v) = keys_t(q.dim(0)?, k, v)?;
    let mut att = (q.contiguous()?.matmul(&kt)? * scale)?;
    if let Some(m) = mask {
        att = att.broadcast_add(m)?;
    }
    Ok((att, v))
}

/// [`attention`] in the activation dtype `c`, as a fused (flash) attention kernel computes it
/// on bf16 inputs (torch's CPU `scaled_dot_product_attention`, FlashAttention on GPU): scores,
/// max and `exp(s - max)` in f32, the row sum of those f32 exponentials, the exponentials
/// rounded to bf16 for the product with `v` (accumulated in f32), divided by the sum, and the
/// output rounded. With [`Compute::F32`], exactly [`attention`]. On a GPU the bf16 case runs
/// as [`super::fused_attention`] (the same rounding points, the sums in cuBLAS's order).
///
/// # Errors
/// Candle errors on inconsistent shapes.
pub fn attention_in(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    c: Compute,
) -> candle_core::Result<Tensor> {
    if c == Compute::F32 {
        return attention(q, k, v, scale, mask);
    }
    let (h, t, _) = q.dims3()?;
    let dv = v.dim(2)?;
    // On a GPU, three kernels with these rounding points ([`super::fused_attention`]).
    let y = match super::fused_attention::attention(q, k, v, scale, mask)? {
        Some(y) => y,
        None => {
            let (att, v) = scores(q, k, v, scale, mask)?;
            let max = att.max_keepdim(D::Minus1)?;
            let e = att.broadcast_sub(&max)?.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?;
            c.round(e)?.matmul(&v.contiguous()?)?.broadcast_div(&sum)?
        }
    };
    c.round(y.transpose(0, 1)?.contiguous()?.reshape((t, h * dv))?)
}

/// Query rows per block of [`attention_eager_in`] for `heads` heads over `keys` keys, so that
/// one block's scores hold about 2^24 f32 values (64 MiB; at least one row): its roundings
/// copy the scores, so a whole 4,096-token sequence at once would hold several GiB.
pub fn eager_row_block(heads: usize, keys: usize) -> usize {
    ((1usize << 24) / heads.saturating_mul(keys).max(1)).max(1)
}

/// [`attention`] as transformers' `eager_attention_forward` computes it on bf16 inputs
/// (`attn_implementation="eager"`, [`super::AttentionKernel::Eager`]): `q·kᵀ` accumulated in
/// f32 and rounded to bf16 (a bf16 `matmul`), times `scale` and rounded again, plus the
/// additive `mask`, `softmax(…, dtype=float32)` rounded to bf16, the product with `v`
/// accumulated in f32 and rounded. With [`Compute::F32`] every rounding is the identity and
/// this is [`attention`]'s rule. Shapes as [`attention`]; the query rows run in blocks of
/// `block` (at least 1) to bound the scores held at once, which changes no value.
///
/// # Errors
/// Candle errors on inconsistent shapes.
pub fn attention_eager_in(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    block: usize,
    c: Compute,
) -> candle_core::Result<Tensor> {
    let (h, t, _) = q.dims3()?;
    let (kt, v) = keys_t(h, k, v)?;
    let dv = v.dim(2)?;
    let block = block.max(1);
    let mut ys = Vec::with_capacity(t.div_ceil(block));
    for r0 in (0..t).step_by(block) {
        let n = block.min(t - r0);
        let s = c.round(q.narrow(1, r0, n)?.contiguous()?.matmul(&kt)?)?;
        let mut s = c.round((s * scale)?)?;
        if let Some(m) = mask {
            s = s.broadcast_add(&m.narrow(0, r0, n)?)?;
        }
        let p = c.round(candle_nn::ops::softmax_last_dim(&s)?)?;
        ys.push(
            p.matmul(&v)?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, h * dv))?,
        );
    }
    c.round(Tensor::cat(&ys, 0)?)
}

/// Indices of the `k` largest values of `row`, largest first (ties: lower index first).
pub fn topk_indices(row: &[f32], k: usize) -> Vec<usize> {
    topk_indices_ordered(row, k, TieOrder::LowerFirst)
}

/// [`topk_indices`] with equal values taken in `ties` order.
pub fn topk_indices_ordered(row: &[f32], k: usize, ties: TieOrder) -> Vec<usize> {
    // A strict total order (value, then index), so selecting the first `k` and sorting them
    // gives exactly the first `k` of a full sort.
    let order = |&a: &usize, &b: &usize| {
        row[b].total_cmp(&row[a]).then(match ties {
            TieOrder::LowerFirst => a.cmp(&b),
            TieOrder::HigherFirst => b.cmp(&a),
        })
    };
    let mut idx: Vec<usize> = (0..row.len()).collect();
    if k == 0 {
        return Vec::new();
    }
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_by(order);
    idx
}

/// Whether the top-`k` selection `kept` of `row` ([`topk_indices_ordered`]) cuts through a
/// tie: a value left out equals the smallest value kept, bit for bit (`f32::total_cmp`, the
/// selection's own order), so the other [`TieOrder`] keeps another set. Never when nothing
/// is left out (`kept.len() >= row.len()`). `kept` holds indices into `row`.
pub fn topk_cuts_tie(row: &[f32], kept: &[usize]) -> bool {
    if kept.len() >= row.len() {
        return false;
    }
    let Some(least) = kept
        .iter()
        .filter_map(|&i| row.get(i))
        .min_by(|a, b| a.total_cmp(b))
    else {
        return false;
    };
    // Every kept value is at least `least`; any further one is a left-out value equal to it
    // (a left-out value above it would have been kept).
    row.iter().filter(|v| v.total_cmp(least).is_ge()).count() > kept.len()
}

/// Indices of the `k` largest values of `row` in the order torch's CPU `topk` returns them
/// (`aten/src/ATen/native/TopKImpl.h`: `(value, index)` pairs ordered by libstdc++'s
/// `std::nth_element` then `std::sort` of the first `k - 1`, or `std::partial_sort` when
/// `k * 64 <= row.len()`, with "greater" as the comparison). Unlike [`topk_indices`], exact
/// ties are broken as torch breaks them, which is not by index: a bf16 serve's router logits
/// tie often enough that this decides which expert runs. NaN counts as the largest.
pub fn torch_topk_indices(row: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    let mut q: Vec<(f32, usize)> = row.iter().copied().zip(0..).collect();
    if k * 64 <= q.len() {
        stl::partial_sort(&mut q, k);
    } else {
        stl::nth_element(&mut q, k - 1);
        stl::insertion_sort(&mut q, 0, k - 1);
    }
    q.truncate(k);
    q.into_iter().map(|(_, i)| i).collect()
}

/// The libstdc++ algorithms torch's CPU `topk` runs, step for step (`bits/stl_algo.h`,
/// `bits/stl_heap.h`), with its comparison `comp(x, y) = isnan(x) && !isnan(y) || x > y`.
mod stl {
    type E = (f32, usize);

    fn comp(x: &E, y: &E) -> bool {
        (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
    }

    /// `std::__insertion_sort` of `q[first..last]`.
    pub(super) fn insertion_sort(q: &mut [E], first: usize, last: usize) {
        if first >= last {
            return;
        }
        for i in first + 1..last {
            let v = q[i];
            if comp(&v, &q[first]) {
                q.copy_within(first..i, first + 1);
                q[first] = v;
            } else {
                let mut j = i;
                while comp(&v, &q[j - 1]) {
                    q[j] = q[j - 1];
                    j -= 1;
                }
                q[j] = v;
            }
        }
    }

    fn move_median_to_first(q: &mut [E], r: usize, a: usize, b: usize, c: usize) {
        let m = if comp(&q[a], &q[b]) {
            if comp(&q[b], &q[c]) {
                b
            } else if comp(&q[a], &q[c]) {
                c
            } else {
                a
            }
        } else if comp(&q[a], &q[c]) {
            a
        } else if comp(&q[b], &q[c]) {
            c
        } else {
            b
        };
        q.swap(r, m);
    }

    fn unguarded_partition(q: &mut [E], mut first: usize, mut last: usize, pivot: usize) -> usize {
        loop {
            while comp(&q[first], &q[pivot]) {
                first += 1;
            }
            last -= 1;
            while comp(&q[pivot], &q[last]) {
                last -= 1;
            }
            if first >= last {
                return first;
            }
            q.swap(first, last);
            first += 1;
        }
    }

    /// `std::nth_element(q.begin(), q.begin() + nth, q.end(), comp)` (introselect).
    pub(super) fn nth_element(q: &mut [E], nth: usize) {
        let (mut first, mut last) = (0, q.len());
        let mut depth = 2 * q.len().max(1).ilog2();
        while last - first > 3 {
            if depth == 0 {
                heap_select(q, first, nth + 1, last);
                q.swap(first, nth);
                return;
            }
            depth -= 1;
            let mid = first + (last - first) / 2;
            move_median_to_first(q, first, first + 1, mid, last - 1);
            let cut = unguarded_partition(q, first + 1, last, first);
            if cut <= nth {
                first = cut;
            } else {
                last = cut;
            }
        }
        insertion_sort(q, first, last);
    }

    fn adjust_heap(q: &mut [E], first: usize, mut hole: usize, len: usize, value: E) {
        let top = hole;
        let mut child = hole;
        while child < (len - 1) / 2 {
            child = 2 * (child + 1);
            if comp(&q[first + child], &q[first + child - 1]) {
                child -= 1;
            }
            q[first + hole] = q[first + child];
            hole = child;
        }
        if len.is_multiple_of(2) && child == (len - 2) / 2 {
            child = 2 * (child + 1);
            q[first + hole] = q[first + child - 1];
            hole = child - 1;
        }
        while hole > top {
            let parent = (hole - 1) / 2;
            if !comp(&q[first + parent], &value) {
                break;
            }
            q[first + hole] = q[first + parent];
            hole = parent;
        }
        q[first + hole] = value;
    }

    fn make_heap(q: &mut [E], first: usize, last: usize) {
        let len = last - first;
        if len < 2 {
            return;
        }
        let mut parent = (len - 2) / 2;
        loop {
            let v = q[first + parent];
            adjust_heap(q, first, parent, len, v);
            if parent == 0 {
                return;
            }
            parent -= 1;
        }
    }

    fn pop_heap(q: &mut [E], first: usize, last: usize, result: usize) {
        let v = q[result];
        q[result] = q[first];
        adjust_heap(q, first, 0, last - first, v);
    }

    fn heap_select(q: &mut [E], first: usize, middle: usize, last: usize) {
        make_heap(q, first, middle);
        for i in middle..last {
            if comp(&q[i], &q[first]) {
                pop_heap(q, first, middle, i);
            }
        }
    }

    /// `std::partial_sort(q.begin(), q.begin() + k, q.end(), comp)`.
    pub(super) fn partial_sort(q: &mut [E], k: usize) {
        heap_select(q, 0, k, q.len());
        let mut last = k;
        while last > 1 {
            last -= 1;
            pop_heap(q, 0, last, last);
        }
    }
}

/// [`softmax_top_k`] as a model of activation dtype `c` routes: with [`Compute::Bf16`] the
/// top `k` are chosen as torch's `topk` chooses them ([`torch_topk_indices`]; the logits a
/// bf16 serve softmaxes are bf16 and tie). The weights are f32 either way; the caller rounds
/// them where the model casts them.
///
/// # Errors
/// Candle errors only.
pub fn softmax_top_k_in(
    logits: &Tensor,
    k: usize,
    renormalise: bool,
    c: Compute,
) -> candle_core::Result<Vec<Vec<(usize, f32)>>> {
    let pick: fn(&[f32], usize) -> Vec<usize> = match c {
        Compute::F32 => topk_indices,
        Compute::Bf16 => torch_topk_indices,
    };
    softmax_top_k_with(logits, k, renormalise, pick)
}

/// The softmax top-k router of Qwen3-MoE and Qwen3.5-MoE (transformers' `*TopKRouter`):
/// `p = softmax(logits)` in f32 per row, the `k` largest ([`topk_indices`]), their weights `p[e]`
/// divided by the sum of the `k` chosen (largest first) when `renormalise`. `logits` `[T, experts]`
/// → per token, `(expert, weight)` largest first.
///
/// # Errors
/// Candle errors only.
pub fn softmax_top_k(
    logits: &Tensor,
    k: usize,
    renormalise: bool,
) -> candle_core::Result<Vec<Vec<(usize, f32)>>> {
    softmax_top_k_with(logits, k, renormalise, topk_indices)
}

fn softmax_top_k_with(
    logits: &Tensor,
    k: usize,
    renormalise: bool,
    pick: fn(&[f32], usize) -> Vec<usize>,
) -> candle_core::Result<Vec<Vec<(usize, f32)>>> {
    crate::device::count_host_step(logits.device(), crate::device::HostStep::Routing);
    let probs = candle_nn::ops::softmax_last_dim(logits)?.to_vec2::<f32>()?;
    Ok(probs
        .iter()
        .map(|row| softmax_weights(row, &pick(row, k), renormalise))
        .collect())
}

/// The softmax top-k router of [`softmax_top_k_in`] in two halves, so that a routing check can
/// stand between them ([`super::Probe::route`]): per row of `logits` `[T, experts]`, the own top
/// `k` in choice order and the f32 probabilities to weight whichever choice is dispatched
/// ([`SoftmaxRoute::weights`]); with `full_rows` also the logits themselves (the scores the rule
/// ranks by, [`SoftmaxRoute::rank`]), which a routing check or a record of the router's logits
/// needs ([`super::Probe::wants_scores`]).
///
/// In a bf16 recompute on a GPU without `full_rows`, the top `k` are chosen on the device
/// ([`super::router_kernels::torch_topk`], torch's order bit for bit) and only `[T, k]` comes
/// back; otherwise every row is copied and chosen on the host (a counted host step).
///
/// # Errors
/// Candle errors only.
pub fn softmax_route_in(
    logits: &Tensor,
    k: usize,
    c: Compute,
    full_rows: bool,
) -> candle_core::Result<SoftmaxRoute> {
    softmax_route_start(logits, k, c, full_rows)?.finish()
}

/// [`softmax_route_in`] up to the copy of its top-k to the host, where the top-k runs on the
/// device ([`super::router_kernels::torch_topk_start`]): the caller queues work that does not
/// depend on the routing (a shared expert) and then calls [`RouteStart::finish`], so the
/// device computes while the host routes. Elsewhere the routing is done here.
///
/// # Errors
/// As [`softmax_route_in`].
pub fn softmax_route_start(
    logits: &Tensor,
    k: usize,
    c: Compute,
    full_rows: bool,
) -> candle_core::Result<RouteStart> {
    let pick: fn(&[f32], usize) -> Vec<usize> = match c {
        Compute::F32 => topk_indices,
        Compute::Bf16 => torch_topk_indices,
    };
    let experts = logits.dim(1)?;
    let logits = logits.to_dtype(DType::F32)?;
    let probs = candle_nn::ops::softmax_last_dim(&logits)?;
    if !full_rows && c == Compute::Bf16 {
        if let Some(pending) = super::router_kernels::torch_topk_start(&probs, k)? {
            return Ok(RouteStart(Started::Copying(pending)));
        }
    }
    crate::device::count_host_step(logits.device(), crate::device::HostStep::Routing);
    // Logits and probabilities side by side in one copy to the host (one wait for the device).
    let both = Tensor::cat(&[&logits, &probs], 1)?.to_vec2::<f32>()?;
    let (rank, probs): (Vec<Vec<f32>>, Vec<Vec<f32>>) = both
        .into_iter()
        .map(|mut row| {
            let p = row.split_off(experts);
            (row, p)
        })
        .unzip();
    // Row by row in parallel: 4,096 rows of 256 experts take ~20 ms on one core.
    let own = {
        use rayon::prelude::*;
        probs.par_iter().map(|row| pick(row, k)).collect()
    };
    Ok(RouteStart(Started::Done(SoftmaxRoute {
        rank,
        own,
        probs: RouteProbs::Rows(probs),
    })))
}

/// A routing begun by [`softmax_route_start`]: done, or its device top-k on the way to the
/// host.
#[derive(Debug)]
pub struct RouteStart(Started);

#[derive(Debug)]
enum Started {
    Done(SoftmaxRoute),
    Copying(super::router_kernels::PendingTopK),
}

impl RouteStart {
    /// The routing, once the device's top-k (if any) is on the host.
    ///
    /// # Errors
    /// A candle error when the device fails.
    pub fn finish(self) -> candle_core::Result<SoftmaxRoute> {
        match self.0 {
            Started::Done(r) => Ok(r),
            Started::Copying(pending) => {
                let top = pending.wait()?;
                // Each row's top-k also kept flat, for [`SoftmaxRoute::weights`] after
                // [`SoftmaxRoute::take_own`] has handed the rows on.
                let own = top
                    .idx
                    .chunks_exact(top.k.max(1))
                    .map(<[usize]>::to_vec)
                    .collect();
                Ok(SoftmaxRoute {
                    rank: Vec::new(),
                    own,
                    probs: RouteProbs::Own {
                        k: top.k,
                        idx: top.idx,
                        p: top.p,
                    },
                })
            }
        }
    }
}

/// What [`softmax_route_in`] returns for `T` rows.
#[derive(Debug, Clone)]
pub struct SoftmaxRoute {
    /// Per row, the router's logits (f32): the scores a routing check ranks by. Empty unless
    /// full rows were asked for (or the top-k ran on the host).
    pub rank: Vec<Vec<f32>>,
    /// Per row, the own top `k` in choice order.
    pub own: Vec<Vec<usize>>,
    probs: RouteProbs,
}

/// The probabilities a [`SoftmaxRoute`] kept: every row's, or only those of its own top-k
/// (row-major `[T, k]`: the experts `idx` and their probabilities `p`).
#[derive(Debug, Clone)]
enum RouteProbs {
    Rows(Vec<Vec<f32>>),
    Own {
        k: usize,
        idx: Vec<usize>,
        p: Vec<f32>,
    },
}

impl SoftmaxRoute {
    /// Moves the own top-k rows out ([`SoftmaxRoute::own`] is then empty), for a routing
    /// decision that takes them by value ([`super::Probe::route`]) without copying each row
    /// again; [`SoftmaxRoute::weights`] still works after it (from a flat copy kept with the
    /// probabilities).
    pub fn take_own(&mut self) -> Vec<Vec<usize>> {
        std::mem::take(&mut self.own)
    }

    /// [`softmax_weights`] of the experts `used[r]` dispatched for each row `r`. (Rows one
    /// after the other: on a GPU machine rayon's pool is busy with the next layer's weight
    /// reads, and a parallel loop here waited behind them.)
    ///
    /// # Errors
    /// A candle error when `used` has another number of rows, or when only the own top-k's
    /// probabilities were kept and a row dispatches an expert outside it (a replayed routing
    /// needs full rows: [`super::Probe::wants_scores`]).
    pub fn weights(
        &self,
        used: &[Vec<usize>],
        renormalise: bool,
    ) -> candle_core::Result<Vec<Vec<(usize, f32)>>> {
        let rows = match &self.probs {
            RouteProbs::Rows(rows) => rows.len(),
            RouteProbs::Own { k, idx, .. } => idx.len().checked_div(*k).unwrap_or(0),
        };
        if used.len() != rows {
            candle_core::bail!("routing: {} dispatched rows for {rows} routed", used.len());
        }
        match &self.probs {
            RouteProbs::Rows(rows) => Ok(used
                .iter()
                .zip(rows)
                .map(|(u, p)| softmax_weights(p, u, renormalise))
                .collect()),
            RouteProbs::Own { k: 0, .. } => Ok(vec![Vec::new(); used.len()]),
            RouteProbs::Own { k, idx, p } => used
                .iter()
                .zip(idx.chunks(*k).zip(p.chunks(*k)))
                .map(|(u, (own, p))| {
                    if u.as_slice() == own {
                        return Ok(weights_of(u, p, renormalise));
                    }
                    let picked = u
                        .iter()
                        .map(|&e| {
                            own.iter()
                                .position(|&o| o == e)
                                .and_then(|j| p.get(j).copied())
                                .ok_or_else(|| {
                                    candle_core::Error::Msg(format!(
                                        "routing: expert {e} is dispatched but only the own \
                                         top-k's probabilities were kept"
                                    ))
                                })
                        })
                        .collect::<candle_core::Result<Vec<f32>>>()?;
                    Ok(weights_of(u, &picked, renormalise))
                })
                .collect(),
        }
    }
}

/// The weights of the experts `chosen` (in that order) from one row's probabilities `probs`:
/// `probs[e]`, divided by their sum (taken in `chosen` order, f32) when `renormalise`.
pub fn softmax_weights(probs: &[f32], chosen: &[usize], renormalise: bool) -> Vec<(usize, f32)> {
    let picked: Vec<f32> = chosen
        .iter()
        .map(|&e| probs.get(e).copied().unwrap_or(0.0))
        .collect();
    weights_of(chosen, &picked, renormalise)
}

/// [`softmax_weights`] from the chosen experts' probabilities `p` (same order as `chosen`).
fn weights_of(chosen: &[usize], p: &[f32], renormalise: bool) -> Vec<(usize, f32)> {
    let sum: f32 = p.iter().sum();
    chosen
        .iter()
        .zip(p)
        .map(|(&e, &p)| (e, if renormalise { p / sum } else { p }))
        .collect()
}

/// Routed-expert dispatch: for each expert hit by `choice` (`[T]` lists of `(expert, weight)`),
/// runs `expert(e, rows)` on the rows of `x` `[T, H]` routed to it and accumulates
/// `weight * output` per token (expert order ascending, as transformers' loop). Experts no
/// token chose are never called (so their weights are never decoded).
///
/// # Errors
/// Whatever `expert` returns, and candle errors.
pub fn moe_dispatch<F>(
    x: &Tensor,
    choice: &[Vec<(usize, f32)>],
    mut expert: F,
) -> Result<Tensor, ModelError>
where
    F: FnMut(usize, &Tensor) -> Result<Tensor, ModelError>,
{
    moe_dispatch_weighted(x, choice, |e, rows, w| {
        Ok(expert(e, rows)?.broadcast_mul(w)?)
    })
}

/// The loop of [`moe_dispatch`]: `weighted(e, rows, w)` returns expert `e`'s output on `rows`
/// already multiplied by the weights `w` `[n, 1]`; the results are summed per token in f32.
fn moe_dispatch_weighted<F>(
    x: &Tensor,
    choice: &[Vec<(usize, f32)>],
    mut weighted: F,
) -> Result<Tensor, ModelError>
where
    F: FnMut(usize, &Tensor, &Tensor) -> Result<Tensor, ModelError>,
{
    let (t, h) = x.dims2()?;
    let mut per: std::collections::BTreeMap<usize, Vec<(u32, f32)>> = Default::default();
    for (tok, list) in choice.iter().enumerate() {
        for &(e, w) in list {
            per.entry(e).or_default().push((tok as u32, w));
        }
    }
    let dev = x.device();
    let mut out = Tensor::zeros((t, h), DType::F32, dev)?;
    for (e, toks) in per {
        let idx: Vec<u32> = toks.iter().map(|p| p.0).collect();
        let wts: Vec<f32> = toks.iter().map(|p| p.1).collect();
        let n = idx.len();
        let idx = Tensor::from_vec(idx, n, dev)?;
        let rows = x.index_select(&idx, 0)?;
        let y = weighted(e, &rows, &Tensor::from_vec(wts, (n, 1), dev)?)?;
        out = out.index_add(&idx, &y, 0)?;
    }
    Ok(out)
}

/// [`moe_dispatch`] as transformers' `grouped_mm` experts compute it in a model of activation
/// dtype `c` whose routing weights are in that dtype (the Qwen routers' `.to(router_logits.dtype)`):
/// each expert output times its weight is rounded to `c` (`proj_out * sample_weights`, both
/// bf16), the `k` products of a token are summed in f32 (`.sum(dim=1)` accumulates in f32) and
/// the sum is rounded once. The f32 sum runs in ascending expert order rather than top-k
/// order; the two differ at most in the last f32 bit before that rounding. With
/// [`Compute::F32`], exactly [`moe_dispatch`].
///
/// # Errors
/// Whatever `expert` returns, and candle errors.
pub fn moe_dispatch_in<F>(
    x: &Tensor,
    choice: &[Vec<(usize, f32)>],
    c: Compute,
    mut expert: F,
) -> Result<Tensor, ModelError>
where
    F: FnMut(usize, &Tensor) -> Result<Tensor, ModelError>,
{
    if c == Compute::F32 {
        return moe_dispatch(x, choice, expert);
    }
    let out = moe_dispatch_weighted(x, choice, |e, rows, w| {
        Ok(c.round(expert(e, rows)?.broadcast_mul(w)?)?)
    })?;
    Ok(c.round(out)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The selected top-k is the first `k` of the whole row sorted by (value, tie order):
    /// rows full of ties, a NaN, every `k` from 0 past the row's length, both tie orders.
    #[test]
    fn the_selected_topk_is_the_full_sort_prefix() {
        for n in [1usize, 2, 7, 64, 300] {
            let mut row: Vec<f32> = (0..n)
                .map(|i| ((i * i * 7 + 3) % 11) as f32 / 4.0)
                .collect();
            if n > 5 {
                row[5] = f32::NAN;
            }
            for ties in [TieOrder::LowerFirst, TieOrder::HigherFirst] {
                let mut all: Vec<usize> = (0..n).collect();
                all.sort_by(|&a, &b| {
                    row[b].total_cmp(&row[a]).then(match ties {
                        TieOrder::LowerFirst => a.cmp(&b),
                        TieOrder::HigherFirst => b.cmp(&a),
                    })
                });
                for k in 0..=n + 2 {
                    let want = &all[..k.min(n)];
                    assert_eq!(
                        topk_indices_ordered(&row, k, ties),
                        want,
                        "n {n} k {k} {ties:?}"
                    );
                }
            }
        }
    }

    /// `topk_cuts_tie` says exactly when the two tie orders keep different sets: rows full of
    /// ties, with `-0.0` beside `0.0` (distinct in `total_cmp`) and NaNs, every `k`.
    #[test]
    fn a_cut_tie_is_where_the_tie_orders_keep_different_sets() {
        let (mut cut, mut clean) = (0, 0);
        for n in [1usize, 2, 7, 64, 300] {
            let mut row: Vec<f32> = (0..n)
                .map(|i| ((i * i * 7 + 3) % 11) as f32 / 4.0 - 1.0)
                .collect();
            for (i, v) in row.iter_mut().enumerate() {
                if i % 13 == 4 {
                    *v = -0.0;
                } else if i % 17 == 6 {
                    *v = f32::NAN;
                }
            }
            // One row of distinct values too (no tie anywhere).
            let distinct: Vec<f32> = (0..n).map(|i| (i * 37 % n) as f32).collect();
            for r in [&row, &distinct] {
                for k in 0..=n + 2 {
                    let lower = topk_indices_ordered(r, k, TieOrder::LowerFirst);
                    let higher = topk_indices_ordered(r, k, TieOrder::HigherFirst);
                    let set = |v: &[usize]| {
                        v.iter()
                            .copied()
                            .collect::<std::collections::BTreeSet<usize>>()
                    };
                    let differ = set(&lower) != set(&higher);
                    assert_eq!(topk_cuts_tie(r, &lower), differ, "n {n} k {k} {r:?}");
                    assert_eq!(topk_cuts_tie(r, &higher), differ, "n {n} k {k}");
                    if differ {
                        cut += 1;
                    } else {
                        clean += 1;
                    }
                }
            }
        }
        // Both outcomes occur, so the assertions above test something.
        assert!(cut > 10 && clean > 10, "cut {cut}, clean {clean}");
    }

    /// The router's weights from only the own top-k's probabilities (what the device top-k
    /// keeps) are those from full rows, bit for bit, renormalised or not; a dispatched expert
    /// outside the kept top-k is an error, not a zero weight.
    #[test]
    fn route_weights_from_the_kept_top_k_are_those_from_full_rows() {
        let rows = vec![
            vec![0.1f32, 0.25, 0.05, 0.3, 0.3],
            vec![0.4, 0.1, 0.2, 0.2, 0.1],
        ];
        let own: Vec<Vec<usize>> = rows.iter().map(|r| torch_topk_indices(r, 3)).collect();
        let kept: Vec<f32> = own
            .iter()
            .zip(&rows)
            .flat_map(|(o, r)| o.iter().map(|&e| r[e]))
            .collect();
        let full = SoftmaxRoute {
            rank: rows.clone(),
            own: own.clone(),
            probs: RouteProbs::Rows(rows.clone()),
        };
        let mut top = SoftmaxRoute {
            rank: Vec::new(),
            own: own.clone(),
            probs: RouteProbs::Own {
                k: 3,
                idx: own.iter().flatten().copied().collect(),
                p: kept,
            },
        };
        // The rows handed on, the weights still come from what was kept.
        assert_eq!(top.take_own(), own);
        assert!(top.own.is_empty());
        for renormalise in [true, false] {
            let (a, b) = (
                full.weights(&own, renormalise).unwrap(),
                top.weights(&own, renormalise).unwrap(),
            );
            assert_eq!(a, b);
            assert_eq!(a[0].len(), 3);
        }
        // The same set in another order weighs the same experts.
        let reordered: Vec<Vec<usize>> = own
            .iter()
            .map(|o| o.iter().rev().copied().collect())
            .collect();
        assert_eq!(
            full.weights(&reordered, true).unwrap(),
            top.weights(&reordered, true).unwrap()
        );
        let mut other = own.clone();
        other[1][0] = (0..5).find(|e| !own[1].contains(e)).unwrap();
        assert!(top.weights(&other, true).is_err());
        assert!(full.weights(&other, true).is_ok());
        assert!(top.weights(&own[..1], true).is_err(), "a row short");
    }

    /// `torch.tensor(v).topk(k).indices` (torch 2.15, CPU) for
    /// `v[i] = [0.25, 0.5, 0.75, 1.0, 1.5][(7i² + 3i + 1) % 5]`: rows full of exact ties, through
    /// both of torch's paths (`nth_element` for `k * 64 > n`, `partial_sort` otherwise).
    #[test]
    fn torch_topk_breaks_ties_as_torch_does() {
        let levels = [0.25f32, 0.5, 0.75, 1.0, 1.5];
        let row = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|i| levels[(7 * i * i + 3 * i + 1) % 5])
                .collect()
        };
        let torch: [(usize, usize, &[usize]); 4] = [
            (8, 2, &[3, 5]),
            (8, 3, &[3, 5, 6]),
            (128, 2, &[8, 3]),
            (256, 8, &[173, 88, 203, 138, 38, 153, 208, 63]),
        ];
        for (n, k, want) in torch {
            let r = row(n);
            assert_eq!(torch_topk_indices(&r, k), want, "n {n} k {k}");
            // Same set of values as the lower-index-first rule, other members on ties.
            let ours = topk_indices(&r, k);
            assert_ne!(
                ours, want,
                "n {n} k {k}: the case must have a tie at the boundary"
            );
            let vals = |ix: &[usize]| -> Vec<f32> { ix.iter().map(|&i| r[i]).collect() };
            assert_eq!(vals(&ours), vals(want));
        }
        // Distinct values: both rules agree.
        let r: Vec<f32> = (0..40).map(|i| ((i * 37) % 41) as f32).collect();
        for k in [1, 3, 8] {
            assert_eq!(torch_topk_indices(&r, k), topk_indices(&r, k));
        }
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), (1, v.len()), &Device::Cpu).unwrap()
    }

    fn row(x: &Tensor) -> Vec<f32> {
        x.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// [`attention_eager_in`] in bf16 is transformers' `eager_attention_forward` on bf16
    /// tensors, value for value: a scalar re-statement of its rounding points (the scores
    /// rounded, scaled and rounded, the f32 softmax rounded, the output rounded), on inputs
    /// whose products and sums are exact in f32 in any order; and it is not the fused rule of
    /// [`attention_in`], which keeps the scores and the normalisation in f32.
    #[test]
    fn eager_attention_rounds_where_transformers_eager_rounds() {
        let r = |x: f32| half::bf16::from_f32(x).to_f32();
        let (h, kv, t, s, d, dv) = (4usize, 2usize, 5usize, 6usize, 3usize, 2usize);
        let val = |i: usize, m: usize| ((i * m + 5) % 13) as f32 / 4.0 - 1.5;
        let (qv, kvv, vv): (Vec<f32>, Vec<f32>, Vec<f32>) = (
            (0..h * t * d).map(|i| val(i, 7)).collect(),
            (0..kv * s * d).map(|i| val(i, 11)).collect(),
            (0..kv * s * dv).map(|i| val(i, 3)).collect(),
        );
        let maskv: Vec<f32> = (0..t * s)
            .map(|i| {
                if i % s > i / s + 1 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let scale = 0.3f64;
        let mut want = vec![0f32; t * h * dv];
        for hh in 0..h {
            let g = hh / (h / kv);
            for i in 0..t {
                let sc: Vec<f32> = (0..s)
                    .map(|j| {
                        let dot: f32 = (0..d)
                            .map(|x| qv[(hh * t + i) * d + x] * kvv[(g * s + j) * d + x])
                            .sum();
                        r(r(dot) * scale as f32) + maskv[i * s + j]
                    })
                    .collect();
                let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = sc.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = e.iter().sum();
                for c in 0..dv {
                    let y: f32 = (0..s)
                        .map(|j| r(e[j] / sum) * vv[(g * s + j) * dv + c])
                        .sum();
                    want[i * h * dv + hh * dv + c] = r(y);
                }
            }
        }
        let dev = Device::Cpu;
        let q = Tensor::from_vec(qv, (h, t, d), &dev).unwrap();
        let k = Tensor::from_vec(kvv, (kv, s, d), &dev).unwrap();
        let v = Tensor::from_vec(vv, (kv, s, dv), &dev).unwrap();
        let mask = Tensor::from_vec(maskv, (t, s), &dev).unwrap();
        let flat = |x: Tensor| -> Vec<u32> {
            x.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
        for block in [1usize, 2, 5] {
            let got = attention_eager_in(&q, &k, &v, scale, Some(&mask), block, Compute::Bf16);
            assert_eq!(flat(got.unwrap()), want, "block {block}");
        }
        let fused = attention_in(&q, &k, &v, scale, Some(&mask), Compute::Bf16).unwrap();
        assert_ne!(flat(fused), want, "the fused rule rounds elsewhere");
        // In f32 every rounding is the identity: the eager rule is the plain one.
        let f = attention_eager_in(&q, &k, &v, scale, Some(&mask), t, Compute::F32).unwrap();
        let plain = attention(&q, &k, &v, scale, Some(&mask)).unwrap();
        assert_eq!(flat(f), flat(plain));
    }

    /// `Qwen3_5MoeRMSNorm` rounds once (f32 `norm(x) * (1 + w)`, then bf16), where the
    /// Llama-style norm rounds the normalised row first: on this row the two differ.
    /// Row blocks of every size give each row exactly the values of one call over all rows,
    /// with grouped and ungrouped KV heads and an additive mask that drops some keys.
    #[test]
    fn blocked_attention_is_attention_row_for_row() {
        let (t, s, d, dv) = (7usize, 9usize, 5usize, 3usize);
        let val = |i: usize, m: usize| ((i * m + 11) % 29) as f32 / 7.0 - 2.0;
        for (h, kv) in [(4usize, 4usize), (4, 2), (6, 1)] {
            let q = Tensor::from_vec(
                (0..h * t * d).map(|i| val(i, 13)).collect(),
                (h, t, d),
                &Device::Cpu,
            )
            .unwrap();
            let k = Tensor::from_vec(
                (0..kv * s * d).map(|i| val(i, 17)).collect(),
                (kv, s, d),
                &Device::Cpu,
            )
            .unwrap();
            let v = Tensor::from_vec(
                (0..kv * s * dv).map(|i| val(i, 19)).collect(),
                (kv, s, dv),
                &Device::Cpu,
            )
            .unwrap();
            let mask: Vec<f32> = (0..t * s)
                .map(|i| {
                    if (i * 5) % 7 == 3 {
                        f32::NEG_INFINITY
                    } else {
                        0.0
                    }
                })
                .collect();
            let mask = Tensor::from_vec(mask, (t, s), &Device::Cpu).unwrap();
            let want = attention(&q, &k, &v, 0.37, Some(&mask)).unwrap();
            assert_eq!(want.dims(), &[t, h * dv]);
            let want = want.to_vec2::<f32>().unwrap();
            assert!(want.iter().flatten().all(|x| x.is_finite()));
            for block in [0usize, 1, 2, 3, 6, 7, 50] {
                let got = attention_blocked(&q, &k, &v, 0.37, Some(&mask), block)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                let bits = |m: &[Vec<f32>]| -> Vec<u32> {
                    m.iter().flatten().map(|x| x.to_bits()).collect()
                };
                assert_eq!(bits(&got), bits(&want), "h {h} kv {kv} block {block}");
            }
            let no_mask = attention(&q, &k, &v, 0.37, None)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let got = attention_blocked(&q, &k, &v, 0.37, None, 3)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert_eq!(got, no_mask, "h {h} kv {kv} unmasked");
            assert_ne!(no_mask, want, "the mask drops keys");
        }
    }

    #[test]
    fn the_causal_mask_blocks_exactly_the_future_keys() {
        let m = causal_mask(3, 2, &Device::Cpu).unwrap().unwrap();
        let got = m.to_vec2::<f32>().unwrap();
        for (i, row) in got.iter().enumerate() {
            assert_eq!(row.len(), 5);
            for (j, &v) in row.iter().enumerate() {
                let want = if j > 2 + i { f32::NEG_INFINITY } else { 0.0 };
                assert_eq!(v, want, "query {i} key {j}");
            }
        }
        assert!(causal_mask(1, 4, &Device::Cpu).unwrap().is_none());
    }

    #[test]
    fn zero_centred_norm_rounds_once_in_bf16() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.37)
            .collect();
        let w: Vec<f32> = (0..64)
            .map(|i| ((i * 7 % 17) as f32 - 8.0) * 0.011)
            .collect();
        let (xt, wt) = (t(&x), t(&w));
        let f32_out = row(&rms_norm_1p(&xt, &wt, 1e-6).unwrap());
        let bf = row(&rms_norm_1p_in(&xt, &wt, 1e-6, Compute::Bf16).unwrap());
        let once: Vec<f32> = f32_out
            .iter()
            .map(|&v| Compute::Bf16.round_f32(v))
            .collect();
        assert_eq!(bf, once);
        let w1 = (&wt + 1.0).unwrap();
        let twice = row(&rms_norm_in(&xt, &w1, 1e-6, Compute::Bf16).unwrap());
        assert_ne!(bf, twice, "the row must tell one rounding from two");
        assert_eq!(
            row(&rms_norm_1p_in(&xt, &wt, 1e-6, Compute::F32).unwrap()),
            f32_out
        );
    }

    /// bf16 RoPE rounds `cos`/`sin`, each product and the sum; f32 is [`rope_half`] exactly.
    #[test]
    fn rope_half_in_rounds_products_and_sum() {
        let (cos, sin) = rope_tables(10000.0, 4, 3, 2, &Device::Cpu).unwrap();
        let xv: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) * 0.731).collect();
        let x = Tensor::from_vec(xv.clone(), (1, 2, 6), &Device::Cpu).unwrap();
        assert_eq!(
            row(&rope_half_in(&x, &cos, &sin, Compute::F32).unwrap()),
            row(&rope_half(&x, &cos, &sin).unwrap())
        );
        let got = row(&rope_half_in(&x, &cos, &sin, Compute::Bf16).unwrap());
        let rb = |v: f32| Compute::Bf16.round_f32(v);
        let (c, s) = (row(&cos), row(&sin));
        for p in 0..2 {
            let xr = &xv[p * 6..p * 6 + 6];
            for i in 0..4 {
                let (h, j) = (i % 2, if i < 2 { i + 2 } else { i - 2 });
                let (cv, sv) = (rb(c[p * 2 + h]), rb(s[p * 2 + h]));
                let rot = if i < 2 { -xr[j] } else { xr[j] };
                assert_eq!(got[p * 6 + i], rb(rb(xr[i] * cv) + rb(rot * sv)), "{p} {i}");
            }
            // Past the rotary part, the features pass through.
            assert_eq!(&got[p * 6 + 4..p * 6 + 6], &xr[4..]);
        }
    }
}
