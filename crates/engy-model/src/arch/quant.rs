//! Decoding of the stored number formats to f32: bf16, f16, f32, FP8 E4M3, and the two
//! quantised weight layouts the served checkpoints use.
//!
//! * **Block FP8** (DeepSeek-V3 / Qwen `-FP8` layout, transformers `finegrained_fp8.py`):
//!   `<m>.weight` F8_E4M3 `[N, K]` and `<m>.weight_scale_inv` (F32 or BF16)
//!   `[ceil(N/bn), ceil(K/bk)]` with `[bn, bk]` = `quantization_config.weight_block_size`;
//!   `W[i, j] = f32(q[i, j]) * scale[i / bn, j / bk]` (the scale multiplies despite its name). The
//!   last tile of a dimension may be partial: the grid is a ceil-division, and the tile index of
//!   element `(i, j)` is always `(i / bn, j / bk)` (transformers' CPU loader derives the tile
//!   size from the shapes instead and gets partial tiles wrong).
//! * **NVFP4** (NVIDIA ModelOpt `NVFP4QTensor`): `<m>.weight` U8 `[N, K/2]` holding two E2M1
//!   codes per byte, element `2j` in the low nibble; `<m>.weight_scale` F8_E4M3 `[N, K/16]`;
//!   `<m>.weight_scale_2` F32 scalar; `W = (e2m1(code) * f32(weight_scale)) * weight_scale_2`.
//!   `<m>.input_scale` quantises activations on real hardware; the audit does not use it.
//!
//! # W8A8: how a serve multiplies block-FP8 weights
//!
//! No GPU serve multiplies a block-FP8 checkpoint in bf16. sglang's `Fp8LinearMethod` with
//! `weight_block_size` (`python/sglang/srt/layers/quantization/fp8.py`, `fp8_utils.py`
//! `apply_w8a8_block_fp8_linear`) and its fused MoE (`fused_moe` with `use_fp8_w8a8=True`,
//! `block_shape=[128, 128]`) quantise every activation row before the product, and
//! transformers' FineGrainedFP8 without `dequantize` (`integrations/finegrained_fp8.py`,
//! `act_quant` + `w8a8_block_fp8_matmul_triton`) does the same. [`act_quant_group`] is that
//! quantiser, [`act_quant_rows`] applies it per token and per group; the recompute that uses it
//! is `Weights::linear_as` with `Fp8Activations::PerTokenGroup`. The rule, from sglang's
//! kernels (`sgl-kernel/csrc/gemm/per_token_group_quant_8bit.cu`, used on CUDA, and the triton
//! `_per_token_group_quant_8bit` in `layers/quantization/fp8_kernel.py`):
//!
//! * groups of 128 consecutive input columns of one token's row (the weight's `bk`; sglang
//!   asserts `K % 128 == 0`, so no group is ragged there; here a ragged last group is
//!   quantised over its own elements, as transformers' `act_quant` would if it allowed it);
//! * `scale = max(max |x|, eps) / 448` in f32, `eps = 1e-10` (`per_token_group_quant_fp8`'s
//!   default), so an all-zero group gets scale `1e-10 / 448` and quantises to zeros; the scale
//!   is stored f32 (row-major on the triton/CUTLASS paths, column-major TMA-aligned for
//!   DeepGEMM on Hopper: the layout changes nothing in the values);
//! * `q = float8_e4m3fn(clamp(x / scale, -448, 448))`: the cast rounds to nearest, ties to
//!   even (`__nv_fp8_e4m3(float)` = `cvt.rn.satfinite.e4m3x2.f32`; triton's `.to(fp8e4nv)`
//!   the same), the clamp makes saturation moot. The triton row-major kernel multiplies by
//!   `1 / scale` instead of dividing, which can move `x / scale` by one f32 ulp: only a value
//!   within an ulp of an e4m3 rounding boundary can land on the other side (not modelled).
//!   transformers' `act_quant` divides by `max |x| / 448` with no eps (its zero rows give
//!   NaN; a final hidden row of a real model is never all zero);
//! * the product: `Σ_kb (a_s[m, kb] · b_s[n/128, kb]) · Σ_{k∈kb} a_q[m, k] · b_q[n, k]`,
//!   accumulated in f32 (`w8a8_block_fp8_matmul`'s `accumulator += tl.dot(a, b) * a_s * b_s`;
//!   DeepGEMM promotes the tensor-core partial sums to f32 every 128 of K), the output cast
//!   once to bf16. Here: the dequantised activation (`q · scale`) times the exactly
//!   dequantised weight in f32, the caller rounding the output to bf16: the same up to the
//!   order of f32 summation.
//! * Not modelled: `scale_ue8m0` (Blackwell's DeepGEMM: scales rounded up to a power of two,
//!   the weights requantised to them at load), and sglang's absorbed MLA (`w_kc`/`w_vc`
//!   requantised per tensor, `per_tensor_quant_mla_fp8`); docs/design/w8a8.md.
use candle_core::Tensor;
use half::{bf16, f16};
use safetensors::Dtype;

/// FP8 E4M3 (`float8_e4m3fn`: bias 7, no infinities, `S.1111.111` is NaN) → f32, all 256 codes.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = i32::from((b >> 3) & 0x0f);
    let man = f32::from(b & 0x07);
    if exp == 0x0f && (b & 0x07) == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The largest finite `float8_e4m3fn` value (`torch.finfo(torch.float8_e4m3fn).max`).
pub const E4M3_MAX: f32 = 448.0;

/// The floor of a group's `max |x|` before it becomes a scale: `per_token_group_quant_fp8`'s
/// default `eps` (sglang `fp8_kernel.py`).
pub const ACT_QUANT_EPS: f32 = 1e-10;

/// The input columns per activation scale: sglang's `block_shape[1]` / the checkpoint's
/// `weight_block_size[1]` on every served FP8 checkpoint.
pub const ACT_QUANT_GROUP: usize = 128;

/// `x` rounded to the nearest `float8_e4m3fn` value, ties to even, saturating to ±448
/// (`cvt.rn.satfinite`): the value the cast `float8_e4m3fn(x)` of a GPU kernel stores, as an
/// f32. NaN stays NaN. Subnormals (below 2⁻⁶) are multiples of 2⁻⁹.
pub fn round_e4m3(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return E4M3_MAX.copysign(x);
    }
    // The spacing of e4m3 values around `a`: 2^(e - 3) for a normal exponent e ≥ −6, 2^-9
    // below (subnormals). Dividing and multiplying by a power of two is exact, so the one
    // rounding is `round_ties_even`'s.
    let e = if a < 2f32.powi(-6) {
        -6
    } else {
        ((a.to_bits() >> 23) as i32) - 127
    };
    let step = 2f32.powi(e - 3);
    let r = ((a / step).round_ties_even() * step).min(E4M3_MAX);
    r.copysign(x)
}

/// One activation group as a block-FP8 serve quantises it ([module docs](self) "W8A8"):
/// `scale = max(max |x|, eps) / 448`, `out[j] = round_e4m3(clamp(x[j] / scale, ±448)) ·
/// scale`, the dequantised value the FP8 product multiplies. Returns the scale (f32).
/// `out.len()` must equal `x.len()` (extra elements of either are left alone).
pub fn act_quant_group(x: &[f32], out: &mut [f32]) -> f32 {
    let amax = x.iter().fold(ACT_QUANT_EPS, |m, v| m.max(v.abs()));
    let scale = amax / E4M3_MAX;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round_e4m3((v / scale).clamp(-E4M3_MAX, E4M3_MAX)) * scale;
    }
    scale
}

/// [`act_quant_group`] over every row of `x` (row-major, `k` columns), per `group` consecutive
/// columns (a ragged last group over its own columns), in place: the activation a block-FP8
/// W8A8 product sees. `k == 0` or `group == 0` leaves `x` unchanged.
pub fn act_quant_rows(x: &mut [f32], k: usize, group: usize) {
    if k == 0 || group == 0 {
        return;
    }
    let mut tmp = vec![0f32; group.min(k)];
    for row in x.chunks_mut(k) {
        for g in row.chunks_mut(group) {
            let t = &mut tmp[..g.len()];
            act_quant_group(g, t);
            g.copy_from_slice(t);
        }
    }
}

/// Whether a GPU recompute quantises W8A8 activations on the device ([`act_quant_tensor`]):
/// not turned off by `ENGY_FUSED_ACT_QUANT=0` (which quantises on the host, as before).
pub fn device_act_quant() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_ACT_QUANT").map_or(true, |v| v != "0"))
}

/// [`act_quant_rows`] as tensor operations on `x`'s own device (`[.., k]`, any float dtype;
/// returns f32 of the same shape), so that a GPU recompute quantises its activations where
/// they are instead of on the host. The same rule step for step, each step exact or one IEEE
/// rounding as on the host: `max |x|` per group of `group` columns floored at
/// [`ACT_QUANT_EPS`], the scale `amax / 448` (an f32 division), `x / scale` (an f32
/// division) clamped to ±448, [`round_e4m3_tensor`], times the scale. `Ok(None)` when `group`
/// is 0 or does not divide `k` (a ragged last group: the caller quantises on the host).
///
/// # Errors
/// Candle errors only.
pub fn act_quant_tensor(x: &Tensor, group: usize) -> candle_core::Result<Option<Tensor>> {
    use candle_core::DType;
    let dims = x.dims().to_vec();
    let k = dims.last().copied().unwrap_or(0);
    if group == 0 || k == 0 || !k.is_multiple_of(group) {
        return Ok(None);
    }
    let n = x.elem_count() / k;
    let dev = x.device();
    let xg = x.to_dtype(DType::F32)?.reshape((n, k / group, group))?;
    let eps = Tensor::new(&[ACT_QUANT_EPS], dev)?;
    let max = Tensor::new(&[E4M3_MAX], dev)?;
    let scale = xg
        .abs()?
        .max_keepdim(2)?
        .broadcast_maximum(&eps)?
        .broadcast_div(&max)?;
    let v = xg
        .broadcast_div(&scale)?
        .broadcast_maximum(&max.neg()?)?
        .broadcast_minimum(&max)?;
    let q = round_e4m3_tensor(&v)?;
    Ok(Some(q.broadcast_mul(&scale)?.reshape(dims)?))
}

/// The activation `x` (`[.., k]`, any float dtype) as a block-FP8 W8A8 product sees it, per
/// row and per `group` columns (returns f32 of `x`'s shape, on `x`'s device): on a GPU by
/// [`act_quant_tensor`] unless [`device_act_quant`] is off, else (and for a ragged last group)
/// on the host by [`act_quant_rows`], the same values either way.
///
/// # Errors
/// Candle errors only.
pub fn act_quant(x: &Tensor, group: usize) -> candle_core::Result<Tensor> {
    if !x.device().is_cpu() && device_act_quant() {
        if let Some(q) = act_quant_tensor(x, group)? {
            return Ok(q);
        }
    }
    let dims = x.dims().to_vec();
    let k = dims.last().copied().unwrap_or(0);
    let mut xs = x
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    act_quant_rows(&mut xs, k, group);
    Tensor::from_vec(xs, dims, x.device())
}

/// [`round_e4m3`] of every element of `v` (f32, each in ±448), in f32 operations that are
/// exact or one IEEE rounding each, so that any device computes the host's value bit for bit
/// (candle's F8E4M3 cast is not used: on CUDA candle 0.9.2 looks its kernel up under a name
/// its kernels do not define).
/// * `|v| ≥ 2⁻⁶` (e4m3's normal range): Veltkamp's split with `σ = 2²⁰ + 1`,
///   `hi = σv − (σv − v)`, keeps the 4 leading significant bits of an f32 rounded to nearest,
///   ties to even (checked against the integer rounding for every f32 in `[2⁻⁶, 448]` of both
///   signs, docs/design/w8a8.md);
/// * below (subnormals, multiples of 2⁻⁹): `(v + C) − C` with `C = 1.5·2¹⁴`, whose f32 spacing
///   is 2⁻⁹, so the addition rounds `v` to the nearest multiple, ties to even;
/// * a zero result keeps `v`'s sign (`v · 0`), as the host's `copysign`.
///
/// # Errors
/// Candle errors only.
pub fn round_e4m3_tensor(v: &Tensor) -> candle_core::Result<Tensor> {
    let dev = v.device();
    let sigma = Tensor::new(&[(1u32 << 20) as f32 + 1.0], dev)?;
    let c = Tensor::new(&[1.5f32 * (1u32 << 14) as f32], dev)?;
    let zero = Tensor::new(&[0f32], dev)?;
    let sv = v.broadcast_mul(&sigma)?;
    let normal = (&sv - (&sv - v)?)?;
    let sub = v.broadcast_add(&c)?.broadcast_sub(&c)?;
    let small = v.abs()?.lt(2f64.powi(-6))?;
    let r = small.where_cond(&sub, &normal)?;
    r.broadcast_eq(&zero)?
        .where_cond(&v.broadcast_mul(&zero)?, &r)
}

/// The 256-entry E4M3 table.
pub fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = e4m3_to_f32(i as u8);
    }
    t
}

/// FP4 E2M1 code (low 4 bits) → f32: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign
/// (code 8 is −0.0).
pub fn e2m1_to_f32(code: u8) -> f32 {
    const MAG: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAG[usize::from(code & 0x07)];
    if code & 0x08 != 0 {
        -m
    } else {
        m
    }
}

/// Converts raw little-endian tensor bytes of a float dtype (BF16, F16, F32, F8_E4M3) to f32.
/// `None` for any other dtype or a byte length that is not a whole number of elements.
pub fn floats(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::BF16 if data.len().is_multiple_of(2) => data
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F16 if data.len().is_multiple_of(2) => data
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::F32 if data.len().is_multiple_of(4) => data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F8_E4M3 => {
            let t = e4m3_table();
            data.iter().map(|&b| t[usize::from(b)]).collect()
        }
        _ => return None,
    })
}

/// Block-FP8 dequantisation of `q` (`[n, k]` E4M3 bytes, row-major) with the scale grid
/// `scale` (`[ceil(n/bn), ceil(k/bk)]`, row-major). Returns `None` when the grid's size does
/// not match the ceil-division.
pub fn dequant_fp8_block(
    q: &[u8],
    n: usize,
    k: usize,
    scale: &[f32],
    block: [usize; 2],
) -> Option<Vec<f32>> {
    let [bn, bk] = block;
    if bn == 0 || bk == 0 || q.len() != n.checked_mul(k)? {
        return None;
    }
    let gc = k.div_ceil(bk);
    if scale.len() != n.div_ceil(bn) * gc {
        return None;
    }
    let t = e4m3_table();
    let mut out = vec![0f32; n * k];
    if k == 0 {
        return Some(out);
    }
    for (i, (qrow, orow)) in q.chunks_exact(k).zip(out.chunks_exact_mut(k)).enumerate() {
        fp8_block_row(&t, qrow, &scale[(i / bn) * gc..(i / bn + 1) * gc], bk, orow);
    }
    Some(out)
}

/// One row of [`dequant_fp8_block`]: `out[j] = table[q[j]] * scale_row[j / bk]`, `table` from
/// [`e4m3_table`], `scale_row` the row's `ceil(k / bk)` tile scales. The three slices must
/// agree (`q.len() == out.len()`, `scale_row.len() == ceil(len / bk)`); extra scales are
/// ignored, missing ones leave the tail of `out` untouched.
pub fn fp8_block_row(table: &[f32; 256], q: &[u8], scale_row: &[f32], bk: usize, out: &mut [f32]) {
    for ((qt, ot), &s) in q
        .chunks(bk.max(1))
        .zip(out.chunks_mut(bk.max(1)))
        .zip(scale_row)
    {
        for (o, &b) in ot.iter_mut().zip(qt) {
            *o = table[usize::from(b)] * s;
        }
    }
}

/// The 16 E2M1 values ([`e2m1_to_f32`]), indexed by code.
pub fn e2m1_table() -> [f32; 16] {
    let mut lut = [0f32; 16];
    for (c, v) in lut.iter_mut().enumerate() {
        *v = e2m1_to_f32(c as u8);
    }
    lut
}

/// NVFP4 dequantisation: `packed` `[n, k/2]` bytes (element `2j` in the low nibble),
/// `scale` `[n, k/group]` E4M3 bytes, `scale_2` the global f32 scale. Returns `None` on a size
/// mismatch.
pub fn dequant_nvfp4(
    packed: &[u8],
    n: usize,
    k: usize,
    scale: &[u8],
    scale_2: f32,
    group: usize,
) -> Option<Vec<f32>> {
    if group == 0
        || !k.is_multiple_of(2)
        || !k.is_multiple_of(group)
        || packed.len() != n.checked_mul(k / 2)?
        || scale.len() != n * (k / group)
    {
        return None;
    }
    let (t, lut) = (e4m3_table(), e2m1_table());
    let gk = k / group;
    let mut out = vec![0f32; n * k];
    if k == 0 {
        return Some(out);
    }
    for (i, orow) in out.chunks_exact_mut(k).enumerate() {
        let prow = &packed[i * k / 2..(i + 1) * k / 2];
        let srow = &scale[i * gk..(i + 1) * gk];
        nvfp4_row(&t, &lut, prow, srow, scale_2, group, orow);
    }
    Some(out)
}

/// One row of [`dequant_nvfp4`]: element `j` of `out` is
/// `(lut[code j] * table[scale_row[j / group]]) * scale_2`, code `2m` the low nibble of
/// `packed[m]` and `2m + 1` its high nibble (`table` from [`e4m3_table`], `lut` from
/// [`e2m1_table`]); `out.len() == 2 * packed.len()`.
pub fn nvfp4_row(
    table: &[f32; 256],
    lut: &[f32; 16],
    packed: &[u8],
    scale_row: &[u8],
    scale_2: f32,
    group: usize,
    out: &mut [f32],
) {
    if group == 0 || !group.is_multiple_of(2) {
        // A group boundary inside a byte: element by element.
        let group = group.max(1);
        for (j, o) in out.iter_mut().enumerate().take(2 * packed.len()) {
            let b = packed[j / 2];
            let code = if j % 2 == 0 { b & 0x0f } else { b >> 4 };
            if let Some(&sb) = scale_row.get(j / group) {
                *o = (lut[usize::from(code)] * table[usize::from(sb)]) * scale_2;
            }
        }
        return;
    }
    for ((pg, og), &sb) in packed
        .chunks(group / 2)
        .zip(out.chunks_mut(group))
        .zip(scale_row)
    {
        let s = table[usize::from(sb)];
        for (o, &b) in og.chunks_exact_mut(2).zip(pg) {
            o[0] = (lut[usize::from(b & 0x0f)] * s) * scale_2;
            o[1] = (lut[usize::from(b >> 4)] * s) * scale_2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_matches_the_format() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert!(e4m3_to_f32(0x7f).is_nan());
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
    }

    #[test]
    fn e4m3_rounding_is_to_nearest_even_and_saturates() {
        // Every finite code round-trips.
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_finite() {
                assert_eq!(round_e4m3(v).to_bits(), v.to_bits(), "code {b:#04x}");
            }
        }
        // Between 1.0 and 1.125 (spacing 1/8): the midpoint 1.0625 ties to the even 1.0,
        // the next midpoint 1.1875 to the even 1.25; just above a midpoint rounds up.
        assert_eq!(round_e4m3(1.0625), 1.0);
        assert_eq!(round_e4m3(1.1875), 1.25);
        assert_eq!(round_e4m3(1.0625f32.next_up()), 1.125);
        assert_eq!(round_e4m3(-1.0625), -1.0);
        // Spacing 32 at the top: 432 ties between 416 (odd mantissa 5) and 448 (6): 448.
        assert_eq!(round_e4m3(432.0), 448.0);
        assert_eq!(round_e4m3(424.0), 416.0);
        // Saturation: nothing rounds to infinity or NaN (`satfinite`).
        assert_eq!(round_e4m3(449.0), 448.0);
        assert_eq!(round_e4m3(1e30), 448.0);
        assert_eq!(round_e4m3(-500.0), -448.0);
        // Subnormals: multiples of 2^-9; half of the smallest ties to 0, 1.5 of it to 2.
        let s = 2f32.powi(-9);
        assert_eq!(round_e4m3(0.5 * s), 0.0);
        assert_eq!(round_e4m3(1.5 * s), 2.0 * s);
        assert_eq!(round_e4m3(2.5 * s), 2.0 * s);
        assert_eq!(round_e4m3(7.5 * s), 8.0 * s); // ties up into the smallest normal 2^-6
        assert!(round_e4m3(f32::NAN).is_nan());
    }

    #[test]
    fn e4m3_rounding_agrees_with_the_float8_crate() {
        // An independent conversion (the `float8` crate's `F8E4M3::from_f32`, round to
        // nearest even) on a sweep of values inside the finite range, midpoints included.
        let mut checked = 0;
        for b in 0u8..=0x7e {
            let lo = e4m3_to_f32(b);
            let hi = e4m3_to_f32(b + 1);
            if !hi.is_finite() {
                continue;
            }
            for f in [0.0f32, 0.25, 0.5, 0.75, 0.4999, 0.5001] {
                let v = lo + (hi - lo) * f;
                for v in [v, -v] {
                    let want = float8::F8E4M3::from_f32(v).to_f32();
                    assert_eq!(round_e4m3(v), want, "{v}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 1000);
    }

    #[test]
    fn act_quant_group_by_hand() {
        // max |x| = 896: scale exactly 2; x / scale = [448, -100, 1.0625, 0, 50.5].
        // -100 lies halfway between -96 (mantissa 1.5, even) and -104 (1.625, odd): -96;
        // 1.0625 halfway between 1 and 1.125: 1; 50.5 → 52 (spacing 4 in [32, 64): 48 and 52).
        let x = [896f32, -200.0, 2.125, 0.0, 101.0];
        let mut out = [9f32; 5];
        let s = act_quant_group(&x, &mut out);
        assert_eq!(s, 2.0);
        assert_eq!(out, [896.0, -192.0, 2.0, 0.0, 104.0]);
        // A scale from a non-power-of-two max: the output is the e4m3 value times the scale.
        let x = [4.48f32, 1.0];
        let s = act_quant_group(&x, &mut out[..2]);
        assert_eq!(s, 4.48f32 / 448.0);
        assert_eq!(out[1], round_e4m3(1.0 / s) * s);
        // A zero group: the eps floor, every value 0 (no NaN).
        let mut z = [1f32; 3];
        assert_eq!(act_quant_group(&[0.0; 3], &mut z), ACT_QUANT_EPS / 448.0);
        assert_eq!(z, [0.0; 3]);
    }

    /// The tensor rounding equals [`round_e4m3`] bit for bit: every e4m3 value and every tie
    /// between two of them (both signs), subnormal ties, signed zeros and values that round to
    /// zero, and a spread of others.
    #[test]
    fn round_e4m3_tensor_is_round_e4m3() {
        let mut v: Vec<f32> = vec![0.0, -0.0, 1e-7, -1e-7, 448.0, -448.0, 2f32.powi(-6)];
        for e in -9..=8 {
            for m in 0..64 {
                let x = m as f32 * 2f32.powi(e - 5);
                if x <= 448.0 {
                    v.extend([x, -x]);
                }
            }
        }
        let mut s = 0x9e37_79b9_u32;
        for _ in 0..20_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(0x3000_0000 + s % 0x1400_0000);
            v.extend([x.min(448.0), -x.min(448.0)]);
        }
        let t = Tensor::from_vec(v.clone(), v.len(), &candle_core::Device::Cpu).unwrap();
        let got = round_e4m3_tensor(&t).unwrap().to_vec1::<f32>().unwrap();
        for (x, g) in v.iter().zip(&got) {
            let want = round_e4m3(*x);
            assert_eq!(g.to_bits(), want.to_bits(), "{x}: {g} != {want}");
        }
    }

    /// The tensor quantiser equals the host's bit for bit (here on the CPU; its operations
    /// round the same way on a GPU): ties of the e4m3 grid, subnormal results, a zero row (the eps
    /// floor), negative values and the ±448 edge; a ragged group is refused.
    #[test]
    fn act_quant_tensor_is_act_quant_rows() {
        let (rows, k, group) = (6usize, 256usize, 128usize);
        let mut x: Vec<f32> = (0..rows * k)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761) >> 8;
                (h as f32 / (1u32 << 24) as f32 - 0.5) * 3.0
            })
            .collect();
        // Row 1: a group whose max is 448 · 2⁻⁴ and exact ties of its e4m3 grid (scale 2⁻⁴:
        // 1.0625 / 2⁻⁴ = 17, halfway between 16 and 18; 1.1875 → 19, between 18 and 20).
        x[k] = 28.0;
        x[k + 1] = 1.0625;
        x[k + 2] = 1.1875;
        x[k + 3] = -1.0625;
        // Row 2, second group: tiny values beside a large one (subnormal quotients).
        x[2 * k + group] = 100.0;
        x[2 * k + group + 1] = 1e-3;
        x[2 * k + group + 2] = -3e-4;
        // Row 3: all zeros.
        x[3 * k..4 * k].iter_mut().for_each(|v| *v = 0.0);
        let mut want = x.clone();
        act_quant_rows(&mut want, k, group);
        let t = Tensor::from_vec(x.clone(), (2, rows / 2, k), &candle_core::Device::Cpu).unwrap();
        let got = act_quant_tensor(&t, group).unwrap().unwrap();
        assert_eq!(got.dims(), &[2, rows / 2, k]);
        let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "element {i}: {g} != {w} (x = {})",
                x[i]
            );
        }
        assert_eq!(want[k + 1], 1.0, "the tie 17 went to even 16");
        assert_eq!(want[k + 2], 1.25, "the tie 19 went to even 20");
        let ragged =
            Tensor::zeros((2, 200), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        assert!(act_quant_tensor(&ragged, group).unwrap().is_none());
        assert!(act_quant_tensor(&t, 0).unwrap().is_none());
    }

    #[test]
    fn act_quant_rows_groups_per_token_and_ragged_edge() {
        // Two rows of 5 columns, groups of 2: [2, 2, 1] per row; each group its own scale.
        let mut x = vec![1.0f32, 3.0, 100.0, 0.3, 7.0, 0.0, 0.0, 5.0, 1e-3, 2.0];
        let want: Vec<f32> = x
            .chunks(5)
            .flat_map(|r| r.chunks(2).map(|g| g.to_vec()).collect::<Vec<_>>())
            .flat_map(|g| {
                let mut o = vec![0f32; g.len()];
                act_quant_group(&g, &mut o);
                o
            })
            .collect();
        act_quant_rows(&mut x, 5, 2);
        assert_eq!(x, want);
        // The ragged group of one element is its own max: exact.
        assert_eq!(x[4], 7.0);
        // Zero group of row 2 stays zero; 0.3 next to 100 is quantised on 100's scale.
        assert_eq!(&x[5..7], &[0.0, 0.0]);
        assert_ne!(x[3], 0.3);
    }

    #[test]
    fn e2m1_codes() {
        let v: Vec<f32> = (0..16).map(e2m1_to_f32).collect();
        assert_eq!(&v[..8], &[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
        assert!(v[8] == 0.0 && v[8].is_sign_negative());
        assert_eq!(v[15], -6.0);
    }

    #[test]
    fn fp8_partial_tiles_use_the_ceil_grid() {
        // [3, 3] with 2×2 tiles: grid [2, 2]; row 2 / column 2 are partial tiles.
        let one = 0x38u8;
        let q = vec![one; 9];
        let scale = [1.0, 2.0, 3.0, 4.0];
        let w = dequant_fp8_block(&q, 3, 3, &scale, [2, 2]).unwrap();
        assert_eq!(w, vec![1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 3.0, 3.0, 4.0]);
        assert!(dequant_fp8_block(&q, 3, 3, &scale[..3], [2, 2]).is_none());
    }

    #[test]
    fn nvfp4_low_nibble_is_the_even_element() {
        // codes: element 0 = 2 (1.0), element 1 = 0xF (-6.0)
        let packed = vec![0xf2u8; 8];
        let scale = vec![0x38u8]; // 1.0 for the group of 16
        let w = dequant_nvfp4(&packed, 1, 16, &scale, 0.5, 16).unwrap();
        assert_eq!(w[0], 0.5);
        assert_eq!(w[1], -3.0);
        assert_eq!(w.len(), 16);
    }
}
