//! [`ops::attention_in`](super::ops::attention_in) in a bf16 recompute on a GPU, in three
//! kernels instead of a dozen: the scores `q·kᵀ` as one strided-batched cuBLAS GEMM (bf16
//! operands, f32 accumulation and f32 output), one softmax kernel (`kernels/attention.cu`)
//! that scales, masks, takes each row's max, exponentiates, sums the f32 exponentials and
//! writes them rounded to bf16, and `e·v` as a second such GEMM. Query heads of one KV group
//! are one batch entry (`[kv, rep·t, d]`), so K and V are never expanded to every query head.
//!
//! The arithmetic is the unfused path's (docs/design/recomputes.md): in a bf16
//! recompute `q`, `k` and `v` hold bf16 values, so a bf16 operand is the same number and each
//! product is exact in f32; scores, max, exponentials and sums stay f32; only the
//! exponentials fed to `e·v` are rounded, as the unfused path rounds them. What differs is how
//! the f32 sums are taken (cuBLAS's tiling, and its tensor cores' f32 accumulation where the
//! unfused path ran an f32 SGEMM), as between any two GEMM kernels; `gpu_kernels` bounds the
//! effect on the output.
//!
//! On by default on a GPU; `ENGY_FUSED_ATTENTION=0` turns it off (the unfused candle
//! operations then run), for comparing the two.
//!
//! [`attention_f32_probs`] is the same three steps for a rule that keeps the probabilities
//! f32 (GLM's MLA, as SDPA computes it): the softmax kernel writes each f32 exponential as
//! three bf16 planes whose sum is it, and the second GEMM runs over the planes and `v`
//! stacked three times, so the products are the f32 exponentials' own. `ENGY_FUSED_MLA=0`
//! turns it off (`ops::attention_blocked` then runs). With `ENGY_PROFILE`, each call's three
//! steps are the phases `attention: scores gemm`, `attention: softmax` and
//! `attention: e·v gemm`.
use candle_core::Tensor;

/// Whether [`attention`] may be used: not turned off by `ENGY_FUSED_ATTENTION=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_ATTENTION").map_or(true, |v| v != "0"))
}

/// Softmax attention of a bf16 recompute with grouped KV heads, before the heads are
/// concatenated: `q` `[h, t, d]`, `k` `[kv, s, d]`, `v` `[kv, s, dv]` (f32 tensors holding
/// bf16 values; `kv` divides `h`, query head `i` reads KV head `i / (h / kv)`), `mask`
/// `[t, s]` additive f32 → `(round_bf16(e)·v) / Σ e` `[h, t, dv]` f32, unrounded, where
/// `e = exp(x − max x)` per row of `x = (q·kᵀ)·scale + mask`. `None` where it does not apply
/// (not a CUDA tensor, a build without the `cuda` feature, [`enabled`] false); the caller
/// then computes it another way.
///
/// # Errors
/// A candle error on inconsistent shapes, or when cuBLAS or the driver fails.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle_core::Result<Option<Tensor>> {
    if !enabled() || q.device().is_cpu() {
        return Ok(None);
    }
    let Some(dims) = Dims::of(q, k, v, mask)? else {
        return Ok(None);
    };
    cuda::attention(q, k, v, scale, mask, dims, false)
}

/// Whether [`attention_f32_probs`] may be used: not turned off by `ENGY_FUSED_MLA=0`.
pub fn f32_probs_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_MLA").map_or(true, |v| v != "0"))
}

/// [`super::ops::attention_blocked`] on a GPU where `q`, `k` and `v` hold bf16 values (a bf16
/// recompute of MLA, whose rule keeps the softmax's probabilities f32, as SDPA does): the
/// scores `q·kᵀ` as a bf16 GEMM (each product exact in f32, f32 accumulation), one kernel for
/// `x = scores·scale + mask`, the row max, `e = exp(x − max)` and the f32 row sum, and `e·v`
/// with `e` unrounded: `e` is written as three bf16 planes `e₁ = bf16(e)`,
/// `e₂ = bf16(e − e₁)`, `e₃ = bf16(e − e₁ − e₂)`, whose sum is `e` (24 bits in three times
/// 8; an `e` below bf16's normal range loses bits, each under `2⁻¹²⁶` of the row's largest
/// `e`, which is 1), and one GEMM over `[e₁ e₂ e₃]` and `v` stacked three times sums the
/// exact products. The result `(Σ e·v) / Σ e` `[t, h·dv]` f32 (heads concatenated, as
/// [`super::ops::attention_blocked`]) differs from the candle operations' `Σ (e/Σe)·v` in
/// the order and placement of f32 roundings only. Query rows run in blocks of `block`, to
/// bound the scores held at once. `None` where it does not apply (the CPU, a build without
/// the `cuda` feature, `ENGY_FUSED_MLA=0`).
///
/// # Errors
/// A candle error on inconsistent shapes, or when cuBLAS or the driver fails.
pub fn attention_f32_probs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    block: usize,
) -> candle_core::Result<Option<Tensor>> {
    if !f32_probs_enabled() || q.device().is_cpu() {
        return Ok(None);
    }
    let Some(Dims { h, kv, t, s, d, dv }) = Dims::of(q, k, v, mask)? else {
        return Ok(None);
    };
    if cfg!(not(feature = "cuda")) {
        return Ok(None);
    }
    // Keys and the values three times along the keys, as bf16, once for every block.
    let kb = k.to_dtype(candle_core::DType::BF16)?.contiguous()?;
    let v3 = Tensor::cat(&[v, v, v], 1)?
        .to_dtype(candle_core::DType::BF16)?
        .contiguous()?;
    let block = block.max(1);
    let mut ys = Vec::with_capacity(t.div_ceil(block));
    for r0 in (0..t).step_by(block) {
        let n = block.min(t - r0);
        let qb = q.narrow(1, r0, n)?.contiguous()?;
        let mb = mask.map(|m| m.narrow(0, r0, n)).transpose()?;
        let dims = Dims {
            h,
            kv,
            t: n,
            s,
            d,
            dv,
        };
        let Some(y) = cuda::attention(&qb, &kb, &v3, scale, mb.as_ref(), dims, true)? else {
            return Ok(None);
        };
        ys.push(y.transpose(0, 1)?.contiguous()?.reshape((n, h * dv))?);
    }
    Ok(Some(Tensor::cat(&ys, 0)?))
}

/// The sizes of one [`attention`] call.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Dims {
    h: usize,
    kv: usize,
    t: usize,
    s: usize,
    d: usize,
    dv: usize,
}

impl Dims {
    /// The sizes of `q` `[h, t, d]`, `k` `[kv, s, d]`, `v` `[kv, s, dv]` and `mask` `[t, s]`;
    /// `None` for an empty product (a size of 0).
    ///
    /// # Errors
    /// A candle error when they do not fit together (`kv` must divide `h`).
    fn of(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> candle_core::Result<Option<Dims>> {
        let (h, t, d) = q.dims3()?;
        let (kv, s, dk) = k.dims3()?;
        let (kv2, s2, dv) = v.dims3()?;
        let mask_ok = mask.map_or(Ok(true), |m| m.dims2().map(|dims| dims == (t, s)))?;
        if kv == 0 || h % kv != 0 || dk != d || (kv2, s2) != (kv, s) || !mask_ok {
            candle_core::bail!(
                "fused attention: q {:?}, k {:?}, v {:?}, mask {:?} do not fit together",
                q.dims(),
                k.dims(),
                v.dims(),
                mask.map(Tensor::dims)
            );
        }
        if t == 0 || s == 0 || d == 0 || dv == 0 {
            return Ok(None);
        }
        Ok(Some(Dims { h, kv, t, s, d, dv }))
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;

    pub(super) fn attention(
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _scale: f64,
        _mask: Option<&Tensor>,
        _dims: Dims,
        _split: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::arch::kernels::{self, alloc, err, u32_arg, with_view, wrap};
    use candle_core::cuda_backend::cudarc::cublas::sys;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device};
    use half::bf16;

    /// Threads per softmax row (a multiple of 32, at most 1024).
    const THREADS: u32 = 256;

    const OP: &str = "fused attention";

    fn int(v: usize, what: &str) -> candle_core::Result<i32> {
        i32::try_from(v).map_err(|_| err(OP, what, format!("{v} is past cuBLAS's 32-bit sizes")))
    }

    /// One operand of [`gemm`]: a device buffer, its leading dimension and batch stride
    /// (elements), in cuBLAS's column-major terms.
    type Operand<'a, P> = (&'a P, usize, usize);

    /// The strided-batched GEMM `C[b] = op(A[b]) · op(B[b])` of `batch` entries, column-major
    /// as cuBLAS states it (`op` transposes where `trans` says): `(m, n, k)` are its sizes,
    /// `A` and `B` bf16, `C` f32, products accumulated in f32 (`CUBLAS_COMPUTE_32F`).
    #[allow(clippy::too_many_arguments, unsafe_code)]
    fn gemm(
        cd: &CudaDevice,
        stream: &CudaStream,
        (trans_a, trans_b): (bool, bool),
        (m, n, k): (usize, usize, usize),
        (a, lda, stride_a): Operand<'_, impl DevicePtr<bf16>>,
        (b, ldb, stride_b): Operand<'_, impl DevicePtr<bf16>>,
        (c, ldc, stride_c): (&mut CudaSlice<f32>, usize, usize),
        batch: usize,
    ) -> candle_core::Result<()> {
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1f32, 0f32);
        let blas = cd.cublas_handle();
        let (pa, _ga) = a.device_ptr(stream);
        let (pb, _gb) = b.device_ptr(stream);
        let (pc, _gc) = c.device_ptr_mut(stream);
        // SAFETY: `a`, `b` and `c` are device buffers on candle's stream, to which its cuBLAS
        // handle is bound; the callers size them for `batch` entries of the given strides,
        // each entry an `m × k`, `k × n` or `m × n` block within its leading dimension.
        unsafe {
            sys::cublasGemmStridedBatchedEx(
                *blas.handle(),
                op(trans_a),
                op(trans_b),
                int(m, "rows")?,
                int(n, "columns")?,
                int(k, "inner size")?,
                (&alpha as *const f32).cast(),
                pa as *const std::ffi::c_void,
                sys::cudaDataType_t::CUDA_R_16BF,
                int(lda, "leading dimension")?,
                stride_a as i64,
                pb as *const std::ffi::c_void,
                sys::cudaDataType_t::CUDA_R_16BF,
                int(ldb, "leading dimension")?,
                stride_b as i64,
                (&beta as *const f32).cast(),
                pc as *mut std::ffi::c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                int(ldc, "leading dimension")?,
                stride_c as i64,
                int(batch, "batch")?,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .result()
            .map_err(|e| err(OP, "cublasGemmStridedBatchedEx", e))
        }
    }

    /// Runs `f` as profile phase `name` (`crate::device::phase`: timed with `ENGY_PROFILE`,
    /// else just run).
    fn step<T>(
        dev: &Device,
        name: &'static str,
        f: impl FnOnce() -> candle_core::Result<T>,
    ) -> candle_core::Result<T> {
        crate::device::phase(dev, name, || Ok(f()?))
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }

    #[allow(unsafe_code)]
    pub(super) fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f64,
        mask: Option<&Tensor>,
        Dims { h, kv, t, s, d, dv }: Dims,
        split: bool,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = q.device() else {
            return Ok(None);
        };
        // With `split`, the exponentials go to the product with `v` unrounded, as three bf16
        // planes whose sum is each f32 exponential (`v` then holds the values three times
        // along the keys, `[kv, 3·s, dv]`, so one GEMM over `3·s` sums all three).
        let planes = if split { 3 } else { 1 };
        let stream = cd.cuda_stream();
        let rep = h / kv;
        let rows = h * t;
        // Scores, row-major [kv, rep·t, s] = Q [rep·t, d] · Kᵀ per KV group (query head
        // `g·rep + r` is row block `r` of group `g`). Column-major: Sᵀ [s, rep·t] =
        // op_T(Kᵀ stored [d, s]) · Qᵀ (stored [d, rep·t]).
        // SAFETY (allocations): the GEMMs write every element of `scores` and `y`, the softmax
        // every row of `e` and every entry of `sums`, before anything reads them.
        let mut scores = unsafe { alloc::<f32>(&stream, rows * s)? };
        step(q.device(), "attention: scores gemm", || {
            with_view::<bf16, _>(q, DType::BF16, |qb| {
                with_view::<bf16, _>(k, DType::BF16, |kb| {
                    gemm(
                        cd,
                        &stream,
                        (true, false),
                        (s, rep * t, d),
                        (&kb, d, s * d),
                        (&qb, d, rep * t * d),
                        (&mut scores, s, rep * t * s),
                        kv,
                    )
                })
            })
        })?;
        // The softmax, one block per score row (head-major rows, as the GEMM wrote them).
        let mut e = unsafe { alloc::<bf16>(&stream, rows * s * planes)? };
        let mut sums = unsafe { alloc::<f32>(&stream, rows)? };
        let name = if split {
            "engy_attention_softmax_split3"
        } else {
            "engy_attention_softmax_bf16"
        };
        let func = cd.get_or_load_custom_func(name, "engy_attention", kernels::ATTENTION)?;
        let (t32, s32) = (u32_arg(OP, "queries", t)?, u32_arg(OP, "keys", s)?);
        let scale32 = scale as f32;
        let cfg = LaunchConfig {
            grid_dim: (u32_arg(OP, "score rows", rows)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = |m: Option<&CudaView<'_, f32>>| -> candle_core::Result<()> {
            let has_mask = i32::from(m.is_some());
            let mut b = func.builder();
            b.arg(&scores);
            match m {
                Some(m) => b.arg(m),
                // Not read when `has_mask` is 0; any device pointer will do.
                None => b.arg(&scores),
            };
            b.arg(&has_mask);
            b.arg(&mut e);
            b.arg(&mut sums);
            b.arg(&t32);
            b.arg(&s32);
            b.arg(&scale32);
            // SAFETY: the kernels' signature is (const float*, const float*, int, bf16*,
            // float*, unsigned, unsigned, float), as pushed; block `r` reads row `r` of
            // `scores` (`rows` rows of `s`) and row `r % t` of the mask (`t` rows of `s`), and
            // writes row `r` of `e` (`planes · s` values) and `sums[r]`.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|x| err(OP, "launching the softmax", x))
        };
        step(q.device(), "attention: softmax", || {
            match mask {
                Some(m) => with_view::<f32, _>(m, DType::F32, |mv| launch(Some(&mv)))?,
                None => launch(None)?,
            }
            Ok(())
        })?;
        drop(scores);
        // y [kv, rep·t, dv] = E [rep·t, s'] · V [s', dv], s' = planes · s. Column-major:
        // yᵀ [dv, rep·t] = Vᵀ (stored [dv, s']) · Eᵀ (stored [s', rep·t]).
        let sp = planes * s;
        let mut y = unsafe { alloc::<f32>(&stream, rows * dv)? };
        step(q.device(), "attention: e·v gemm", || {
            with_view::<bf16, _>(v, DType::BF16, |vb| {
                gemm(
                    cd,
                    &stream,
                    (false, false),
                    (dv, rep * t, sp),
                    (&vb, dv, sp * dv),
                    (&e, sp, rep * t * sp),
                    (&mut y, dv, rep * t * dv),
                    kv,
                )
            })
        })?;
        drop(e);
        let y = wrap(y, cd, (h, t, dv))?;
        Ok(Some(y.broadcast_div(&wrap(sums, cd, (h, t, 1))?)?))
    }
}
