//! The gated delta rule of Qwen3.5/3.6's Gated DeltaNet layers in its chunked form, as tensor
//! operations, so it runs on whatever device its inputs are on (a GPU: docs/AUDITOR.md "On a
//! GPU"). The host path of [`super::qwen3_5_moe`] runs the same rule token by token.
//!
//! The rule, per value head with state `S` `[dk, dv]` (transformers'
//! `torch_recurrent_gated_delta_rule`): `S ← S·exp(g_t)`, `S ← S + k_t ⊗ β_t(v_t − Sᵀk_t)`,
//! `o_t = Sᵀq_t`. The chunked form (transformers' `torch_chunk_gated_delta_rule`, after
//! Yang et al., "Gated Delta Networks", 2024) processes `C` = [`CHUNK`] tokens at once: within
//! a chunk the recurrence becomes a unit lower-triangular solve `(I − L)⁻¹` with
//! `L = −tril₋₁((β·K)Kᵀ ⊙ Γ)` and `Γ_ij = exp(G_i − G_j)` (`G` the running sum of `g`);
//! transformers solves it row by row, here it is the product `Π_m (I + L^(2^m))`, m < log₂ C,
//! equal because `L` is nilpotent (`L^C = 0`); on a GPU one kernel per layer solves it row by
//! row as transformers does and computes every operand of the loop ([`prepare_kernel`]). Only
//! the chunk-to-chunk state pass is a loop (on a GPU, one kernel too: [`chunk_loop`]).
//! Sums are taken in another order than the token loop's, so results agree with it to f32
//! rounding, not bit for bit (checked by this module's tests).
#[cfg(test)]
use candle_core::Device;
use candle_core::{DType, Tensor, D};

use crate::device::phase;
use crate::ModelError;

/// Tokens per chunk (transformers' `chunk_size` default).
pub const CHUNK: usize = 64;

/// Runs the rule over `t` tokens for `h` value heads.
///
/// * `q`, `k` `[h, t, dk]`: already l2-normalised, `q` already scaled by `dk^-1/2`;
/// * `v` `[h, t, dv]`; `beta`, `g` `[h, t]` (f32, `g` the log decay);
/// * `state` `[h, dk, dv]`: the state before the first token.
///
/// Returns the outputs `[h, t, dv]` and the state after the last token. With `ENGY_PROFILE`
/// set, the work before the chunk loop and the loop are the phases `gated deltanet: chunk
/// prep` and `gated deltanet: chunk loop` ([`crate::device::phase`]).
///
/// # Errors
/// Candle errors (shapes that do not fit the above), as [`ModelError::Candle`].
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor), ModelError> {
    let parts = phase(q.device(), "gated deltanet: chunk prep", || {
        Ok(prepare(q, k, v, beta, g)?)
    })?;
    let (h, t, _) = q.dims3()?;
    let dv = v.dim(2)?;
    phase(q.device(), "gated deltanet: chunk loop", || {
        Ok(run_chunks(&parts, state, (h, t, dv))?)
    })
}

/// Everything of [`chunked`] that does not depend on the state, for all chunks at once.
fn prepare(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: &Tensor,
) -> candle_core::Result<ChunkParts> {
    // On a GPU, all of it as one kernel ([`prepare_kernel`]).
    if let Some(parts) = prepare_kernel(q, k, v, beta, g)? {
        return Ok(parts);
    }
    let (h, t, dk) = q.dims3()?;
    let dv = v.dim(2)?;
    let dev = q.device();
    let c = CHUNK;
    let n = t.div_ceil(c);
    let pad = n * c - t;
    let padded = |x: &Tensor| -> candle_core::Result<Tensor> {
        if pad == 0 {
            x.contiguous()
        } else {
            x.pad_with_zeros(1, 0, pad)
        }
    };
    let q = padded(q)?.reshape((h, n, c, dk))?;
    let k = padded(k)?.reshape((h, n, c, dk))?;
    let v = padded(v)?.reshape((h, n, c, dv))?;
    let beta = padded(beta)?.reshape((h, n, c, 1))?;
    // Padded tokens have g = 0: no decay, so the state after them is the state after the last
    // real token.
    let gc = padded(g)?.reshape((h, n, c))?.cumsum(D::Minus1)?; // G [h, n, c]

    let lower_incl = Tensor::tril2(c, DType::F32, dev)?; // 1 on and below the diagonal
    let strict = (&lower_incl - Tensor::eye(c, DType::F32, dev)?)?;
    // Γ_ij = exp(G_i − G_j) below and on the diagonal, 0 above (masked before exp, as
    // transformers does, so the upper half never overflows).
    let diff = gc
        .unsqueeze(3)?
        .broadcast_sub(&gc.unsqueeze(2)?)?
        .broadcast_mul(&lower_incl)?;
    let decay = diff.exp()?.broadcast_mul(&lower_incl)?; // [h, n, c, c]

    let k_beta = k.broadcast_mul(&beta)?;
    let v_beta = v.broadcast_mul(&beta)?;
    let l = (k_beta.matmul(&k.transpose(2, 3)?.contiguous()?)? * &decay)?
        .broadcast_mul(&strict)?
        .neg()?;
    // (I − L)⁻¹ = Π (I + L^(2^m)).
    let eye = Tensor::eye(c, DType::F32, dev)?;
    let mut inv = l.broadcast_add(&eye)?;
    let mut p = l;
    let mut span = 2;
    while span < c {
        p = p.matmul(&p)?;
        inv = (&inv + inv.matmul(&p)?)?;
        span *= 2;
    }
    let value = inv.matmul(&v_beta)?; // [h, n, c, dv]
    let k_cumdecay = inv.matmul(&k_beta.broadcast_mul(&gc.exp()?.unsqueeze(3)?)?)?;

    // The loop then runs a handful of kernels per chunk (or one kernel in all on a GPU).
    // Chunk-major ([n, h, ..], contiguous) so that each chunk's slice is contiguous.
    let by_chunk = |x: Tensor| x.transpose(0, 1)?.contiguous();
    let gexp = gc.exp()?; // [h, n, c]
    let attn = by_chunk((q.matmul(&k.transpose(2, 3)?.contiguous()?)? * &decay)?)?; // [n, h, c, c]
    let q_dec = by_chunk(q.broadcast_mul(&gexp.unsqueeze(3)?)?)?; // [n, h, c, dk]
    let g_last = gc.narrow(2, c - 1, 1)?; // [h, n, 1]
    let k_dec_t = by_chunk(
        k.broadcast_mul(&g_last.broadcast_sub(&gc)?.exp()?.unsqueeze(3)?)?
            .transpose(2, 3)?,
    )?; // [n, h, dk, c]
    let last_decay = by_chunk(g_last.exp()?.unsqueeze(3)?)?; // [n, h, 1, 1]
    Ok(ChunkParts {
        value: by_chunk(value)?,           // [n, h, c, dv]
        k_cumdecay: by_chunk(k_cumdecay)?, // [n, h, c, dk]
        q_dec,
        attn,
        k_dec_t,
        last_decay,
    })
}

/// The chunk-to-chunk loop of [`chunked`] from `state` `[h, dk, dv]`: the outputs
/// `[h, t, dv]` and the state after the last chunk.
fn run_chunks(
    p: &ChunkParts,
    state: &Tensor,
    (h, t, dv): (usize, usize, usize),
) -> candle_core::Result<(Tensor, Tensor)> {
    // On a GPU, the loop as one kernel ([`chunk_loop`]).
    if let Some((out, s)) = chunk_loop(p, state)? {
        return Ok((out.narrow(1, 0, t)?, s));
    }
    let n = p.value.dim(0)?;
    let mut s = state.contiguous()?;
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let at = |x: &Tensor| x.narrow(0, i, 1)?.squeeze(0);
        let v_new = (at(&p.value)? - at(&p.k_cumdecay)?.matmul(&s)?)?;
        outs.push((at(&p.q_dec)?.matmul(&s)? + at(&p.attn)?.matmul(&v_new)?)?);
        s = (s.broadcast_mul(&at(&p.last_decay)?)? + at(&p.k_dec_t)?.matmul(&v_new)?)?;
    }
    let out = Tensor::cat(&outs, 1)?.narrow(1, 0, t)?;
    debug_assert_eq!(out.dims(), [h, t, dv]);
    Ok((out, s))
}

/// What the chunk-to-chunk loop of [`chunked`] reads, chunk-major and contiguous: `value`
/// `[n, h, c, dv]`, `k_cumdecay` and `q_dec` `[n, h, c, dk]`, `attn` `[n, h, c, c]`,
/// `k_dec_t` `[n, h, dk, c]`, `last_decay` `[n, h, 1, 1]`.
struct ChunkParts {
    value: Tensor,
    k_cumdecay: Tensor,
    q_dec: Tensor,
    attn: Tensor,
    k_dec_t: Tensor,
    last_decay: Tensor,
}

/// Whether [`chunk_loop`] may be used: not turned off by `ENGY_FUSED_DELTA_RULE=0`.
pub fn fused_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ENGY_FUSED_DELTA_RULE").map_or(true, |v| v != "0"))
}

/// The chunk-to-chunk loop of [`chunked`] as one kernel (`kernels/delta_rule.cu`) on a GPU:
/// from `state` `[h, dk, dv]`, the outputs `[h, n·c, dv]` (padding included) and the state
/// after the last chunk. The kernel keeps each head's state in shared memory, a block per
/// head and 16 columns of the state (columns never mix), and stages each chunk's operands
/// through shared memory one at a time, instead of a handful of kernels per chunk; sums run
/// in another order than the matmuls', products and updates are the same.
/// `None` on the CPU, in a build without the `cuda` feature, or with
/// `ENGY_FUSED_DELTA_RULE=0`.
fn chunk_loop(p: &ChunkParts, state: &Tensor) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    if !fused_enabled() || state.device().is_cpu() {
        return Ok(None);
    }
    cuda::chunk_loop(p, state)
}

/// [`prepare`] as one kernel (`kernels/delta_rule.cu`, `engy_delta_rule_prep`) on a GPU: a
/// block per value head and chunk computes the chunk's decays, `L`, the unit lower-triangular
/// inverse `(I − L)⁻¹` by forward substitution (transformers' row loop; equal to the product
/// form but for f32 rounding), and every operand of the chunk loop (its four products as
/// register tiles), instead of about forty candle operations over all chunks. `None` where [`chunk_loop`] is `None`, or for a shape
/// past the kernel's shared memory.
fn prepare_kernel(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: &Tensor,
) -> candle_core::Result<Option<ChunkParts>> {
    if !fused_enabled() || q.device().is_cpu() {
        return Ok(None);
    }
    cuda::prepare(q, k, v, beta, g)
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;

    pub(super) fn prepare(
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _beta: &Tensor,
        _g: &Tensor,
    ) -> candle_core::Result<Option<ChunkParts>> {
        Ok(None)
    }

    pub(super) fn chunk_loop(
        _p: &ChunkParts,
        _state: &Tensor,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        Ok(None)
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use crate::arch::kernels::{self, alloc, err, u32_arg, with_view, with_views, wrap};
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::Device;

    const OP: &str = "delta rule chunks";
    /// The most dynamic shared memory the preparation kernel and the chunk loop ask for
    /// (every GPU from Ampere on grants 99 KiB a block once asked).
    const PREP_SHARED_MAX: usize = 99 * 1024;

    #[allow(unsafe_code)]
    pub(super) fn prepare(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        beta: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<Option<ChunkParts>> {
        let Device::Cuda(cd) = q.device() else {
            return Ok(None);
        };
        let (h, t, dk) = q.dims3()?;
        let dv = v.dim(2)?;
        let c = CHUNK;
        if k.dims() != [h, t, dk] || v.dims() != [h, t, dv] || beta.dims() != [h, t] {
            candle_core::bail!(
                "{OP}: q {:?}, k {:?}, v {:?}, beta {:?}",
                q.dims(),
                k.dims(),
                v.dims(),
                beta.dims()
            );
        }
        if g.dims() != [h, t] {
            candle_core::bail!("{OP}: g {:?} for q {:?}", g.dims(), q.dims());
        }
        let n = t.div_ceil(c);
        let shared = (c * (dk + 1) + c * (c + 1) + 5 * c) * std::mem::size_of::<f32>();
        // The kernel's thread layout: 16 × 16 threads, four chunk rows of 16 each.
        if shared > PREP_SHARED_MAX || n == 0 || c != 64 || THREADS != 256 {
            return Ok(None);
        }
        let stream = cd.cuda_stream();
        // SAFETY: the kernel writes every element of each (all chunks of all heads; `attn`
        // above the diagonal as zeros).
        let mut value = unsafe { alloc::<f32>(&stream, n * h * c * dv)? };
        let mut kc = unsafe { alloc::<f32>(&stream, n * h * c * dk)? };
        let mut qd = unsafe { alloc::<f32>(&stream, n * h * c * dk)? };
        let mut attn = unsafe { alloc::<f32>(&stream, n * h * c * c)? };
        let mut kdt = unsafe { alloc::<f32>(&stream, n * h * dk * c)? };
        let mut lam = unsafe { alloc::<f32>(&stream, n * h)? };
        let func = cd.get_or_load_custom_func(
            "engy_delta_rule_prep",
            "engy_delta_rule",
            kernels::DELTA_RULE,
        )?;
        let shared32 = u32_arg(OP, "shared memory", shared)?;
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared32 as i32,
        )
        .map_err(|e| err(OP, "asking for the preparation's shared memory", e))?;
        let dims = [
            u32_arg(OP, "tokens", t)?,
            u32_arg(OP, "chunks", n)?,
            u32_arg(OP, "heads", h)?,
            u32_arg(OP, "chunk size", c)?,
            u32_arg(OP, "key width", dk)?,
            u32_arg(OP, "value width", dv)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (dims[2], dims[1], 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared32,
        };
        let f32v = DType::F32;
        with_views::<f32, _>(&[q, k, v, beta, g], f32v, |ins| {
            let mut b = func.builder();
            for x in ins {
                b.arg(x);
            }
            b.arg(&mut value).arg(&mut kc).arg(&mut qd);
            b.arg(&mut attn).arg(&mut kdt).arg(&mut lam);
            for d in &dims {
                b.arg(d);
            }
            // SAFETY: the kernel's signature is (5 × const float*, 6 × float*, 6 × unsigned),
            // as pushed; the inputs hold h · t · (dk, dk, dv, 1, 1) floats (checked above),
            // block (head, chunk) reads only its chunk's tokens below t and writes only its
            // own (chunk, head) entries of the outputs, allocated for n · h of them.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching the preparation", e))
        })?;
        Ok(Some(ChunkParts {
            value: wrap(value, cd, (n, h, c, dv))?,
            k_cumdecay: wrap(kc, cd, (n, h, c, dk))?,
            q_dec: wrap(qd, cd, (n, h, c, dk))?,
            attn: wrap(attn, cd, (n, h, c, c))?,
            k_dec_t: wrap(kdt, cd, (n, h, dk, c))?,
            last_decay: wrap(lam, cd, (n, h, 1, 1))?,
        }))
    }
    /// State columns per block (`COLS` in the kernel).
    const COLS: usize = 16;
    /// 16 × COLS: the kernel's thread layout.
    const THREADS: u32 = 256;

    #[allow(unsafe_code)]
    pub(super) fn chunk_loop(
        p: &ChunkParts,
        state: &Tensor,
    ) -> candle_core::Result<Option<(Tensor, Tensor)>> {
        let Device::Cuda(cd) = state.device() else {
            return Ok(None);
        };
        let (n, h, c, dv) = p.value.dims4()?;
        let (h2, dk, dv2) = state.dims3()?;
        let fits = h2 == h
            && dv2 == dv
            && p.k_cumdecay.dims() == [n, h, c, dk]
            && p.q_dec.dims() == [n, h, c, dk]
            && p.attn.dims() == [n, h, c, c]
            && p.k_dec_t.dims() == [n, h, dk, c]
            && p.last_decay.elem_count() == n * h;
        if !fits {
            candle_core::bail!(
                "{OP}: the chunk tensors do not fit the state {:?}",
                state.dims()
            );
        }
        // Two operand tiles (the next operand streams into one while a step reads the other),
        // then the block's columns of the state and of v_new.
        let tile = (c * (dk + 1)).max(dk * (c + 1)).max(c * (c + 1));
        let shared = (2 * tile + (dk + c) * COLS) * std::mem::size_of::<f32>();
        // The kernel's layout: 16 rows × COLS columns of threads, c / 16 ≤ 4 chunk rows and
        // dk / 16 ≤ 8 key rows each.
        let layout = c % 16 == 0 && dk % 16 == 0 && c <= 64 && dk <= 128;
        if shared > PREP_SHARED_MAX || !layout {
            // Past what the kernel asks for, or a shape the kernel's thread layout does not
            // cover: the unfused loop runs instead.
            return Ok(None);
        }
        let stream = cd.cuda_stream();
        // SAFETY: `st` is filled from `state` right here; the kernel writes every element of
        // `out` (every chunk's rows of every head, all `dv` columns across the blocks) before
        // it is read.
        let mut st = unsafe { alloc::<f32>(&stream, h * dk * dv)? };
        let mut out = unsafe { alloc::<f32>(&stream, h * n * c * dv)? };
        // The kernel updates the state in place: this call's own copy.
        with_view::<f32, _>(state, DType::F32, |s0| {
            stream
                .memcpy_dtod(&s0, &mut st)
                .map_err(|e| err(OP, "copying the state", e))
        })?;
        let func = cd.get_or_load_custom_func(
            "engy_delta_rule_chunks",
            "engy_delta_rule",
            kernels::DELTA_RULE,
        )?;
        let shared32 = u32_arg(OP, "shared memory", shared)?;
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared32 as i32,
        )
        .map_err(|e| err(OP, "asking for the chunk loop's shared memory", e))?;
        let dims = [
            u32_arg(OP, "chunks", n)?,
            u32_arg(OP, "heads", h)?,
            u32_arg(OP, "chunk size", c)?,
            u32_arg(OP, "key width", dk)?,
            u32_arg(OP, "value width", dv)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (dims[1], u32_arg(OP, "column blocks", dv.div_ceil(COLS))?, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: shared32,
        };
        let f32v = DType::F32;
        let parts = [
            &p.value,
            &p.k_cumdecay,
            &p.q_dec,
            &p.attn,
            &p.k_dec_t,
            &p.last_decay,
        ];
        with_views::<f32, _>(&parts, f32v, |ins| {
            let mut b = func.builder();
            for x in ins {
                b.arg(x);
            }
            b.arg(&mut st).arg(&mut out);
            for d in &dims {
                b.arg(d);
            }
            // SAFETY: the kernel's signature is (6 × const float*, float* state, float* out,
            // 5 × unsigned), as pushed; the shapes were checked above, so block (head, column
            // block) reads and writes only inside those buffers; `st` is this call's own copy
            // of the state, which the kernel updates in place.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(|e| err(OP, "launching", e))
        })?;
        Ok(Some((
            wrap(out, cd, (h, n * c, dv))?,
            wrap(st, cd, (h, dk, dv))?,
        )))
    }
}

/// The token-by-token rule on the host, the reference [`chunked`] is tested against (the
/// same arithmetic as the host path of [`super::qwen3_5_moe`]).
#[cfg(test)]
fn recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    beta: &Tensor,
    g: &Tensor,
    state: &Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let (h, t, dk) = q.dims3()?;
    let dv = v.dim(2)?;
    let (q, k, v) = (
        q.to_vec3::<f32>()?,
        k.to_vec3::<f32>()?,
        v.to_vec3::<f32>()?,
    );
    let (beta, g) = (beta.to_vec2::<f32>()?, g.to_vec2::<f32>()?);
    let mut s = state.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; h * t * dv];
    for hv in 0..h {
        let s = &mut s[hv * dk * dv..(hv + 1) * dk * dv];
        for ti in 0..t {
            let decay = g[hv][ti].exp();
            s.iter_mut().for_each(|x| *x *= decay);
            let mut mem = vec![0f32; dv];
            for i in 0..dk {
                for j in 0..dv {
                    mem[j] += s[i * dv + j] * k[hv][ti][i];
                }
            }
            for j in 0..dv {
                mem[j] = (v[hv][ti][j] - mem[j]) * beta[hv][ti];
            }
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += k[hv][ti][i] * mem[j];
                }
            }
            for i in 0..dk {
                for j in 0..dv {
                    out[(hv * t + ti) * dv + j] += s[i * dv + j] * q[hv][ti][i];
                }
            }
        }
    }
    Ok((
        Tensor::from_vec(out, (h, t, dv), &Device::Cpu)?,
        Tensor::from_vec(s, (h, dk, dv), &Device::Cpu)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn det(seed: u64, shape: &[usize], scale: f32) -> Tensor {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn l2(x: &Tensor) -> Tensor {
        x.broadcast_div(
            &(x.sqr().unwrap().sum_keepdim(2).unwrap() + 1e-6)
                .unwrap()
                .sqrt()
                .unwrap(),
        )
        .unwrap()
    }

    fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Lengths below, at and across chunk boundaries, a non-zero starting state (a cache), and
    /// strong decays: the chunked form gives the token loop's outputs and final state.
    #[test]
    fn the_chunked_form_is_the_token_loop() {
        let (h, dk, dv) = (3, 8, 5);
        for (i, &t) in [1usize, 7, 64, 65, 150].iter().enumerate() {
            let s = i as u64 * 10;
            let q = (l2(&det(s + 1, &[h, t, dk], 1.0)) * (dk as f64).powf(-0.5)).unwrap();
            let k = l2(&det(s + 2, &[h, t, dk], 1.0));
            let v = det(s + 3, &[h, t, dv], 2.0);
            let beta = det(s + 4, &[h, t], 1.0).affine(0.5, 0.5).unwrap();
            let g = (det(s + 5, &[h, t], 1.0).abs().unwrap() * -1.5).unwrap();
            let s0 = det(s + 6, &[h, dk, dv], 0.5);
            let (want, want_s) = recurrent(&q, &k, &v, &beta, &g, &s0).unwrap();
            let (got, got_s) = chunked(&q, &k, &v, &beta, &g, &s0).unwrap();
            assert_eq!(got.dims(), want.dims());
            let (e, es) = (max_abs(&got, &want), max_abs(&got_s, &want_s));
            assert!(
                e < 1e-4 && es < 1e-4,
                "t={t}: outputs off by {e}, state by {es}"
            );
        }
    }

    /// The check can fail: a rule that forgets the decay inside a chunk is far off.
    #[test]
    fn a_wrong_decay_is_seen() {
        let (h, t, dk, dv) = (2, 40, 8, 4);
        let q = (l2(&det(1, &[h, t, dk], 1.0)) * (dk as f64).powf(-0.5)).unwrap();
        let k = l2(&det(2, &[h, t, dk], 1.0));
        let v = det(3, &[h, t, dv], 2.0);
        let beta = det(4, &[h, t], 1.0).affine(0.5, 0.5).unwrap();
        let g = (det(5, &[h, t], 1.0).abs().unwrap() * -1.5).unwrap();
        let s0 = Tensor::zeros((h, dk, dv), DType::F32, &Device::Cpu).unwrap();
        let (want, _) = recurrent(&q, &k, &v, &beta, &g, &s0).unwrap();
        let (got, _) = chunked(&q, &k, &v, &beta, &g.zeros_like().unwrap(), &s0).unwrap();
        assert!(max_abs(&got, &want) > 1e-2);
    }
}
