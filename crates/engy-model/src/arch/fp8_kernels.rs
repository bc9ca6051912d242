//! Block-FP8 weights decoded on a GPU in one kernel (`kernels/fp8.cu`) instead of a chain of
//! candle operations (the code table's index-select, a broadcast product over a 5-D view of
//! the tiles and a cast, each a pass over every weight): what the auditor does for every
//! FP8 projection it reads, the routed experts' stacks above all ([`super::Weights::stacked`]:
//! a streamed audit, and the f32 and W8A8 recomputes of a resident one, decode 768 MB of codes
//! a Qwen3.6 layer each pass). [`Fp8Stack`] holds a layer's experts as stored, for a recompute
//! that decodes only the few a product needs.
//!
//! The values are the host decode's bit for bit ([`super::quant::dequant_fp8_block`]; E4M3's
//! two NaN codes give a NaN either way, its sign and payload not kept): each
//! code through the host decoder's table ([`super::quant::e4m3_table`]), times its tile's f32
//! scale (one IEEE product), kept f32 or rounded to bf16 nearest even as a bf16 recompute
//! holds it (`gpu_kernels`: `the_fp8_decode_kernel_is_the_host_decode`). [`block_decode`]
//! returns `None` where it does not apply (the CPU, a build without the `cuda` feature,
//! `ENGY_FUSED_FP8_DECODE=0`); the caller then runs the candle operations.
use candle_core::{DType, Tensor};

/// Whether the kernel may be used: not turned off by `ENGY_FUSED_FP8_DECODE=0`.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_FP8_DECODE").map_or(true, |v| v != "0"))
}

/// Block-FP8 matrices as stored, on a GPU: `n` matrices `[rows, cols]` whose codes stay 1
/// byte a weight until [`Fp8Stack::decode`] decodes the few a product needs. A layer's routed
/// experts are held so by a recompute that multiplies f32 weights (the f32 and W8A8
/// recomputes, [`super::experts`]): a Qwen3.6 layer's 256 experts are 768 MB of codes against
/// 3 GB of f32, and beside a resident model's kept bf16 weights an 80 GB card has room for
/// the one, not the other.
#[derive(Debug, Clone)]
pub struct Fp8Stack {
    /// The stored E4M3 bytes, `[n · rows · cols]` u8, row-major.
    pub codes: Tensor,
    /// The tiles' `weight_scale_inv`, `[n, ⌈rows / bn⌉, ⌈cols / bk⌉]` f32 (a last partial
    /// tile has its own).
    pub scale: Tensor,
    /// The decoder's value of each code, `[256]` f32 ([`super::quant::e4m3_table`]).
    pub table: Tensor,
    /// `(n, rows, cols)`.
    pub dims: (usize, usize, usize),
    /// The tile, `[bn, bk]` (`weight_block_size`).
    pub block: [usize; 2],
}

impl Fp8Stack {
    /// Matrices `members` (each below `n`, in that order) decoded: `[members.len(), rows,
    /// cols]` in `dtype` ([`block_decode`]'s values).
    ///
    /// # Errors
    /// As [`block_decode`]; also when the kernel does not apply (the CPU, no `cuda` feature,
    /// `ENGY_FUSED_FP8_DECODE=0`: no such stack is made there).
    pub fn decode(&self, members: &[u32], dtype: DType) -> candle_core::Result<Tensor> {
        let t = block_decode(
            &self.codes,
            &self.scale,
            &self.table,
            members,
            self.dims,
            self.block,
            dtype,
        )?;
        t.ok_or_else(|| candle_core::Error::Msg("fp8 decode: the kernel does not apply".into()))
    }
}

/// Matrices `members` of `n` stored block-FP8 ones decoded: `codes` `[n · rows · cols]` u8 and
/// `scale` `[n, ⌈rows / bn⌉, ⌈cols / bk⌉]` f32 as in [`Fp8Stack`], `table` `[256]` f32, all on
/// one GPU → `[members.len(), rows, cols]` in `dtype` (`F32`, or `BF16`: each value rounded to
/// nearest even), matrix `i` being stored matrix `members[i]`.
///
/// # Errors
/// A candle error when the sizes disagree, a member is not below `n`, `dtype` is neither F32
/// nor BF16, a tile side is 0, or the device fails.
pub fn block_decode(
    codes: &Tensor,
    scale: &Tensor,
    table: &Tensor,
    members: &[u32],
    (n, rows, cols): (usize, usize, usize),
    [bn, bk]: [usize; 2],
    dtype: DType,
) -> candle_core::Result<Option<Tensor>> {
    if !enabled() || codes.device().is_cpu() {
        return Ok(None);
    }
    if bn == 0 || bk == 0 || !matches!(dtype, DType::F32 | DType::BF16) {
        candle_core::bail!("fp8 decode: tiles {bn}×{bk}, output {dtype:?}");
    }
    if let Some(bad) = members.iter().find(|&&m| m as usize >= n) {
        candle_core::bail!("fp8 decode: matrix {bad} of {n}");
    }
    let (tn, tk) = (rows.div_ceil(bn), cols.div_ceil(bk));
    if codes.elem_count() != n * rows * cols
        || codes.dtype() != DType::U8
        || scale.dims() != [n, tn, tk]
        || table.elem_count() != 256
    {
        candle_core::bail!(
            "fp8 decode: {} codes {:?}, scale {:?}, table of {} for {n} × [{rows}, {cols}] in {bn}×{bk} tiles",
            codes.elem_count(),
            codes.dtype(),
            scale.dims(),
            table.elem_count()
        );
    }
    let m = members.len();
    if m * rows * cols == 0 {
        return Ok(Some(Tensor::zeros((m, rows, cols), dtype, codes.device())?));
    }
    imp::block_decode(
        codes,
        scale,
        table,
        members,
        (rows, cols),
        [bn, bk, tn, tk],
        dtype,
    )
}

/// `0, 1, …, n − 1`: every stored matrix, in order, for [`block_decode`].
pub fn all(n: usize) -> Vec<u32> {
    (0..n as u32).collect()
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn block_decode(
        _codes: &Tensor,
        _scale: &Tensor,
        _table: &Tensor,
        _members: &[u32],
        _dims: (usize, usize),
        _tiles: [usize; 4],
        _dtype: DType,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::arch::kernels::{self, alloc, err, u32_arg, with_view, wrap};
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::Device;
    use half::bf16;

    const OP: &str = "fp8 decode";
    const THREADS: u32 = 256;
    /// The name the decode's PTX module is cached under on the device.
    const MODULE: &str = "engy_fp8";

    #[allow(unsafe_code)]
    pub(super) fn block_decode(
        codes: &Tensor,
        scale: &Tensor,
        table: &Tensor,
        members: &[u32],
        (rows, cols): (usize, usize),
        [bn, bk, tn, tk]: [usize; 4],
        dtype: DType,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = codes.device() else {
            return Ok(None);
        };
        let stream = cd.cuda_stream();
        let n = members.len();
        let total = n * rows * cols;
        let args = [
            u32_arg(OP, "rows", rows)?,
            u32_arg(OP, "columns", cols)?,
            u32_arg(OP, "tile rows", bn)?,
            u32_arg(OP, "tile columns", bk)?,
            u32_arg(OP, "tiles down", tn)?,
            u32_arg(OP, "tiles across", tk)?,
        ];
        let blocks = u32_arg(OP, "matrix rows", n * rows)?;
        if blocks > i32::MAX as u32 {
            candle_core::bail!("{OP}: {blocks} rows are past one launch");
        }
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let name = match dtype {
            DType::BF16 => "engy_fp8_block_decode_bf16",
            _ => "engy_fp8_block_decode_f32",
        };
        let f = cd.get_or_load_custom_func(name, MODULE, kernels::FP8)?;
        let ids = stream
            .clone_htod(members)
            .map_err(|e| err(OP, "copying the members", e))?;
        with_view::<u8, _>(codes, DType::U8, |cv| {
            with_view::<f32, _>(scale, DType::F32, |sv| {
                with_view::<f32, _>(table, DType::F32, |tv| {
                    // SAFETY (both arms): (const uint8_t*, const float*, const float*,
                    // const uint32_t*, T*, 6 × uint32_t) as pushed; every member is below the
                    // stored count, whose codes and scales `codes` and `scale` hold (checked
                    // by the caller), `table` holds 256, `ids` the n members and `out`
                    // n · rows · cols elements, every one of which the kernel writes.
                    macro_rules! launch {
                        ($t:ty) => {{
                            let mut out = unsafe { alloc::<$t>(&stream, total)? };
                            let mut b = f.builder();
                            b.arg(&cv).arg(&sv).arg(&tv).arg(&ids).arg(&mut out);
                            for a in &args {
                                b.arg(a);
                            }
                            unsafe { b.launch(cfg) }
                                .map_err(|e| err(OP, "launching the decode", e))?;
                            wrap(out, cd, (n, rows, cols))
                        }};
                    }
                    match dtype {
                        DType::BF16 => launch!(bf16),
                        _ => launch!(f32),
                    }
                })
            })
        })
        .map(Some)
    }
}
