//! Routed experts' products as one cuBLAS grouped GEMM (`cublasGemmGroupedBatchedEx`, CUDA
//! 12.5+): each expert multiplies exactly its own tokens' rows, reading its weights in place
//! from the layer's stack, so there is no padding to a group's largest count and no copy of
//! the weights into a group ([`super::experts`], docs/AUDITOR.md "On a GPU"). The arithmetic
//! is a bf16 `nn.Linear`'s: bf16 operands, f32 accumulation (`CUBLAS_COMPUTE_32F`, as
//! candle's own matmul), the output rounded to bf16 once.
//!
//! On by default on a GPU; `ENGY_GROUPED_GEMM=0` turns it off (the padded batched products
//! of [`super::experts`] then run), for comparing the two.
use candle_core::Tensor;

use crate::ModelError;

/// Whether [`segmented`] may be used: not turned off by `ENGY_GROUPED_GEMM=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_GROUPED_GEMM").map_or(true, |v| v != "0"))
}

/// `x` `[rows, inp]` bf16 split into consecutive segments `segs` (`(e, n)`: the next `n` rows
/// go through stack entry `e`) times the stacked weights `w` `[E, out, inp]` bf16:
/// `y[r] = x[r] · w[e]ᵀ`, `[rows, out]` bf16. `None` where it does not apply (not a CUDA
/// tensor, not bf16, a build without the `cuda` feature, [`enabled`] false); the caller then
/// multiplies another way.
///
/// # Errors
/// [`ModelError::Shape`] when the segments do not cover `x` or name an entry past `E`;
/// [`ModelError::Device`] when cuBLAS or the driver fails.
pub fn segmented(
    x: &Tensor,
    w: &Tensor,
    segs: &[(usize, usize)],
) -> Result<Option<Tensor>, ModelError> {
    if !enabled() || x.dtype() != candle_core::DType::BF16 || w.dtype() != x.dtype() {
        return Ok(None);
    }
    let (rows, inp) = x.dims2()?;
    let (e, out, w_inp) = w.dims3()?;
    let covered: usize = segs.iter().map(|s| s.1).sum();
    if w_inp != inp || covered != rows || segs.iter().any(|&(i, n)| i >= e || n == 0) {
        return Err(ModelError::Shape {
            name: "grouped expert product".into(),
            got: vec![rows, inp, covered],
            want: vec![rows, w_inp, rows],
        });
    }
    cuda::segmented(x, w, segs, (rows, inp, out))
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;

    pub(super) fn segmented(
        _x: &Tensor,
        _w: &Tensor,
        _segs: &[(usize, usize)],
        _dims: (usize, usize, usize),
    ) -> Result<Option<Tensor>, ModelError> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use candle_core::cuda_backend::cudarc::cublas::sys;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
    use candle_core::{Device, Storage};
    use half::bf16;

    #[allow(unsafe_code)]
    pub(super) fn segmented(
        x: &Tensor,
        w: &Tensor,
        segs: &[(usize, usize)],
        (rows, inp, out): (usize, usize, usize),
    ) -> Result<Option<Tensor>, ModelError> {
        let Device::Cuda(cd) = x.device() else {
            return Ok(None);
        };
        let dev_err = |what: &str, e: &dyn std::fmt::Display| {
            ModelError::Device(format!("grouped expert product: {what}: {e}"))
        };
        let (x, w) = (x.contiguous()?, w.contiguous()?);
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (Storage::Cuda(xs), Storage::Cuda(ws)) = (&*xs, &*ws) else {
            return Ok(None);
        };
        let (xsl, wsl) = (xs.as_cuda_slice::<bf16>()?, ws.as_cuda_slice::<bf16>()?);
        let stream = cd.cuda_stream();
        // SAFETY: every element of `y` is written by the products below (the segments cover
        // all `rows` rows, each `out` wide) before the tensor is read.
        let mut y = unsafe { stream.alloc::<bf16>(rows * out) }
            .map_err(|e| dev_err("allocating the output", &e))?;
        let size = std::mem::size_of::<bf16>() as u64;
        let mut a = Vec::with_capacity(segs.len());
        let mut b = Vec::with_capacity(segs.len());
        let mut c = Vec::with_capacity(segs.len());
        let mut n = Vec::with_capacity(segs.len());
        {
            let (xp, _x_guard) = xsl.device_ptr(&stream);
            let (wp, _w_guard) = wsl.device_ptr(&stream);
            let (yp, _y_guard) = y.device_ptr_mut(&stream);
            let (x0, w0) = (xl.start_offset() as u64, wl.start_offset() as u64);
            let mut r = 0u64;
            for &(ei, ni) in segs {
                // Column-major view (cuBLAS): yᵀ [out, n] = w[e] (stored [out, inp] row-major,
                // so `T` of an [inp, out] column-major matrix) · xᵀ [inp, n].
                a.push(wp + (w0 + (ei * out * inp) as u64) * size);
                b.push(xp + (x0 + r * inp as u64) * size);
                c.push(yp + r * out as u64 * size);
                n.push(ni as i32);
                r += ni as u64;
            }
        }
        let g = segs.len();
        let up = |v: &[u64], what: &str| {
            stream
                .clone_htod(v)
                .map_err(|e| dev_err(&format!("copying the {what} pointers"), &e))
        };
        let (da, db, mut dc) = (up(&a, "weight")?, up(&b, "input")?, up(&c, "output")?);
        let to_i32 = |v: usize| i32::try_from(v).unwrap_or(i32::MAX);
        let transa = vec![sys::cublasOperation_t::CUBLAS_OP_T; g];
        let transb = vec![sys::cublasOperation_t::CUBLAS_OP_N; g];
        let m = vec![to_i32(out); g];
        let k = vec![to_i32(inp); g];
        let (lda, ldb, ldc) = (
            vec![to_i32(inp); g],
            vec![to_i32(inp); g],
            vec![to_i32(out); g],
        );
        let alpha = vec![1f32; g];
        let beta = vec![0f32; g];
        let ones = vec![1i32; g];
        let blas = cd.cublas_handle();
        {
            let (pa, _ga) = da.device_ptr(&stream);
            let (pb, _gb) = db.device_ptr(&stream);
            let (pc, _gc) = dc.device_ptr_mut(&stream);
            // SAFETY: the pointer arrays are on the device (cuBLAS reads them there), each
            // pointing into `w`, `x` or `y` at an offset whose `m × k`, `k × n` or `m × n`
            // block lies inside it (checked shapes above); the size arrays are host arrays of
            // `g` entries, as the call requires; all work is ordered on candle's stream, to
            // which its cuBLAS handle is bound.
            unsafe {
                sys::cublasGemmGroupedBatchedEx(
                    *blas.handle(),
                    transa.as_ptr(),
                    transb.as_ptr(),
                    m.as_ptr(),
                    n.as_ptr(),
                    k.as_ptr(),
                    alpha.as_ptr().cast(),
                    pa as *const *const std::ffi::c_void,
                    sys::cudaDataType_t::CUDA_R_16BF,
                    lda.as_ptr(),
                    pb as *const *const std::ffi::c_void,
                    sys::cudaDataType_t::CUDA_R_16BF,
                    ldb.as_ptr(),
                    beta.as_ptr().cast(),
                    pc as *const *mut std::ffi::c_void,
                    sys::cudaDataType_t::CUDA_R_16BF,
                    ldc.as_ptr(),
                    to_i32(g),
                    ones.as_ptr(),
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
                .result()
                .map_err(|e| dev_err("cublasGemmGroupedBatchedEx", &e))?;
            }
        }
        // The device pointer arrays are freed in stream order (after the products have read
        // them), so nothing waits here.
        drop((da, db, dc));
        let storage = candle_core::cuda_backend::CudaStorage::wrap_cuda_slice(y, cd.clone());
        Ok(Some(Tensor::from_storage(
            Storage::Cuda(storage),
            (rows, out),
            candle_core::op::BackpropOp::none(),
            false,
        )))
    }
}
