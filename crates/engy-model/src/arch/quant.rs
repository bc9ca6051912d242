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
