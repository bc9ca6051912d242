//! A softmax router's top-k on a GPU in a bf16 recompute (`kernels/topk.cu`), so that only
//! the chosen experts and their probabilities (`[T, k]`) come back to the host instead of every
//! row's `[T, experts]` logits and probabilities ([`super::ops::softmax_route_in`]).
//!
//! * [`torch_topk`]: per row, the `k` largest values in the order torch's CPU `topk` returns
//!   them: the host's port of libstdc++'s `nth_element` / `partial_sort`
//!   ([`super::ops::torch_topk_indices`]) run step for step by one thread per row, so exact ties
//!   (frequent among bf16 router logits) come out as on the host, bit for bit;
//! * [`torch_topk_start`]: the same, its copy to the host started (into reused page-locked
//!   buffers, an event recorded after it) but not waited for, so the caller can queue work
//!   that does not depend on the routing before [`PendingTopK::wait`].
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
/// `topk` orders them, with the values at them: [`torch_topk_start`], then
/// [`PendingTopK::wait`].
///
/// # Errors
/// A candle error when `probs` is not two-dimensional or the device fails.
pub fn torch_topk(probs: &Tensor, k: usize) -> candle_core::Result<Option<Vec<TopK>>> {
    let Some(pending) = torch_topk_start(probs, k)? else {
        return Ok(None);
    };
    let top = pending.wait()?;
    Ok(Some(
        top.idx
            .chunks_exact(top.k.max(1))
            .zip(top.p.chunks_exact(top.k.max(1)))
            .map(|(i, v)| (i.to_vec(), v.to_vec()))
            .collect(),
    ))
}

/// [`torch_topk`] queued on the device and its copy to the host started, without waiting for
/// it: the caller queues more work (a shared expert, which does not depend on the routing)
/// before [`PendingTopK::wait`], so that the device computes while the host routes.
///
/// # Errors
/// A candle error when `probs` is not two-dimensional or the device fails.
pub fn torch_topk_start(probs: &Tensor, k: usize) -> candle_core::Result<Option<PendingTopK>> {
    if !enabled() || probs.device().is_cpu() {
        return Ok(None);
    }
    let (_, n) = probs.dims2()?;
    let k = k.min(n);
    if k == 0 || n > MAX_EXPERTS {
        return Ok(None);
    }
    Ok(imp::start(probs, k)?.map(PendingTopK))
}

/// Every row's top-k, row-major `[T, k]`: the experts `idx` in torch's order and the row's
/// probabilities `p` at them.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatTopK {
    /// Choices a row.
    pub k: usize,
    /// `T · k` expert indices.
    pub idx: Vec<usize>,
    /// `T · k` probabilities.
    pub p: Vec<f32>,
}

/// A top-k queued by [`torch_topk_start`], its copy to the host under way. Dropping it
/// unwaited waits for the copy (its page-locked buffers go back to a pool for the next call).
#[derive(Debug)]
pub struct PendingTopK(imp::Pending);

impl PendingTopK {
    /// Waits for the copy (and for the device work queued before it) and returns the rows.
    ///
    /// # Errors
    /// A candle error when the device fails.
    pub fn wait(self) -> candle_core::Result<FlatTopK> {
        self.0.wait()
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    /// Never made without the `cuda` feature.
    #[derive(Debug)]
    pub(super) enum Pending {}

    impl Pending {
        pub(super) fn wait(self) -> candle_core::Result<FlatTopK> {
            match self {}
        }
    }

    pub(super) fn start(_probs: &Tensor, _k: usize) -> candle_core::Result<Option<Pending>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{self, alloc, elementwise, err, u32_arg, with_view};
    use candle_core::cuda_backend::cudarc::driver::{
        CudaContext, CudaEvent, PinnedHostSlice, PushKernelArg,
    };
    use candle_core::{DType, Device};
    use std::sync::{Arc, Mutex};

    const OP: &str = "router top-k";
    /// Threads a block: one row each; small blocks spread 4,096 rows over many SMs.
    const THREADS: u32 = 64;
    /// The name the top-k PTX module is cached under on the device.
    const MODULE: &str = "engy_topk";

    /// Page-locked host buffers a copy of the top-k lands in: cached (not write-combined,
    /// which the host reads slowly) and reused, since allocating and freeing page-locked
    /// memory costs more than the copy.
    struct Landing {
        idx: PinnedHostSlice<u32>,
        val: PinnedHostSlice<f32>,
    }

    /// Landing buffers not in use, any context and length (a few: one a layer in flight).
    static POOL: Mutex<Vec<Landing>> = Mutex::new(Vec::new());

    fn landing(ctx: &Arc<CudaContext>, len: usize) -> candle_core::Result<Landing> {
        if let Ok(mut pool) = POOL.lock() {
            if let Some(i) = pool
                .iter()
                .position(|l| Arc::ptr_eq(l.idx.context(), ctx) && l.idx.len() >= len)
            {
                return Ok(pool.swap_remove(i));
            }
        }
        // SAFETY: the contents are unset until a copy fills the first `len` of each; only
        // those are read, after the copy's event.
        let failed = |e| err(OP, "allocating page-locked memory for the copy", e);
        let idx = unsafe { ctx.alloc_pinned_with_flags::<u32>(len, 0) }.map_err(failed)?;
        let val = unsafe { ctx.alloc_pinned_with_flags::<f32>(len, 0) }.map_err(failed)?;
        Ok(Landing { idx, val })
    }

    /// The copy of one top-k under way: its buffers, the event recorded after it, and the
    /// rows' shape.
    pub(super) struct Pending {
        landing: Option<Landing>,
        done: CudaEvent,
        len: usize,
        k: usize,
    }

    impl std::fmt::Debug for Pending {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Pending")
                .field("len", &self.len)
                .field("k", &self.k)
                .finish()
        }
    }

    impl Pending {
        pub(super) fn wait(mut self) -> candle_core::Result<FlatTopK> {
            self.done
                .synchronize()
                .map_err(|e| err(OP, "waiting for the copy", e))?;
            let Some(l) = self.landing.take() else {
                return Err(err(OP, "reading the copy", "the buffers are gone"));
            };
            // SAFETY: the copy into the first `len` elements is done (the event above).
            let (idx, p) = unsafe {
                (
                    std::slice::from_raw_parts(
                        l.idx.as_ptr().map_err(|e| err(OP, "idx", e))?,
                        self.len,
                    ),
                    std::slice::from_raw_parts(
                        l.val.as_ptr().map_err(|e| err(OP, "val", e))?,
                        self.len,
                    ),
                )
            };
            let top = FlatTopK {
                k: self.k,
                idx: idx.iter().map(|&e| e as usize).collect(),
                p: p.to_vec(),
            };
            give_back(l);
            Ok(top)
        }
    }

    impl Drop for Pending {
        fn drop(&mut self) {
            if let Some(l) = self.landing.take() {
                // No copy may still write a buffer that is reused or freed.
                if self.done.synchronize().is_ok() {
                    give_back(l);
                } else {
                    // The device failed: the buffers are leaked (freeing page-locked memory
                    // would wait on the failed device again).
                    std::mem::forget(l);
                }
            }
        }
    }

    fn give_back(l: Landing) {
        if let Ok(mut pool) = POOL.lock() {
            pool.push(l);
        }
    }

    #[allow(unsafe_code)]
    pub(super) fn start(probs: &Tensor, k: usize) -> candle_core::Result<Option<Pending>> {
        let Device::Cuda(cd) = probs.device() else {
            return Ok(None);
        };
        let (rows, n) = probs.dims2()?;
        let stream = cd.cuda_stream();
        let len = rows * k;
        // SAFETY: the kernel writes all `rows · k` elements of both (none when `rows` is 0:
        // nothing is copied then).
        let mut idx = unsafe { alloc::<u32>(&stream, len.max(1))? };
        let mut val = unsafe { alloc::<f32>(&stream, len.max(1))? };
        if rows > 0 {
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
                // SAFETY: (const float*, 3 × uint32_t, uint32_t*, float*) as pushed; `probs`
                // holds rows · n, 1 <= k <= n <= MAX_EXPERTS (checked by the caller), both
                // outputs rows · k.
                unsafe { b.launch(elementwise(OP, rows, THREADS)?) }
                    .map(|_| ())
                    .map_err(|e| err(OP, "launching the top-k", e))
            })?;
        }
        let mut l = landing(stream.context(), len.max(1))?;
        // Into the first `len` of each buffer (a reused one may be longer: cuMemcpyDtoHAsync
        // copies the destination's length). cudarc waits on a pinned buffer's own event only
        // where it manages several streams; the event recorded below is the wait here.
        let copied = if len == 0 {
            stream.record_event(None)
        } else {
            let Landing { idx: li, val: lv } = &mut l;
            li.as_mut_slice()
                .and_then(|i| stream.memcpy_dtoh(&idx, &mut i[..len]))
                .and_then(|()| lv.as_mut_slice())
                .and_then(|v| stream.memcpy_dtoh(&val, &mut v[..len]))
                .and_then(|()| stream.record_event(None))
        };
        match copied {
            Ok(done) => Ok(Some(Pending {
                landing: Some(l),
                done,
                len,
                k,
            })),
            Err(e) => {
                // A copy may have been queued: none may still write the buffers after this.
                if stream.synchronize().is_ok() {
                    give_back(l);
                } else {
                    std::mem::forget(l);
                }
                Err(err(OP, "copying the chosen experts", e))
            }
        }
    }
}
