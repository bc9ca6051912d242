//! The element-wise steps around the routed experts' grouped GEMMs ([`super::experts`]) in a
//! bf16 recompute on a GPU, one kernel each (`kernels/experts.cu`) instead of a chain of
//! candle operations (a gather, dtype casts, roundings, an index-select, a broadcast product
//! and a sum over the top-k, each a pass over every routed row):
//! * [`gather_rows_bf16`]: the rows of each expert's tokens, in bf16 for the GEMM;
//! * [`swiglu_bf16`]: `round(round(silu(gate)) · up)` on the gate and up products;
//! * [`combine`]: per token, `Σ_j p(w_j · y[row_j])` in f32 in top-k order, `p` rounding to
//!   bf16 where the model rounds each weighted output (Qwen), the identity where it does not
//!   (GLM).
//!
//! The arithmetic is the unfused path's operation for operation (docs/AUDITOR.md "bf16
//! recompute"): the gather and the SwiGLU agree with it bit for bit; the combine adds in top-k
//! order (the rule as stated, and the CPU's order) where candle's GPU sum adds as a tree, so
//! the two differ by f32 rounding (scripts/gpu-check.sh: `gpu_kernels`). Each
//! returns `None` where it does not apply (the CPU, a build without the `cuda` feature,
//! `ENGY_FUSED_EXPERTS=0`); the caller then runs the candle operations.
use candle_core::Tensor;

/// Whether the kernels may be used: not turned off by `ENGY_FUSED_EXPERTS=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_EXPERTS").map_or(true, |v| v != "0"))
}

fn applies(x: &Tensor) -> bool {
    enabled() && !x.device().is_cpu()
}

/// `x[idx[r]]` for each `r`: `x` `[rows, width]` f32 → `[idx.len(), width]` bf16 (each value
/// rounded to nearest even).
///
/// # Errors
/// A candle error when an index is past `rows` or the device fails.
pub fn gather_rows_bf16(x: &Tensor, idx: &[u32]) -> candle_core::Result<Option<Tensor>> {
    if !applies(x) {
        return Ok(None);
    }
    let rows = x.dim(0)?;
    if let Some(bad) = idx.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("gather: row {bad} of {rows}");
    }
    imp::gather_rows_bf16(x, idx)
}

/// `round(round(silu(g)) · u)` elementwise, `g` and `u` bf16 of one shape → bf16, where
/// `silu(x) = x / (1 + exp(−x))` in f32 (candle's).
///
/// # Errors
/// A candle error when the shapes or dtypes differ or the device fails.
pub fn swiglu_bf16(g: &Tensor, u: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !applies(g) {
        return Ok(None);
    }
    if g.dims() != u.dims() || g.dtype() != candle_core::DType::BF16 || u.dtype() != g.dtype() {
        candle_core::bail!(
            "swiglu: gate {:?} {:?}, up {:?} {:?}",
            g.dims(),
            g.dtype(),
            u.dims(),
            u.dtype()
        );
    }
    imp::swiglu_bf16(g, u)
}

/// The routed experts' weighted sum per token: `y` `[rows, width]` bf16 (every expert's output
/// rows), `pick` and `w` `[t · k]` (token-major, top-k order: row and routing weight; a row of
/// `rows` means no choice) → `[t, width]` f32, `Σ_j p(w · y[row])` with `p` the bf16 rounding
/// when `round_products`, else the identity.
///
/// # Errors
/// A candle error when `pick` and `w` differ in length or are not `t · k`, a row is past
/// `rows`, or the device fails.
pub fn combine(
    y: &Tensor,
    pick: &[u32],
    w: &[f32],
    k: usize,
    round_products: bool,
) -> candle_core::Result<Option<Tensor>> {
    if !applies(y) {
        return Ok(None);
    }
    let rows = y.dim(0)?;
    if k == 0
        || pick.len() != w.len()
        || !pick.len().is_multiple_of(k)
        || y.dtype() != candle_core::DType::BF16
    {
        candle_core::bail!(
            "combine: {} picks, {} weights, top-k {k}, {:?}",
            pick.len(),
            w.len(),
            y.dtype()
        );
    }
    if let Some(bad) = pick.iter().find(|&&r| r as usize > rows) {
        candle_core::bail!("combine: row {bad} of {rows}");
    }
    imp::combine(y, pick, w, k, round_products)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn gather_rows_bf16(
        _x: &Tensor,
        _idx: &[u32],
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }

    pub(super) fn swiglu_bf16(_g: &Tensor, _u: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }

    pub(super) fn combine(
        _y: &Tensor,
        _pick: &[u32],
        _w: &[f32],
        _k: usize,
        _round: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{self, alloc, elementwise, err, u32_arg, with_view, wrap};
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::{DType, Device};
    use half::bf16;

    const OP: &str = "routed experts";
    const THREADS: u32 = 256;
    /// The name the experts' PTX module is cached under on the device.
    const MODULE: &str = "engy_experts";

    #[allow(unsafe_code)]
    pub(super) fn gather_rows_bf16(x: &Tensor, idx: &[u32]) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = x.device() else {
            return Ok(None);
        };
        let (_, width) = x.dims2()?;
        let n = idx.len();
        let stream = cd.cuda_stream();
        let ids = stream
            .clone_htod(idx)
            .map_err(|e| err(OP, "copying the row ids", e))?;
        // SAFETY: the kernel writes all `n · width` elements.
        let mut out = unsafe { alloc::<bf16>(&stream, n * width)? };
        let f = cd.get_or_load_custom_func("engy_gather_rows_bf16", MODULE, kernels::EXPERTS)?;
        let (n32, w32) = (u32_arg(OP, "rows", n)?, u32_arg(OP, "width", width)?);
        with_view::<f32, _>(x, DType::F32, |xv| {
            let mut b = f.builder();
            b.arg(&xv).arg(&ids).arg(&mut out).arg(&n32).arg(&w32);
            // SAFETY: (const float*, const uint32_t*, bf16*, uint32_t, uint32_t) as pushed;
            // every id is below x's rows (checked by the caller), `out` holds n · width.
            unsafe { b.launch(elementwise(OP, n * width, THREADS)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the gather", e))
        })?;
        Ok(Some(wrap(out, cd, (n, width))?))
    }

    #[allow(unsafe_code)]
    pub(super) fn swiglu_bf16(g: &Tensor, u: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = g.device() else {
            return Ok(None);
        };
        let n = g.elem_count();
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes all `n` elements.
        let mut out = unsafe { alloc::<bf16>(&stream, n)? };
        let f = cd.get_or_load_custom_func("engy_swiglu_bf16", MODULE, kernels::EXPERTS)?;
        with_view::<bf16, _>(g, DType::BF16, |gv| {
            with_view::<bf16, _>(u, DType::BF16, |uv| {
                let n64 = n as u64;
                let mut b = f.builder();
                b.arg(&gv).arg(&uv).arg(&mut out).arg(&n64);
                // SAFETY: (const bf16*, const bf16*, bf16*, size_t) as pushed; all three
                // buffers hold `n` elements.
                unsafe { b.launch(elementwise(OP, n, THREADS)?) }
                    .map(|_| ())
                    .map_err(|e| err(OP, "launching the swiglu", e))
            })
        })?;
        Ok(Some(wrap(out, cd, g.shape().clone())?))
    }

    #[allow(unsafe_code)]
    pub(super) fn combine(
        y: &Tensor,
        pick: &[u32],
        w: &[f32],
        k: usize,
        round_products: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = y.device() else {
            return Ok(None);
        };
        let (rows, width) = y.dims2()?;
        let t = pick.len() / k;
        let stream = cd.cuda_stream();
        let picks = stream
            .clone_htod(pick)
            .map_err(|e| err(OP, "copying the picks", e))?;
        let weights = stream
            .clone_htod(w)
            .map_err(|e| err(OP, "copying the weights", e))?;
        // SAFETY: the kernel writes all `t · width` elements.
        let mut out = unsafe { alloc::<f32>(&stream, t * width)? };
        let f = cd.get_or_load_custom_func("engy_combine_experts", MODULE, kernels::EXPERTS)?;
        let args = [
            u32_arg(OP, "tokens", t)?,
            u32_arg(OP, "top-k", k)?,
            u32_arg(OP, "width", width)?,
            u32_arg(OP, "rows", rows)?,
        ];
        let round = i32::from(round_products);
        with_view::<bf16, _>(y, DType::BF16, |yv| {
            let mut b = f.builder();
            b.arg(&yv).arg(&picks).arg(&weights).arg(&mut out);
            for a in &args {
                b.arg(a);
            }
            b.arg(&round);
            // SAFETY: (const bf16*, const uint32_t*, const float*, float*, 4 × uint32_t, int)
            // as pushed; picks are at most `rows` (checked by the caller; `rows` is read as no
            // choice), `picks` and `weights` hold t · k, `out` t · width.
            unsafe { b.launch(elementwise(OP, t * width, THREADS)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the combine", e))
        })?;
        Ok(Some(wrap(out, cd, (t, width))?))
    }
}
