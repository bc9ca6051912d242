//! engy's own CUDA kernels (`kernels/*.cu`, compiled to PTX by `build.rs` with the `cuda`
//! feature) and the device-buffer plumbing their launchers share ([`super::fused_attention`],
//! [`super::delta_rule`], [`super::expert_kernels`], [`super::deltanet_kernels`],
//! [`super::router_kernels`], [`super::dsa_kernels`], [`super::norm_kernels`],
//! [`super::fp8_kernels`]). Only in a `cuda` build.
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, CudaView, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{DType, Storage, Tensor};

/// The PTX of `kernels/attention.cu`.
pub(crate) const ATTENTION: &str = include_str!(concat!(env!("OUT_DIR"), "/attention.ptx"));
/// The PTX of `kernels/gated_deltanet.cu`.
pub(crate) const GATED_DELTANET: &str =
    include_str!(concat!(env!("OUT_DIR"), "/gated_deltanet.ptx"));
/// The PTX of `kernels/dsa.cu`.
pub(crate) const DSA: &str = include_str!(concat!(env!("OUT_DIR"), "/dsa.ptx"));
/// The PTX of `kernels/fp8.cu`.
pub(crate) const FP8: &str = include_str!(concat!(env!("OUT_DIR"), "/fp8.ptx"));
/// The PTX of `kernels/experts.cu`.
pub(crate) const EXPERTS: &str = include_str!(concat!(env!("OUT_DIR"), "/experts.ptx"));
/// The PTX of `kernels/delta_rule.cu`.
pub(crate) const DELTA_RULE: &str = include_str!(concat!(env!("OUT_DIR"), "/delta_rule.ptx"));
/// The PTX of `kernels/norm.cu`.
pub(crate) const NORM: &str = include_str!(concat!(env!("OUT_DIR"), "/norm.ptx"));
/// The PTX of `kernels/topk.cu`.
pub(crate) const TOPK: &str = include_str!(concat!(env!("OUT_DIR"), "/topk.ptx"));

/// A candle error naming the operation (`op`) and what failed in it.
pub(crate) fn err(op: &str, what: &str, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("{op}: {what}: {e}"))
}

/// `v` as a kernel's 32-bit size argument.
pub(crate) fn u32_arg(op: &str, what: &str, v: usize) -> candle_core::Result<u32> {
    u32::try_from(v).map_err(|_| err(op, what, format!("{v} is past 32 bits")))
}

/// `n` uninitialised elements on `stream`.
///
/// # Safety
/// The caller writes every element (a kernel or GEMM output) before anything reads it.
#[allow(unsafe_code)]
pub(crate) unsafe fn alloc<T: DeviceRepr>(
    stream: &std::sync::Arc<CudaStream>,
    n: usize,
) -> candle_core::Result<CudaSlice<T>> {
    // SAFETY: passed on to the caller (above).
    unsafe { stream.alloc::<T>(n) }.map_err(|e| err("device memory", "allocating", e))
}

/// Runs `f` on the elements of `x` converted to `dtype` and made contiguous (a copy only where
/// it is not already so), as a device view.
///
/// # Errors
/// A candle error when `x` is not on a GPU, or the conversion's.
pub(crate) fn with_view<T: CudaDType, R>(
    x: &Tensor,
    dtype: DType,
    f: impl FnOnce(CudaView<'_, T>) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let x = x.to_dtype(dtype)?.contiguous()?;
    let (st, l) = x.storage_and_layout();
    let Storage::Cuda(st) = &*st else {
        candle_core::bail!("a kernel's operand is not on the GPU");
    };
    let n = l.shape().elem_count();
    f(st.as_cuda_slice::<T>()?
        .slice(l.start_offset()..l.start_offset() + n))
}

/// [`with_view`] on several tensors at once: `f` gets their views in the order of `xs`
/// (each converted to `dtype` and made contiguous where it is not already so).
///
/// # Errors
/// A candle error when a tensor is not on a GPU, or a conversion's.
pub(crate) fn with_views<T: CudaDType, R>(
    xs: &[&Tensor],
    dtype: DType,
    f: impl FnOnce(&[CudaView<'_, T>]) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let xs = xs
        .iter()
        .map(|x| x.to_dtype(dtype)?.contiguous())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let held: Vec<_> = xs.iter().map(Tensor::storage_and_layout).collect();
    let mut views = Vec::with_capacity(held.len());
    for (st, l) in &held {
        let Storage::Cuda(st) = &**st else {
            candle_core::bail!("a kernel's operand is not on the GPU");
        };
        let n = l.shape().elem_count();
        views.push(
            st.as_cuda_slice::<T>()?
                .slice(l.start_offset()..l.start_offset() + n),
        );
    }
    f(&views)
}

/// A tensor of `shape` over the device buffer `buf` (which holds exactly its elements).
///
/// # Errors
/// A candle error when the shape does not fit the buffer.
pub(crate) fn wrap<T: CudaDType>(
    buf: CudaSlice<T>,
    cd: &CudaDevice,
    shape: impl Into<candle_core::Shape>,
) -> candle_core::Result<Tensor> {
    let shape = shape.into();
    if shape.elem_count() != buf.len() {
        candle_core::bail!("{} elements do not make a {shape:?}", buf.len());
    }
    let st = CudaStorage::wrap_cuda_slice(buf, cd.clone());
    Ok(Tensor::from_storage(
        Storage::Cuda(st),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// A launch of `total` independent elements, `threads` a block, for a grid-stride loop.
///
/// # Errors
/// A candle error past 2³¹ − 1 blocks.
pub(crate) fn elementwise(
    op: &str,
    total: usize,
    threads: u32,
) -> candle_core::Result<candle_core::cuda_backend::cudarc::driver::LaunchConfig> {
    let blocks = total.div_ceil(threads as usize).clamp(1, i32::MAX as usize);
    Ok(candle_core::cuda_backend::cudarc::driver::LaunchConfig {
        grid_dim: (u32_arg(op, "blocks", blocks)?, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}
