//! Block-FP8 weights decoded on a GPU in one kernel (`kernels/fp8.cu`) instead of a chain of
//! candle operations (the code table's index-select, a broadcast product over a 5-D view of
//! the tiles and a cast, each a pass over every weight): what the auditor does for every
//! FP8 projection it reads, the routed experts' stacks above all ([`super::Weights::stacked`]:
//! a streamed audit, and the f32 and W8A8 recomputes of a resident one, decode 768 MB of codes
//! a Qwen3.6 layer each pass).
//!
//! The values are the host decode's bit for bit ([`super::quant::dequant_fp8_block`]): each
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

/// `n` block-FP8 matrices `[rows, cols]` decoded: `codes` `[n · rows · cols]` u8 (the stored
/// E4M3 bytes, row-major), `scale` `[n, ⌈rows / bn⌉, ⌈cols / bk⌉]` f32 (the tiles'
/// `weight_scale_inv`; a last partial tile has its own), `table` `[256]` f32 (the decoder's
/// value of each code), all on one GPU → `[n, rows, cols]` in `dtype` (`F32`, or `BF16`: each
/// value rounded to nearest even).
///
/// # Errors
/// A candle error when the sizes disagree, `dtype` is neither F32 nor BF16, a tile side is
/// 0, or the device fails.
pub fn block_decode(
    codes: &Tensor,
    scale: &Tensor,
    table: &Tensor,
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
    if n * rows * cols == 0 {
        return Ok(Some(Tensor::zeros((n, rows, cols), dtype, codes.device())?));
    }
    imp::block_decode(
        codes,
        scale,
        table,
        (n, rows, cols),
        [bn, bk, tn, tk],
        dtype,
    )
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub(super) fn block_decode(
        _codes: &Tensor,
        _scale: &Tensor,
        _table: &Tensor,
        _dims: (usize, usize, usize),
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
        (n, rows, cols): (usize, usize, usize),
        [bn, bk, tn, tk]: [usize; 4],
        dtype: DType,
    ) -> candle_core::Result<Option<Tensor>> {
        let Device::Cuda(cd) = codes.device() else {
            return Ok(None);
        };
        let stream = cd.cuda_stream();
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
        with_view::<u8, _>(codes, DType::U8, |cv| {
            with_view::<f32, _>(scale, DType::F32, |sv| {
                with_view::<f32, _>(table, DType::F32, |tv| {
                    // SAFETY (both arms): (const uint8_t*, const float*, const float*, T*,
                    // 6 × uint32_t) as pushed; `codes` and `out` hold n · rows · cols
                    // elements, `scale` n · tn · tk (checked by the caller), `table` 256; the
                    // kernel writes every element of `out`.
                    macro_rules! launch {
                        ($t:ty, $shape:expr) => {{
                            let mut out = unsafe { alloc::<$t>(&stream, total)? };
                            let mut b = f.builder();
                            b.arg(&cv).arg(&sv).arg(&tv).arg(&mut out);
                            for a in &args {
                                b.arg(a);
                            }
                            unsafe { b.launch(cfg) }
                                .map_err(|e| err(OP, "launching the decode", e))?;
                            wrap(out, cd, $shape)
                        }};
                    }
                    match dtype {
                        DType::BF16 => launch!(bf16, (n, rows, cols)),
                        _ => launch!(f32, (n, rows, cols)),
                    }
                })
            })
        })
        .map(Some)
    }
}
