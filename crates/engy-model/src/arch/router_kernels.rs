//! A softmax router's top-k on a GPU in a bf16 recompute (`kernels/topk.cu`), so that only
//! the chosen experts and their probabilities (`[T, k]`) come back to the host instead of every
//! row's `[T, experts]` logits and probabilities ([`super::ops::softmax_route_in`]).
//!
//! * [`torch_topk`]: per row, the `k` largest values in the order torch's CPU `topk` returns
//!   them: the host's port of libstdc++'s `nth_element` / `partial_sort`
//!   ([`super::ops::torch_topk_indices`]) run step for step by one thread per row, so exact ties
//!   (frequent among bf16 router logits) come out as on the host, bit for bit.
//!
//! scripts/gpu-check.sh checks it against the host's port on rows full of ties (`gpu_kernels`).
//! It returns `None` where it does not apply (the CPU, a build without the `cuda` feature,
//! `ENGY_FUSED_ROUTING=0`, rows of more than [`MAX_EXPERTS`] values); the caller then copies
//! the rows and chooses on the host (counted as a host step, `crate::device::host_steps`).
use candle_core::Tensor;

/// The widest row the kernel takes (its per-thread buffer, `ENGY_TOPK_MAX_N` in
/// `kernels/topk.cu`): routers of up to 512 experts.
pub const MAX_EXPERTS: usize = 512;

/// Whether the kernel may be used: not turned off by `ENGY_FUSED_ROUTING=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_ROUTING").map_or(true, |v| v != "0"))
}

/// One row's top-k: the chosen indices in torch's order and the row's values at them.
pub type TopK = (Vec<usize>, Vec<f32>);

/// Per row of `probs` `[T, n]` (f32, on a GPU), the `min(k, n)` largest values as torch's CPU
/// `topk` orders them, with the values at them.
///
/// # Errors
/// A candle error when `probs` is not two-dimensional or the device fails.
pub fn torch_topk(probs: &Tensor, k: usize) -> candle_core::Result<Option<Vec<TopK>>> {
    if !enabled() || probs.device().is_cpu() {
        return Ok(None);
    }
    let (_, n) = probs.dims2()?;
    let k = k.min(n);
    if k == 0 || n > MAX_EXPERTS {
        return Ok(None);
    }
    imp::torch_topk(probs, k)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn torch_topk(_probs: &Tensor, _k: usize) -> candle_core::Result<Option<Vec<TopK>>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{self, alloc, elementwise, err, u32_arg, with_view};
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    use candle_core::{DType, Device};

    const OP: &str = "router top-k";
    /// Threads a block: one row each; small blocks spread 4,096 rows over many SMs.
    const THREADS: u32 = 64;
    /// The name the top-k PTX module is cached under on the device.
    const MODULE: &str = "engy_topk";

    #[allow(unsafe_code)]
    pub(super) fn torch_topk(probs: &Tensor, k: usize) -> candle_core::Result<Option<Vec<TopK>>> {
        let Device::Cuda(cd) = probs.device() else {
            return Ok(None);
        };
        let (rows, n) = probs.dims2()?;
        if rows == 0 {
            return Ok(Some(Vec::new()));
        }
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes all `rows · k` elements of both.
        let mut idx = unsafe { alloc::<u32>(&stream, rows * k)? };
        let mut val = unsafe { alloc::<f32>(&stream, rows * k)? };
        let f = cd.get_or_load_custom_func("engy_torch_topk", MODULE, kernels::TOPK)?;
        let args = [
            u32_arg(OP, "rows", rows)?,
            u32_arg(OP, "experts", n)?,
            u32_arg(OP, "top-k", k)?,
        ];
        with_view::<f32, _>(probs, DType::F32, |pv| {
            let mut b = f.builder();
            b.arg(&pv);
            for a in &args {
                b.arg(a);
            }
            b.arg(&mut idx).arg(&mut val);
            // SAFETY: (const float*, 3 × uint32_t, uint32_t*, float*) as pushed; `probs` holds
            // rows · n, 1 <= k <= n <= MAX_EXPERTS (checked by the caller), both outputs rows · k.
            unsafe { b.launch(elementwise(OP, rows, THREADS)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the top-k", e))
        })?;
        let idx = stream
            .clone_dtoh(&idx)
            .map_err(|e| err(OP, "copying the chosen experts", e))?;
        let val = stream
            .clone_dtoh(&val)
            .map_err(|e| err(OP, "copying their probabilities", e))?;
        Ok(Some(
            idx.chunks_exact(k)
                .zip(val.chunks_exact(k))
                .map(|(i, v)| (i.iter().map(|&e| e as usize).collect(), v.to_vec()))
                .collect(),
        ))
    }
}
