//! The element-wise steps of a Gated DeltaNet layer around the delta rule on a GPU
//! ([`super::qwen3_5_moe`]'s tensor path), one kernel each (`kernels/gated_deltanet.cu`)
//! instead of a chain of candle operations, with their rounding points (`round` is the
//! activation dtype's; `silu(x) = x / (1 + exp(−x))` in f32):
//! * [`causal_conv_silu`]: for new row `r` and channel `ch`,
//!   `round(silu(round(Σ_j input[r + j, ch] · w[j, ch])))`, taps summed in order from 0, each
//!   product rounded before it is added; bit for bit the candle operations;
//! * [`gated_rms_norm`]: per row and value head, `o = round(rule output)`,
//!   `r = 1 / sqrt(mean(o²) + eps)`, `round(round(round(o · r) · w) · silu(z))`; the sum of
//!   squares runs in another order than candle's reduction.
//!
//! * [`rule_inputs`]: the delta rule's `q`, `k`, `v`, `beta` and `g`, head-major as
//!   [`super::delta_rule::chunked`] takes them, from the conv's output and the gate
//!   projections: `q`, `k` l2-normalised per key head (`x / sqrt(Σ x² + 1e-6)`, the sum in
//!   another order than candle's) and written once per value head that reads them, `q`
//!   scaled by `dk^-1/2`; `v` a copy; `beta = round(sigmoid(b))`, `g = softplus(a + dt_bias) ·
//!   −exp(A_log)` as candle computes them, bit for bit.
//!
//! scripts/gpu-check.sh checks each against the candle operations (`gpu_kernels`). Each
//! returns `None` where it does not apply (the CPU, a build without the `cuda` feature,
//! `ENGY_FUSED_DELTANET=0`).
use candle_core::Tensor;

use crate::Compute;

/// Whether the kernels may be used: not turned off by `ENGY_FUSED_DELTANET=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_DELTANET").map_or(true, |v| v != "0"))
}

/// `input` `[t + taps − 1, ch]` f32 (the cached history rows, then the new ones), `w`
/// `[taps, ch]` f32 → `[t, ch]` f32, as the module docs state, rounded as `c` rounds.
///
/// # Errors
/// A candle error when the shapes do not fit or the device fails.
pub fn causal_conv_silu(
    input: &Tensor,
    w: &Tensor,
    c: Compute,
) -> candle_core::Result<Option<Tensor>> {
    if !enabled() || input.device().is_cpu() {
        return Ok(None);
    }
    let (rows, ch) = input.dims2()?;
    let (taps, ch2) = w.dims2()?;
    if taps == 0 || ch2 != ch || rows + 1 < taps {
        candle_core::bail!(
            "causal conv: input {:?}, weights {:?}",
            input.dims(),
            w.dims()
        );
    }
    imp::causal_conv_silu(input, w, rows + 1 - taps, c)
}

/// The gated RMSNorm of the module docs: `o` `[heads, ≥ t, dv]` (the rule's outputs, rows
/// past `t` unused), `z` `[t, heads · dv]`, `w` `[dv]` → `[t, heads · dv]` f32, rounded as `c`
/// rounds.
///
/// # Errors
/// A candle error when the shapes do not fit or the device fails.
pub fn gated_rms_norm(
    o: &Tensor,
    z: &Tensor,
    w: &Tensor,
    eps: f64,
    c: Compute,
) -> candle_core::Result<Option<Tensor>> {
    if !enabled() || o.device().is_cpu() {
        return Ok(None);
    }
    let (heads, o_rows, dv) = o.dims3()?;
    let (t, width) = z.dims2()?;
    if o_rows < t || width != heads * dv || w.dims() != [dv] || dv == 0 {
        candle_core::bail!(
            "gated norm: o {:?}, z {:?}, w {:?}",
            o.dims(),
            z.dims(),
            w.dims()
        );
    }
    imp::gated_rms_norm(o, z, w, eps, c)
}

/// The delta rule's inputs, head-major: `q`, `k` `[nv, t, dk]`, `v` `[nv, t, dv]`, `beta`,
/// `g` `[nv, t]` (f32).
pub type RuleInputs = [Tensor; 5];

/// Key heads, value heads, key width, value width of a Gated DeltaNet layer.
pub type DeltaNetHeads = (usize, usize, usize, usize);

/// [`RuleInputs`] from the conv's output `conv` `[t, 2 · nk · dk + nv · dv]` (f32, after the
/// SiLU) and the projections `b`, `a` `[t, nv]`, with `dt_bias`, `a_log` `[nv]`, as the module
/// docs state; `beta` rounded as `c` rounds.
///
/// # Errors
/// A candle error when the shapes do not fit `heads` or the device fails.
pub fn rule_inputs(
    conv: &Tensor,
    [b, a, dt_bias, a_log]: [&Tensor; 4],
    heads: DeltaNetHeads,
    c: Compute,
) -> candle_core::Result<Option<RuleInputs>> {
    if !enabled() || conv.device().is_cpu() {
        return Ok(None);
    }
    let (nk, nv, dk, dv) = heads;
    let (t, width) = conv.dims2()?;
    let fits = nk > 0
        && nv % nk == 0
        && width == 2 * nk * dk + nv * dv
        && b.dims() == [t, nv]
        && a.dims() == [t, nv]
        && dt_bias.dims() == [nv]
        && a_log.dims() == [nv];
    if !fits {
        candle_core::bail!(
            "deltanet inputs: conv {:?}, b {:?}, a {:?}, dt_bias {:?}, A_log {:?} for heads {heads:?}",
            conv.dims(),
            b.dims(),
            a.dims(),
            dt_bias.dims(),
            a_log.dims()
        );
    }
    imp::rule_inputs(conv, [b, a, dt_bias, a_log], heads, c)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn rule_inputs(
        _conv: &Tensor,
        _gates: [&Tensor; 4],
        _heads: DeltaNetHeads,
        _c: Compute,
    ) -> candle_core::Result<Option<RuleInputs>> {
        Ok(None)
    }

    pub(super) fn causal_conv_silu(
        _input: &Tensor,
        _w: &Tensor,
        _t: usize,
        _c: Compute,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }

    pub(super) fn gated_rms_norm(
        _o: &Tensor,
        _z: &Tensor,
        _w: &Tensor,
        _eps: f64,
        _c: Compute,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{
        self, alloc, elementwise, err, u32_arg, with_view, with_views, wrap,
    };
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::{DType, Device};

    const OP: &str = "gated deltanet";
    /// The name the module's PTX is cached under on the device.
    const MODULE: &str = "engy_gated_deltanet";

    #[allow(unsafe_code)]
    pub(super) fn rule_inputs(
        conv: &Tensor,
        [b, a, dt_bias, a_log]: [&Tensor; 4],
        (nk, nv, dk, dv): DeltaNetHeads,
        c: Compute,
    ) -> candle_core::Result<Option<RuleInputs>> {
        let Device::Cuda(cd) = conv.device() else {
            return Ok(None);
        };
        let t = conv.dim(0)?;
        let stream = cd.cuda_stream();
        // SAFETY: the kernels write every element: q and k (each key head's rows to all of its
        // value heads), v, beta and g.
        let mut q = unsafe { alloc::<f32>(&stream, nv * t * dk)? };
        let mut k = unsafe { alloc::<f32>(&stream, nv * t * dk)? };
        let mut v = unsafe { alloc::<f32>(&stream, nv * t * dv)? };
        let mut beta = unsafe { alloc::<f32>(&stream, nv * t)? };
        let mut g = unsafe { alloc::<f32>(&stream, nv * t)? };
        let qkv =
            cd.get_or_load_custom_func("engy_deltanet_qkv", MODULE, kernels::GATED_DELTANET)?;
        let gates =
            cd.get_or_load_custom_func("engy_deltanet_gates", MODULE, kernels::GATED_DELTANET)?;
        let dims = [
            u32_arg(OP, "rows", t)?,
            u32_arg(OP, "key heads", nk)?,
            u32_arg(OP, "value heads", nv)?,
            u32_arg(OP, "key width", dk)?,
            u32_arg(OP, "value width", dv)?,
        ];
        let scale = (1.0 / (dk as f64).sqrt()) as f32;
        let round = i32::from(c == Compute::Bf16);
        with_view::<f32, _>(conv, DType::F32, |cv| {
            let mut l = qkv.builder();
            l.arg(&cv).arg(&mut q).arg(&mut k).arg(&mut v);
            for d in &dims {
                l.arg(d);
            }
            l.arg(&scale);
            // One warp per (part, row, key head), at least; the grid-stride covers v.
            let work = (2 * t * nk * 32).max(nv * t * dv);
            // SAFETY: (const float*, 3 × float*, 5 × uint32_t, float) as pushed; conv holds
            // t rows of 2 · nk · dk + nv · dv (checked by the caller), q and k nv · t · dk,
            // v nv · t · dv, and nv is a multiple of nk.
            unsafe { l.launch(elementwise(OP, work, 256)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the q, k, v kernel", e))
        })?;
        with_views::<f32, _>(&[b, a, dt_bias, a_log], DType::F32, |ins| {
            let mut l = gates.builder();
            for x in ins {
                l.arg(x);
            }
            l.arg(&mut beta)
                .arg(&mut g)
                .arg(&dims[0])
                .arg(&dims[2])
                .arg(&round);
            // SAFETY: (4 × const float*, 2 × float*, 2 × uint32_t, int) as pushed; b and a
            // hold t · nv, dt_bias and A_log nv, beta and g nv · t.
            unsafe { l.launch(elementwise(OP, t * nv, 256)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the gates kernel", e))
        })?;
        Ok(Some([
            wrap(q, cd, (nv, t, dk))?,
            wrap(k, cd, (nv, t, dk))?,
            wrap(v, cd, (nv, t, dv))?,
            wrap(beta, cd, (nv, t))?,
            wrap(g, cd, (nv, t))?,
        ]))
    }

    #[allow(unsafe_code)]
    pub(super) fn causal_conv_silu(
        input: &Tensor,
        w: &Tensor,
        t: usize,
        c: Compute,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = input.device() else {
            return Ok(None);
        };
        let (_, ch) = input.dims2()?;
        let taps = w.dim(0)?;
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes all `t · ch` elements.
        let mut out = unsafe { alloc::<f32>(&stream, t * ch)? };
        let f =
            cd.get_or_load_custom_func("engy_causal_conv_silu", MODULE, kernels::GATED_DELTANET)?;
        let args = [
            u32_arg(OP, "rows", t)?,
            u32_arg(OP, "channels", ch)?,
            u32_arg(OP, "taps", taps)?,
        ];
        let round = i32::from(c == Compute::Bf16);
        with_view::<f32, _>(input, DType::F32, |iv| {
            with_view::<f32, _>(w, DType::F32, |wv| {
                let mut b = f.builder();
                b.arg(&iv).arg(&wv).arg(&mut out);
                for a in &args {
                    b.arg(a);
                }
                b.arg(&round);
                // SAFETY: (const float*, const float*, float*, 3 × uint32_t, int) as pushed;
                // input holds t + taps − 1 rows of ch, w taps rows of ch, out t rows of ch.
                unsafe { b.launch(elementwise(OP, t * ch, 256)?) }
                    .map(|_| ())
                    .map_err(|e| err(OP, "launching", e))
            })
        })?;
        Ok(Some(wrap(out, cd, (t, ch))?))
    }

    #[allow(unsafe_code)]
    pub(super) fn gated_rms_norm(
        o: &Tensor,
        z: &Tensor,
        w: &Tensor,
        eps: f64,
        c: Compute,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = o.device() else {
            return Ok(None);
        };
        let (heads, o_rows, dv) = o.dims3()?;
        let t = z.dim(0)?;
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes all `t · heads · dv` elements (one warp per row and head).
        let mut out = unsafe { alloc::<f32>(&stream, t * heads * dv)? };
        let f =
            cd.get_or_load_custom_func("engy_gated_rms_norm", MODULE, kernels::GATED_DELTANET)?;
        let args = [
            u32_arg(OP, "rows", t)?,
            u32_arg(OP, "rule rows", o_rows)?,
            u32_arg(OP, "heads", heads)?,
            u32_arg(OP, "head width", dv)?,
        ];
        let (inv_dv, eps32) = ((1.0 / dv as f64) as f32, eps as f32);
        let round = i32::from(c == Compute::Bf16);
        with_views::<f32, _>(&[o, z, w], DType::F32, |ins| {
            let mut b = f.builder();
            for x in ins {
                b.arg(x);
            }
            b.arg(&mut out);
            for a in &args {
                b.arg(a);
            }
            b.arg(&inv_dv).arg(&eps32).arg(&round);
            // SAFETY: (3 × const float*, float*, 4 × uint32_t, float, float, int) as pushed;
            // warp (r, h) reads row r < t ≤ o_rows of head h of `o`, row r of `z` and `w` (dv
            // each), and writes row r, head h of `out`.
            unsafe { b.launch(elementwise(OP, t * heads * 32, 256)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the gated norm", e))
        })?;
        Ok(Some(wrap(out, cd, (t, heads * dv))?))
    }
}
