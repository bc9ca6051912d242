//! `y = x · Wᵀ` straight from a stored weight (block FP8, NVFP4, bf16, f16, f32), without an
//! f32 copy of `W`: the fused dequantise-and-multiply the streaming audit uses for few-row
//! products.
//!
//! A routed expert of a real-shape MoE sees 1–4 of a pass's 64 tokens, so decoding its whole
//! `[out, in]` matrix to f32, transposing it and handing it to a matmul costs far more than the
//! `2 · n · out · in` flops of the product (bench/RESULTS.md, "Where a real-shape
//! layer's time went"). [`QuantMatrix::linear`] instead decodes one weight row at a time into a buffer of
//! `in` floats (L1-resident) and dots it against the `n` rows of `x`, in parallel over blocks
//! of output rows (rayon).
//!
//! Numerics: every weight is decoded with exactly the formulas of [`super::quant`] (the same
//! row functions [`super::quant::dequant_fp8_block`] and [`super::quant::dequant_nvfp4`] use);
//! products and sums are f32, so the result differs from the plain dequantise-then-matmul path
//! only by the order of the f32 summation.
use rayon::prelude::*;
use safetensors::Dtype;

use super::quant;

/// Output rows (weight rows) per parallel task.
const ROWS_PER_TASK: usize = 16;

/// How the bytes of a [`QuantMatrix`] encode its values.
#[derive(Debug, Clone)]
enum Format<'a> {
    /// E4M3 bytes `[rows, cols]` and the tile scales `[ceil(rows/bn), ceil(cols/bk)]`.
    Fp8Block {
        q: &'a [u8],
        scale: Vec<f32>,
        block: [usize; 2],
    },
    /// Packed E2M1 pairs `[rows, cols/2]`, E4M3 group scales `[rows, cols/group]`, the global
    /// scale.
    Nvfp4 {
        packed: &'a [u8],
        scale: &'a [u8],
        scale_2: f32,
        group: usize,
    },
    /// Little-endian BF16, F16 or F32 values, or unscaled E4M3 bytes, `[rows, cols]`.
    Float { dtype: Dtype, data: &'a [u8] },
}

/// A 2-D weight `W` `[rows, cols]` (nn.Linear's `[out, in]`) as it is stored, borrowed from the
/// checkpoint's map. Built by the checked constructors, so every row decodes in full.
#[derive(Debug, Clone)]
pub struct QuantMatrix<'a> {
    rows: usize,
    cols: usize,
    format: Format<'a>,
}

/// The decoding tables, built once per product.
struct Tables {
    e4m3: [f32; 256],
    e2m1: [f32; 16],
}

impl<'a> QuantMatrix<'a> {
    /// Block FP8 (see [`super::quant`]): `q` `[rows, cols]` E4M3 bytes, `scale` the
    /// `[ceil(rows/bn), ceil(cols/bk)]` grid for tiles `block = [bn, bk]`. `None` when a size
    /// does not match.
    pub fn fp8_block(
        q: &'a [u8],
        rows: usize,
        cols: usize,
        scale: Vec<f32>,
        block: [usize; 2],
    ) -> Option<Self> {
        let [bn, bk] = block;
        if bn == 0 || bk == 0 || q.len() != rows.checked_mul(cols)? {
            return None;
        }
        if scale.len() != rows.div_ceil(bn).checked_mul(cols.div_ceil(bk))? {
            return None;
        }
        Some(Self {
            rows,
            cols,
            format: Format::Fp8Block { q, scale, block },
        })
    }

    /// NVFP4 (see [`super::quant`]): `packed` `[rows, cols/2]`, `scale` `[rows, cols/group]`
    /// E4M3 bytes, `scale_2` the global scale. `None` when a size does not match.
    pub fn nvfp4(
        packed: &'a [u8],
        rows: usize,
        cols: usize,
        scale: &'a [u8],
        scale_2: f32,
        group: usize,
    ) -> Option<Self> {
        if group == 0
            || !cols.is_multiple_of(2)
            || !cols.is_multiple_of(group)
            || packed.len() != rows.checked_mul(cols / 2)?
            || scale.len() != rows.checked_mul(cols / group)?
        {
            return None;
        }
        Some(Self {
            rows,
            cols,
            format: Format::Nvfp4 {
                packed,
                scale,
                scale_2,
                group,
            },
        })
    }

    /// Plain BF16, F16 or F32 little-endian values, or E4M3 bytes without a scale, `[rows,
    /// cols]` (as [`super::quant::floats`] reads them). `None` for another dtype or a byte
    /// length that does not match.
    pub fn float(dtype: Dtype, data: &'a [u8], rows: usize, cols: usize) -> Option<Self> {
        let width = match dtype {
            Dtype::F8_E4M3 => 1,
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            _ => return None,
        };
        if data.len() != rows.checked_mul(cols)?.checked_mul(width)? {
            return None;
        }
        Some(Self {
            rows,
            cols,
            format: Format::Float { dtype, data },
        })
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows, self.cols]
    }

    /// The whole matrix as row-major f32 (the plain path: [`super::quant::dequant_fp8_block`],
    /// [`super::quant::dequant_nvfp4`], [`super::quant::floats`]).
    pub fn dequantise(&self) -> Vec<f32> {
        let decoded = match &self.format {
            Format::Fp8Block { q, scale, block } => {
                quant::dequant_fp8_block(q, self.rows, self.cols, scale, *block)
            }
            Format::Nvfp4 {
                packed,
                scale,
                scale_2,
                group,
            } => quant::dequant_nvfp4(packed, self.rows, self.cols, scale, *scale_2, *group),
            Format::Float { dtype, data } => quant::floats(*dtype, data),
        };
        // The constructors checked every size the decoders check.
        decoded.unwrap_or_else(|| vec![0.0; self.rows * self.cols])
    }

    fn tables() -> Tables {
        Tables {
            e4m3: quant::e4m3_table(),
            e2m1: quant::e2m1_table(),
        }
    }

    /// Decodes row `i` into `out` (`cols` floats).
    fn decode_row(&self, t: &Tables, i: usize, out: &mut [f32]) {
        let k = self.cols;
        match &self.format {
            Format::Fp8Block { q, scale, block } => {
                let [bn, bk] = *block;
                let gc = k.div_ceil(bk);
                let srow = &scale[(i / bn) * gc..(i / bn + 1) * gc];
                quant::fp8_block_row(&t.e4m3, &q[i * k..(i + 1) * k], srow, bk, out);
            }
            Format::Nvfp4 {
                packed,
                scale,
                scale_2,
                group,
            } => {
                let gk = k / group;
                quant::nvfp4_row(
                    &t.e4m3,
                    &t.e2m1,
                    &packed[i * k / 2..(i + 1) * k / 2],
                    &scale[i * gk..(i + 1) * gk],
                    *scale_2,
                    *group,
                    out,
                );
            }
            Format::Float { dtype, data } => {
                let w = match dtype {
                    Dtype::F8_E4M3 => 1,
                    Dtype::F32 => 4,
                    _ => 2,
                };
                let row = &data[i * k * w..(i + 1) * k * w];
                match dtype {
                    Dtype::F8_E4M3 => {
                        for (o, &b) in out.iter_mut().zip(row) {
                            *o = t.e4m3[usize::from(b)];
                        }
                    }
                    Dtype::BF16 => {
                        for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                            *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                    Dtype::F16 => {
                        for (o, c) in out.iter_mut().zip(row.chunks_exact(2)) {
                            *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                    _ => {
                        for (o, c) in out.iter_mut().zip(row.chunks_exact(4)) {
                            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                }
            }
        }
    }

    /// `y = x · Wᵀ`: `x` `[n, cols]` row-major → `y` `[n, rows]` row-major, f32. `None` when
    /// `x.len() != n * cols`.
    ///
    /// Each weight row is decoded once and dotted against all `n` rows of `x`, so the cost is
    /// one decode of `W` plus `n · rows · cols` multiply-adds, and the only extra memory is one
    /// row of `cols` floats per task (and a `[rows, n]` staging copy of `y`).
    pub fn linear(&self, x: &[f32], n: usize) -> Option<Vec<f32>> {
        let (m, k) = (self.rows, self.cols);
        if x.len() != n.checked_mul(k)? {
            return None;
        }
        if n == 0 || m == 0 || k == 0 {
            return Some(vec![0.0; n * m]);
        }
        let t = Self::tables();
        // yt [m, n]: weight row i's n results are contiguous, so tasks own disjoint slices.
        let mut yt = vec![0f32; m * n];
        yt.par_chunks_mut(ROWS_PER_TASK * n)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut buf = vec![0f32; k];
                for (ii, yrow) in chunk.chunks_exact_mut(n).enumerate() {
                    self.decode_row(&t, c * ROWS_PER_TASK + ii, &mut buf);
                    for (y, xr) in yrow.iter_mut().zip(x.chunks_exact(k)) {
                        *y = dot(&buf, xr);
                    }
                }
            });
        let mut y = vec![0f32; n * m];
        for (i, col) in yt.chunks_exact(n).enumerate() {
            for (r, &v) in col.iter().enumerate() {
                y[r * m + i] = v;
            }
        }
        Some(y)
    }
}

/// `Σ a[j] · b[j]` in f32 with 16 interleaved partial sums (so the loop vectorises).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 16;
    let mut acc = [0f32; L];
    let (ac, at) = a.as_chunks::<L>();
    let (bc, bt) = b.as_chunks::<L>();
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in at.iter().zip(bt) {
        tail += x * y;
    }
    // Pairwise reduction of the lanes.
    let mut w = L;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor};
    use half::{bf16, f16};

    use super::*;

    use crate::rng::SplitMix64;

    /// Test inputs from the crate's SplitMix64 stream.
    trait Draw {
        fn byte(&mut self) -> u8;
        /// An E4M3 code that is not NaN.
        fn e4m3(&mut self) -> u8;
    }

    impl Draw for SplitMix64 {
        fn byte(&mut self) -> u8 {
            (self.next_u64() >> 56) as u8
        }
        fn e4m3(&mut self) -> u8 {
            loop {
                let b = self.byte();
                if b & 0x7f != 0x7f {
                    return b;
                }
            }
        }
    }

    /// The plain path: `W` dequantised in full, then candle's `x · Wᵀ`.
    fn plain(m: &QuantMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
        let [rows, cols] = m.shape();
        let w = Tensor::from_vec(m.dequantise(), (rows, cols), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(x.to_vec(), (n, cols), &Device::Cpu).unwrap();
        x.matmul(&w.t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    /// Checks the fused product against the plain one for each `n`: every output within f32
    /// summation noise of `Σ |x_j · w_j|` (a wrong tile, nibble or row moves it by O(that)).
    fn check(m: &QuantMatrix<'_>, rng: &mut SplitMix64, what: &str) {
        let [rows, cols] = m.shape();
        let w = m.dequantise();
        assert_eq!(w.len(), rows * cols);
        for n in [1usize, 3, 17] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.signed_unit()).collect();
            let got = m.linear(&x, n).unwrap();
            let want = plain(m, &x, n);
            assert_eq!(got.len(), n * rows, "{what} n={n}");
            for r in 0..n {
                for i in 0..rows {
                    let mag: f32 = (0..cols)
                        .map(|j| (x[r * cols + j] * w[i * cols + j]).abs())
                        .sum();
                    let (g, e) = (got[r * rows + i], want[r * rows + i]);
                    assert!(
                        (g - e).abs() <= 1e-5 * mag + 1e-30,
                        "{what} n={n} y[{r}, {i}]: fused {g}, plain {e} (Σ|xw| {mag})"
                    );
                }
            }
        }
        assert!(m.linear(&[0.0; 3], 2).is_none(), "{what}: a short x");
    }

    #[test]
    fn fused_fp8_matches_the_plain_path_on_partial_tiles() {
        let mut rng = SplitMix64::for_label(1, "qlinear");
        // 130 × 200 in 128×128 tiles: grid 2×2, the last tile row and column partial; 7 × 13 in
        // 3×5 tiles: partial in both directions at a small scale.
        for (rows, cols, block) in [(130usize, 200usize, [128, 128]), (7, 13, [3, 5])] {
            let q: Vec<u8> = (0..rows * cols).map(|_| rng.e4m3()).collect();
            let grid = rows.div_ceil(block[0]) * cols.div_ceil(block[1]);
            let scale: Vec<f32> = (0..grid).map(|_| 0.5 + rng.signed_unit().abs()).collect();
            let m = QuantMatrix::fp8_block(&q, rows, cols, scale, block).unwrap();
            check(&m, &mut rng, &format!("fp8 {rows}x{cols} tiles {block:?}"));
        }
        assert!(QuantMatrix::fp8_block(&[0; 6], 2, 3, vec![1.0; 2], [1, 3]).is_some());
        assert!(QuantMatrix::fp8_block(&[0; 6], 2, 3, vec![1.0; 1], [1, 3]).is_none());
    }

    #[test]
    fn fused_nvfp4_matches_the_plain_path() {
        let mut rng = SplitMix64::for_label(2, "qlinear");
        for (rows, cols) in [(5, 48), (1, 16)] {
            let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.byte()).collect();
            let scale: Vec<u8> = (0..rows * cols / 16)
                .map(|_| rng.e4m3() & 0x7f) // positive group scales
                .collect();
            let m = QuantMatrix::nvfp4(&packed, rows, cols, &scale, 0.03125, 16).unwrap();
            check(&m, &mut rng, &format!("nvfp4 {rows}x{cols}"));
        }
        assert!(QuantMatrix::nvfp4(&[0; 8], 1, 16, &[0; 2], 1.0, 16).is_none());
    }

    #[test]
    fn fused_float_weights_match_the_plain_path() {
        let mut rng = SplitMix64::for_label(3, "qlinear");
        let (rows, cols) = (9, 37);
        let vals: Vec<f32> = (0..rows * cols).map(|_| rng.signed_unit()).collect();
        let b16: Vec<u8> = vals
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        let h16: Vec<u8> = vals
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect();
        let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let e4m3: Vec<u8> = (0..rows * cols).map(|_| rng.e4m3()).collect();
        for (dtype, data) in [
            (Dtype::F8_E4M3, &e4m3),
            (Dtype::BF16, &b16),
            (Dtype::F16, &h16),
            (Dtype::F32, &f32s),
        ] {
            let m = QuantMatrix::float(dtype, data, rows, cols).unwrap();
            check(&m, &mut rng, &format!("{dtype:?}"));
        }
        assert!(QuantMatrix::float(Dtype::BF16, &b16[1..], rows, cols).is_none());
        assert!(QuantMatrix::float(Dtype::U8, &b16, rows, cols).is_none());
    }
}
