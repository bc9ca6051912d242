//! The DSA indexer's top-k of key positions and the attention mask built from it on a GPU
//! (`kernels/dsa.cu`), so that the index scores (`[T, keys]` f32) never come to the host and
//! the mask (`[T, keys]` f32) is never built there and copied up; the kept positions
//! (`[T, index_topk]`) stay there too unless a record asks for them.
//!
//! * [`topk_mask`]: per query row the host's selection ([`super::glm_moe_dsa`]'s indexer:
//!   every causal key when there are at most `index_topk`, else the `index_topk` largest scores
//!   by f32 `total_cmp`, ties by index in the run's DSA tie order, largest first,
//!   [`super::ops::topk_indices_ordered`]), and the mask. The order is strict and total on
//!   (value, index), so the device's sort gives the host's list exactly, not approximately.
//!   The selection stays on the device as a `[T, k]` u32 tensor (each row's kept positions in
//!   order, then [`NONE`]); [`selection_rows`] brings it to the host for a record that asks
//!   for it (an index-set comparison, a traced pass), so a plain pass copies nothing back.
//! * [`mask`] and [`mask_from`]: the mask from a selection already made, on the host or on
//!   the device (a shared-indexer layer reusing the previous layer's).
//!
//! scripts/gpu-check.sh checks both against the host's rule, index for index and bit for bit,
//! on rows full of ties, `-0.0` and NaN (`gpu_kernels`). Each returns `None` where it does not
//! apply (the CPU, a build without the `cuda` feature, `ENGY_FUSED_DSA=0`, more than
//! [`MAX_KEYS`] keys); the caller then selects and builds the mask on the host (counted as a
//! host step, `crate::device::host_steps`).
use candle_core::Tensor;

use super::TieOrder;

/// The most keys a row may have for the device's top-k: its sort holds the row's
/// `(value, index)` pairs as 8-byte keys in one block's shared memory (a power of two at least
/// the row's causal length: 16,384 keys are 128 KiB).
pub const MAX_KEYS: usize = 1 << 14;

/// The padding of a row of a device selection ([`topk_mask`]) past its kept positions.
pub const NONE: u32 = u32::MAX;

/// Whether the kernels may be used: not turned off by `ENGY_FUSED_DSA=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_DSA").map_or(true, |v| v != "0"))
}

/// Whether [`topk_mask`] runs for `total` keys on `index`'s device (the caller then keeps the
/// index scores on the device instead of copying them block by block).
pub fn applies(index_device: &candle_core::Device, total: usize) -> bool {
    cfg!(feature = "cuda") && enabled() && !index_device.is_cpu() && (1..=MAX_KEYS).contains(&total)
}

/// For the index scores `index` `[T, total]` (f32, on a GPU) of query rows at positions
/// `off ..`: the selection, each row's kept key positions (at most `k`, in the host's order,
/// then [`NONE`]) as a `[T, k]` u32 tensor on the device ([`selection_rows`] brings it to the
/// host), and the additive attention mask `[T, total]` (0 at a kept key, `-inf` elsewhere).
///
/// # Errors
/// A candle error when `index` is not `[T, off + T]` or the device fails.
pub fn topk_mask(
    index: &Tensor,
    off: usize,
    k: usize,
    ties: TieOrder,
) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    let (t, total) = index.dims2()?;
    if !applies(index.device(), total) || k == 0 || t == 0 {
        return Ok(None);
    }
    if total != off + t {
        candle_core::bail!("dsa top-k: {t} rows at offset {off} do not have {total} keys");
    }
    imp::topk_mask(index, off, k, ties)
}

/// A selection of [`topk_mask`] (`[T, k]` u32, on any device) as the host holds it: per row
/// its kept positions in order, the [`NONE`] padding dropped. Copies the `T·k` positions to
/// the host (32 MiB a layer at GLM-5's 4,096 rows of 2,048).
///
/// # Errors
/// A candle error when `sel` is not a 2-D u32 tensor or the copy fails.
pub fn selection_rows(sel: &Tensor) -> candle_core::Result<Vec<Vec<usize>>> {
    Ok(sel
        .to_vec2::<u32>()?
        .into_iter()
        .map(|row| {
            row.into_iter()
                .take_while(|&s| s != NONE)
                .map(|s| s as usize)
                .collect()
        })
        .collect())
}

/// How many query rows of a selection cut through a tie, counted where the index scores
/// are (candle operations, any device, so a GPU pass copies nothing to the host): `index`
/// `[T, total]` f32 index scores of rows at positions `off ..`, `sel` `[T, k]` u32 each row's
/// kept positions ([`topk_mask`], or the host's selection padded with [`NONE`]). A row with
/// more causal keys than `k` counts when a causal key left out scores `>=` the least score
/// kept (IEEE: `-0.0` and `0.0` count as equal), and every such row of `index` counts when any
/// score is NaN. So the count is never below the exact one of
/// [`super::ops::topk_cuts_tie`] (`f32::total_cmp`, the selection's own order), and exceeds
/// it only where a `-0.0` meets a `0.0` or a NaN is present: a count of 0 means the other
/// [`TieOrder`] keeps the same sets. Holds about three `[T, total]` f32 tensors at once.
///
/// # Errors
/// A candle error when the shapes do not fit (`total = off + T`, `sel` `[T, k]`), `sel` is not
/// u32, or the device fails.
pub fn rows_cutting_ties(
    index: &Tensor,
    sel: &Tensor,
    off: usize,
    k: usize,
) -> candle_core::Result<usize> {
    use candle_core::DType;
    let (t, total) = index.dims2()?;
    if total != off + t || sel.dims2()? != (t, k) || sel.dtype() != DType::U32 {
        candle_core::bail!(
            "dsa ties: scores {:?} and selection {:?} {:?} of {k} at offset {off} do not fit",
            index.dims(),
            sel.dims(),
            sel.dtype()
        );
    }
    // Row r has off + r + 1 causal keys: more than k from r = k - off on.
    let first = k.saturating_sub(off);
    if first >= t || k == 0 {
        return Ok(0);
    }
    let n = t - first;
    let scores = index.narrow(0, first, n)?;
    let count_f32 = |x: &Tensor| -> candle_core::Result<f32> {
        x.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()
    };
    if count_f32(&scores.ne(&scores)?)? > 0.0 {
        return Ok(n);
    }
    let least = scores
        .gather(&sel.narrow(0, first, n)?.contiguous()?, 1)?
        .min_keepdim(1)?; // [n, 1]
    let dev = index.device();
    let to_u32 = |x: usize| {
        u32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("dsa ties: {x} keys")))
    };
    let keys = Tensor::arange(0u32, to_u32(total)?, dev)?.unsqueeze(0)?; // [1, total]
    let last = Tensor::arange(to_u32(off + first)?, to_u32(off + t)?, dev)?.unsqueeze(1)?;
    let at_least = scores.broadcast_ge(&least)?.to_dtype(DType::F32)?;
    let causal = keys.broadcast_le(&last)?.to_dtype(DType::F32)?;
    // Sums of 0s and 1s: exact in f32 below 2^24 keys a row (the NaN test above only asks
    // whether its sum is positive).
    let per_row = (at_least * causal)?.sum(1)?;
    Ok(count_f32(&per_row.gt(k as f32)?)? as usize)
}

/// [`mask`] for a selection still on the device (`sel` `[T, k]` u32 of [`topk_mask`]): no
/// copy between host and device. `None` where the kernels do not apply (the CPU, a build
/// without the `cuda` feature, `ENGY_FUSED_DSA=0`).
///
/// # Errors
/// A candle error when `sel` is not a 2-D u32 tensor or the device fails.
pub fn mask_from(sel: &Tensor, off: usize, total: usize) -> candle_core::Result<Option<Tensor>> {
    let (t, k) = sel.dims2()?;
    if !cfg!(feature = "cuda") || !enabled() || sel.device().is_cpu() || t == 0 || total == 0 {
        return Ok(None);
    }
    imp::mask_from(sel, off, total, k)
}

/// The additive attention mask `[T, total]` on `device` for the selection `sel` (row `r` at
/// position `off + r` keeps the positions `sel[r]` that are at most `off + r`), as the host
/// builds it.
///
/// # Errors
/// A candle error when the device fails or a position is past 32 bits.
pub fn mask(
    sel: &[Vec<usize>],
    off: usize,
    total: usize,
    device: &candle_core::Device,
) -> candle_core::Result<Option<Tensor>> {
    if !cfg!(feature = "cuda") || !enabled() || device.is_cpu() || sel.is_empty() || total == 0 {
        return Ok(None);
    }
    imp::mask(sel, off, total, device)
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn topk_mask(
        _index: &Tensor,
        _off: usize,
        _k: usize,
        _ties: TieOrder,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        Ok(None)
    }

    pub(super) fn mask_from(
        _sel: &Tensor,
        _off: usize,
        _total: usize,
        _k: usize,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }

    pub(super) fn mask(
        _sel: &[Vec<usize>],
        _off: usize,
        _total: usize,
        _device: &candle_core::Device,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{self, alloc, err, u32_arg, with_view, wrap};
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
    use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device};

    const OP: &str = "dsa top-k";
    /// Threads a block (one block a row).
    const THREADS: u32 = 1024;
    /// The name the DSA PTX module is cached under on the device.
    const MODULE: &str = "engy_dsa";
    /// One block per row: `rows` blocks of [`THREADS`], `shared` bytes of dynamic memory.
    fn per_row(rows: usize, shared: u32) -> candle_core::Result<LaunchConfig> {
        Ok(LaunchConfig {
            grid_dim: (u32_arg(OP, "rows", rows)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared,
        })
    }

    /// The mask kernel on the selection `sel` (`[rows, k]` u32 on the device).
    #[allow(unsafe_code)]
    fn launch_mask(
        cd: &CudaDevice,
        sel: &CudaView<'_, u32>,
        rows: usize,
        off: usize,
        total: usize,
        k: usize,
    ) -> candle_core::Result<Tensor> {
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes all `rows · total` elements.
        let mut mask = unsafe { alloc::<f32>(&stream, rows * total)? };
        let f = cd.get_or_load_custom_func("engy_dsa_mask", MODULE, kernels::DSA)?;
        let args = [
            u32_arg(OP, "rows", rows)?,
            u32_arg(OP, "keys", total)?,
            u32_arg(OP, "offset", off)?,
            u32_arg(OP, "top-k", k)?,
        ];
        let mut b = f.builder();
        b.arg(sel);
        for a in &args {
            b.arg(a);
        }
        b.arg(&mut mask);
        // SAFETY: (const uint32_t*, 4 × uint32_t, float*) as pushed; `sel` holds rows · k,
        // `mask` rows · total; one block a row.
        unsafe { b.launch(per_row(rows, 0)?) }.map_err(|e| err(OP, "launching the mask", e))?;
        wrap(mask, cd, (rows, total))
    }

    #[allow(unsafe_code)]
    pub(super) fn topk_mask(
        index: &Tensor,
        off: usize,
        k: usize,
        ties: TieOrder,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        let Device::Cuda(cd) = index.device() else {
            return Ok(None);
        };
        let (rows, total) = index.dims2()?;
        let stream = cd.cuda_stream();
        let keys = total.next_power_of_two();
        let shared = u32_arg(OP, "shared memory", keys * std::mem::size_of::<u64>())?;
        // SAFETY: the kernel writes all `rows · k` elements.
        let mut sel = unsafe { alloc::<u32>(&stream, rows * k)? };
        let f = cd.get_or_load_custom_func("engy_dsa_topk", MODULE, kernels::DSA)?;
        f.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(|e| err(OP, "asking for the sort's shared memory", e))?;
        let args = [
            u32_arg(OP, "rows", rows)?,
            u32_arg(OP, "keys", total)?,
            u32_arg(OP, "offset", off)?,
            u32_arg(OP, "top-k", k)?,
            u32::from(ties == TieOrder::HigherFirst),
        ];
        with_view::<f32, _>(index, DType::F32, |iv| {
            let mut b = f.builder();
            b.arg(&iv);
            for a in &args {
                b.arg(a);
            }
            b.arg(&mut sel);
            // SAFETY: (const float*, 5 × uint32_t, uint32_t*) as pushed; `index` holds
            // rows · total with total <= MAX_KEYS (checked by the caller), `sel` rows · k; the
            // shared memory holds a power of two >= total of u64 keys.
            unsafe { b.launch(per_row(rows, shared)?) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the top-k", e))
        })?;
        let mask = launch_mask(cd, &sel.slice(..), rows, off, total, k)?;
        Ok(Some((wrap(sel, cd, (rows, k))?, mask)))
    }

    pub(super) fn mask_from(
        sel: &Tensor,
        off: usize,
        total: usize,
        k: usize,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = sel.device() else {
            return Ok(None);
        };
        if sel.dtype() != DType::U32 {
            candle_core::bail!("dsa mask: a selection is u32, not {:?}", sel.dtype());
        }
        let rows = sel.dim(0)?;
        with_view::<u32, _>(sel, DType::U32, |view| {
            launch_mask(cd, &view, rows, off, total, k).map(Some)
        })
    }

    pub(super) fn mask(
        sel: &[Vec<usize>],
        off: usize,
        total: usize,
        device: &Device,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = device else {
            return Ok(None);
        };
        let rows = sel.len();
        let k = sel.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat = vec![NONE; rows * k];
        for (r, keys) in sel.iter().enumerate() {
            for (j, &s) in keys.iter().enumerate() {
                flat[r * k + j] = u32::try_from(s).unwrap_or(NONE);
            }
        }
        let stream = cd.cuda_stream();
        let up = stream
            .clone_htod(&flat)
            .map_err(|e| err(OP, "copying the kept positions up", e))?;
        Ok(Some(launch_mask(cd, &up.slice(..), rows, off, total, k)?))
    }
}
