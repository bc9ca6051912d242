// The causal depthwise convolution of a Gated DeltaNet layer and its SiLU
// (src/arch/qwen3_5_moe.rs, `delta_net_tensors`) as one kernel, with the unfused candle
// operations' arithmetic: per output row r and channel ch, s = Σ_j input[r + j, ch] · w[j, ch]
// summed in tap order from 0 (each product rounded, then added), s rounded to the activation
// dtype, then silu(s) = s / (1 + exp(-s)) in f32, rounded again. `round` selects bf16
// rounding (a bf16 recompute) or none (f32). Products and sums are kept apart (__fmul_rn,
// __fadd_rn, __fdiv_rn) so that nvcc does not contract them into fused multiply-adds.
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float rnd(float x, int round) {
    return round ? __bfloat162float(__float2bfloat16_rn(x)) : x;
}

// input [t + taps - 1, ch] f32 (the cached history, then the new rows), w [taps, ch] f32,
// out [t, ch] f32. Grid-stride over t · ch.
extern "C" __global__ void engy_causal_conv_silu(
    const float* __restrict__ input, const float* __restrict__ w, float* __restrict__ out,
    uint32_t t, uint32_t ch, uint32_t taps, int round) {
    const size_t total = (size_t)t * ch;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / ch, c = i % ch;
        float s = 0.0f;
        for (uint32_t j = 0; j < taps; ++j)
            s = __fadd_rn(s, __fmul_rn(input[(r + j) * ch + c], w[(size_t)j * ch + c]));
        s = rnd(s, round);
        out[i] = rnd(__fdiv_rn(s, __fadd_rn(1.0f, expf(-s))), round);
    }
}

// The gated RMSNorm after the delta rule, per (row, value head) with the unfused candle
// operations' rounding points: o = round(rule output), r = 1 / sqrt(Σ o² · (1/dv) + eps),
// core = round(round(round(o · r) · w) · silu(z)). One warp per (row, head); the sum of squares
// runs in another order than candle's reduction (as between any two reduction kernels).
// o [heads, o_rows, dv] f32 (rows past t unused), z and out [t, heads · dv] f32, w [dv] f32.
extern "C" __global__ void engy_gated_rms_norm(
    const float* __restrict__ o, const float* __restrict__ z, const float* __restrict__ w,
    float* __restrict__ out, uint32_t t, uint32_t o_rows, uint32_t heads, uint32_t dv,
    float inv_dv, float eps, int round) {
    const unsigned lane = threadIdx.x & 31u;
    const size_t warp = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (warp >= (size_t)t * heads) return;
    const size_t r = warp / heads, h = warp % heads;
    const float* orow = o + (h * o_rows + r) * dv;
    float ss = 0.0f;
    for (uint32_t j = lane; j < dv; j += 32) {
        const float x = rnd(orow[j], round);
        ss = __fadd_rn(ss, __fmul_rn(x, x));
    }
    for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
    const float inv = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fmul_rn(ss, inv_dv), eps)));
    const size_t base = (r * heads + h) * dv;
    for (uint32_t j = lane; j < dv; j += 32) {
        const float x = rnd(orow[j], round);
        const float normed = rnd(__fmul_rn(x, inv), round);
        const float weighted = rnd(__fmul_rn(normed, w[j]), round);
        const float zz = z[base + j];
        const float gate = __fdiv_rn(zz, __fadd_rn(1.0f, expf(-zz)));
        out[base + j] = rnd(__fmul_rn(weighted, gate), round);
    }
}

// The delta rule's inputs from the conv's output (src/arch/qwen3_5_moe.rs,
// `delta_net_tensors`), head-major as the rule takes them, instead of a dozen candle
// operations and the copies that expand and transpose them:
//   q[hv, r] = l2(conv[r, q part, key head kh]) · scale,  k[hv, r] = l2(conv[r, k part, kh])
// for each of the `group` value heads hv = kh · group + i of key head kh, where
// l2(x) = x / sqrt(Σ x² + 1e-6) (the sum over the head, in another order than candle's
// reduction), and scale · x one product (candle's affine);
//   v[hv, r] = conv[r, v part, hv]  (a copy).
// conv [t, 2 · nk · dk + nv · dv] f32; q, k [nv, t, dk], v [nv, t, dv] f32. One warp per
// (row, key head) for q and k, then grid-stride over the copy of v.
extern "C" __global__ void engy_deltanet_qkv(
    const float* __restrict__ conv, float* __restrict__ q, float* __restrict__ k,
    float* __restrict__ v, uint32_t t, uint32_t nk, uint32_t nv, uint32_t dk, uint32_t dv,
    float scale) {
    const unsigned lane = threadIdx.x & 31u;
    const size_t gtid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t warps = (size_t)gridDim.x * blockDim.x >> 5;
    const size_t width = 2 * (size_t)nk * dk + (size_t)nv * dv;
    const uint32_t group = nv / nk;
    // q and k: warp w takes (part, row, key head) = w over 2 · t · nk.
    for (size_t w = gtid >> 5; w < 2 * (size_t)t * nk; w += warps) {
        const size_t part = w / ((size_t)t * nk), rem = w % ((size_t)t * nk);
        const size_t r = rem / nk, kh = rem % nk;
        const float* x = conv + r * width + part * nk * dk + kh * dk;
        float ss = 0.0f;
        for (uint32_t d = lane; d < dk; d += 32) ss = __fadd_rn(ss, __fmul_rn(x[d], x[d]));
        for (int off = 16; off > 0; off >>= 1)
            ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
        const float norm = sqrtf(__fadd_rn(ss, 1e-6f));
        float* out = part == 0 ? q : k;
        for (uint32_t d = lane; d < dk; d += 32) {
            float y = __fdiv_rn(x[d], norm);
            if (part == 0) y = __fmul_rn(y, scale);
            for (uint32_t i = 0; i < group; ++i)
                out[(((size_t)kh * group + i) * t + r) * dk + d] = y;
        }
    }
    const size_t nvals = (size_t)nv * t * dv;
    for (size_t i = gtid; i < nvals; i += (size_t)gridDim.x * blockDim.x) {
        const size_t hv = i / ((size_t)t * dv), rem = i % ((size_t)t * dv);
        const size_t r = rem / dv, e = rem % dv;
        v[i] = conv[r * width + 2 * (size_t)nk * dk + hv * dv + e];
    }
}

// The rule's gates per row r and value head h, head-major ([nv, t]), with the candle
// operations' arithmetic:
//   beta = round(1 / (1 + exp(−b)))  (candle's sigmoid: the reciprocal taken in double)
//   g    = softplus(a + dt_bias[h]) · −exp(a_log[h]),
//          softplus(x) = x above 20, else log(exp(x) + 1)
// b, a [t, nv] f32; dt_bias, a_log [nv] f32; beta, g [nv, t] f32.
extern "C" __global__ void engy_deltanet_gates(
    const float* __restrict__ b, const float* __restrict__ a,
    const float* __restrict__ dt_bias, const float* __restrict__ a_log,
    float* __restrict__ beta, float* __restrict__ g, uint32_t t, uint32_t nv, int round) {
    const size_t total = (size_t)t * nv;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t h = i / t, r = i % t;
        const float bx = b[r * nv + h];
        const float sig = (float)(1.0 / (double)__fadd_rn(1.0f, expf(-bx)));
        beta[i] = rnd(sig, round);
        const float sp = __fadd_rn(a[r * nv + h], dt_bias[h]);
        const float soft = sp > 20.0f ? sp : logf(__fadd_rn(expf(sp), 1.0f));
        g[i] = __fmul_rn(soft, -expf(a_log[h]));
    }
}
