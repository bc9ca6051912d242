//! RMSNorm and the bf16 rounding of a recompute as one kernel each on a GPU
//! (`kernels/norm.cu`), instead of chains of candle operations that each make a pass over the
//! activations (a norm was ten kernels: square, sum, scale, add, sqrt, reciprocal, two
//! broadcast products, two casts; a rounding two casts):
//! * [`round_bf16`]: `Compute::round` of an f32 tensor, f32 → bf16 → f32;
//! * [`rms_norm`]: [`super::ops::rms_norm`] and its variants ([`NormRule`]), optionally on a
//!   residual sum `x + y` that it also returns (a layer's residual add and the next norm in
//!   one pass).
//!
//! The arithmetic is candle's, bit for bit: the sum of squares adds in the order of candle's
//! `fast_sum` reduction (the same block size and tree), then candle's scale, `+ eps`, square
//! root and reciprocal, and the products and roundings of the unfused rule
//! (scripts/gpu-check.sh: `gpu_kernels` compares them). Each returns `None` where it does not
//! apply (the CPU, a build without the `cuda` feature, `ENGY_FUSED_NORM=0`, an empty tensor,
//! operands that are not f32); the caller then runs the candle operations. A row count or
//! width past 32 bits is an error.
use candle_core::Tensor;

/// Whether the kernels may be used: not turned off by `ENGY_FUSED_NORM=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_NORM").map_or(true, |v| v != "0"))
}

fn applies(x: &Tensor) -> bool {
    enabled() && !x.device().is_cpu()
}

/// Which RMSNorm of the served architectures, and where it rounds to bf16 (docs/AUDITOR.md
/// "bf16 recompute"; [`super::ops::rms_norm_in`], [`super::ops::rms_norm_1p_in`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NormRule {
    /// Multiply by `1 + w` (Qwen3.5's zero-centred norm), not `w`.
    pub one_plus: bool,
    /// Round `x · r` to bf16 before the weight (a Llama-style norm in a bf16 model).
    pub round_normed: bool,
    /// Round the output to bf16.
    pub round_out: bool,
}

/// `x` (f32, on a GPU) rounded to bf16 values, kept as f32: `x.to_dtype(BF16).to_dtype(F32)`
/// in one kernel.
///
/// # Errors
/// A candle error when `x` is not f32 or the device fails.
pub fn round_bf16(x: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !applies(x) {
        return Ok(None);
    }
    if x.dtype() != candle_core::DType::F32 {
        candle_core::bail!("bf16 rounding of a {:?} tensor", x.dtype());
    }
    imp::round_bf16(x)
}

/// The RMSNorm `rule` over the last dimension of `x` (f32 `[.., n]`, on a GPU) with weight
/// `w` `[n]`: `x · 1/sqrt(mean(x²) + eps) · w` (`· (1 + w)` for [`NormRule::one_plus`]).
/// With `residual = Some((y, round_sum))`, the norm of `s = x + y` (rounded to bf16 when
/// `round_sum`), returned as `(Some(s), norm)`; else `(None, norm)`.
///
/// # Errors
/// A candle error when `w` is not `[n]`, `y` differs from `x` in shape, or the device fails.
pub fn rms_norm(
    x: &Tensor,
    residual: Option<(&Tensor, bool)>,
    w: &Tensor,
    eps: f64,
    rule: NormRule,
) -> candle_core::Result<Option<(Option<Tensor>, Tensor)>> {
    if !applies(x) {
        return Ok(None);
    }
    let n = x.dims().last().copied().unwrap_or(0);
    if w.dims() != [n] || residual.is_some_and(|(y, _)| y.dims() != x.dims()) {
        candle_core::bail!(
            "rms norm: x {:?}, weight {:?}, residual {:?}",
            x.dims(),
            w.dims(),
            residual.map(|(y, _)| y.dims().to_vec())
        );
    }
    let f32 = candle_core::DType::F32;
    if n == 0
        || x.elem_count() == 0
        || x.dtype() != f32
        || w.dtype() != f32
        || residual.is_some_and(|(y, _)| y.dtype() != f32)
    {
        // Empty, or not the f32 activations the kernel computes on: candle's operations.
        return Ok(None);
    }
    if n > (u32::MAX - 1024) as usize {
        // The kernel's column loop counts in 32 bits.
        candle_core::bail!("rms norm: rows of {n} values are too wide for the kernel");
    }
    imp::rms_norm(x, residual, w, eps, rule)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn round_bf16(_x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }

    pub(super) fn rms_norm(
        _x: &Tensor,
        _residual: Option<(&Tensor, bool)>,
        _w: &Tensor,
        _eps: f64,
        _rule: NormRule,
    ) -> candle_core::Result<Option<(Option<Tensor>, Tensor)>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{self, alloc, elementwise, err, u32_arg, with_views, wrap};
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{DType, Device};

    const OP: &str = "rms norm";
    const THREADS: u32 = 256;
    /// The name the norm PTX module is cached under on the device.
    const MODULE: &str = "engy_norm";
    /// `kernels/norm.cu`'s flags.
    const ONE_PLUS: u32 = 1;
    const ROUND_NORMED: u32 = 2;
    const ROUND_OUT: u32 = 4;
    const ADD: u32 = 8;
    const ROUND_SUM: u32 = 16;

    #[allow(unsafe_code)]
    pub(super) fn round_bf16(x: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = x.device() else {
            return Ok(None);
        };
        let n = x.elem_count();
        if n == 0 {
            return Ok(Some(x.clone()));
        }
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes all `n` elements.
        let mut out = unsafe { alloc::<f32>(&stream, n)? };
        let f = cd.get_or_load_custom_func("engy_round_bf16", MODULE, kernels::NORM)?;
        with_views::<f32, _>(&[x], DType::F32, |v| {
            let n64 = n as u64;
            let mut b = f.builder();
            b.arg(&v[0]).arg(&mut out).arg(&n64);
            // SAFETY: (const float*, float*, size_t) as pushed; both hold `n` elements.
            unsafe { b.launch(elementwise("bf16 rounding", n, THREADS)?) }
                .map(|_| ())
                .map_err(|e| err("bf16 rounding", "launching", e))
        })?;
        Ok(Some(wrap(out, cd, x.shape().clone())?))
    }

    #[allow(unsafe_code)]
    pub(super) fn rms_norm(
        x: &Tensor,
        residual: Option<(&Tensor, bool)>,
        w: &Tensor,
        eps: f64,
        rule: NormRule,
    ) -> candle_core::Result<Option<(Option<Tensor>, Tensor)>> {
        let Device::Cuda(cd) = x.device() else {
            return Ok(None);
        };
        let total = x.elem_count();
        let n = x.dims().last().copied().unwrap_or(0);
        let rows = total / n;
        let stream = cd.cuda_stream();
        let mut flags = 0u32;
        for (on, f) in [
            (rule.one_plus, ONE_PLUS),
            (rule.round_normed, ROUND_NORMED),
            (rule.round_out, ROUND_OUT),
            (residual.is_some(), ADD),
            (residual.is_some_and(|(_, r)| r), ROUND_SUM),
        ] {
            if on {
                flags |= f;
            }
        }
        // SAFETY: the kernel writes all `total` elements of `out`, and of `sum` with ADD.
        let mut out = unsafe { alloc::<f32>(&stream, total)? };
        let mut sum = unsafe { alloc::<f32>(&stream, if residual.is_some() { total } else { 1 })? };
        let f = cd.get_or_load_custom_func("engy_rms_norm", MODULE, kernels::NORM)?;
        // candle's `fast_sum` launch for a row of n: its order of additions is the block's.
        let threads = n.min(1024).next_power_of_two();
        let cfg = LaunchConfig {
            grid_dim: (u32_arg(OP, "rows", rows)?, 1, 1),
            block_dim: (u32_arg(OP, "threads", threads)?, 1, 1),
            shared_mem_bytes: 0,
        };
        // candle's scalars: `mean_keepdim` scales by the f64 1/n as f32, `+ eps` adds eps as f32.
        let inv_n = (1f64 / n as f64) as f32;
        let eps = eps as f32;
        let n32 = u32_arg(OP, "row width", n)?;
        let ops: Vec<&Tensor> = match residual {
            Some((y, _)) => vec![x, w, y],
            None => vec![x, w, x],
        };
        with_views::<f32, _>(&ops, DType::F32, |v| {
            let mut b = f.builder();
            b.arg(&v[0])
                .arg(&v[2])
                .arg(&v[1])
                .arg(&mut sum)
                .arg(&mut out);
            b.arg(&n32).arg(&inv_n).arg(&eps).arg(&flags);
            // SAFETY: (const float* x, const float* y, const float* w, float* sum, float* out,
            // uint32_t, float, float, uint32_t) as pushed; x, y and out hold rows · n, w n, sum
            // rows · n with ADD (else unread); blockDim a power of two <= 1024.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching", e))
        })?;
        let out = wrap(out, cd, x.shape().clone())?;
        let sum = match residual {
            Some(_) => Some(wrap(sum, cd, x.shape().clone())?),
            None => None,
        };
        Ok(Some((sum, out)))
    }
}
