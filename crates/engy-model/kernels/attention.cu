// The softmax step of engy's fused attention on a GPU (src/arch/fused_attention.rs), with the
// rounding points of `ops::attention_in` in a bf16 recompute (docs/AUDITOR.md "bf16
// recompute"): per score row, in f32, `x = (q·k) * scale + mask`, `m = max x`,
// `e = exp(x - m)`; the row sum of the f32 `e`, and `e` rounded to bf16 (round to nearest
// even) for the product with `v`. The products and sums are kept apart (`__fmul_rn`,
// `__fadd_rn`, `__fsub_rn`) so that nvcc does not contract them into fused multiply-adds,
// which round differently from candle's separate kernels.
#include <cuda_bf16.h>

// The largest (`MAX`) or summed value of `v` over the block; every thread gets it.
// `blockDim.x` is a multiple of 32, at most 1024.
template <bool MAX>
__device__ float block_reduce(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : __fadd_rn(v, w);
    }
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const unsigned warps = blockDim.x >> 5;
    v = lane < warps ? red[lane] : (MAX ? -INFINITY : 0.0f);
    for (int o = 16; o > 0; o >>= 1) {
        float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = MAX ? fmaxf(v, w) : __fadd_rn(v, w);
    }
    __syncthreads();  // `red` is reused by the next reduction
    return v;
}

// One block per score row. `scores` [rows, s] f32 holds q·kᵀ, rows head-major (row = head * t
// + i for query i of t); `mask` [t, s] f32 is additive, or unused when `has_mask` is 0.
// Writes `e` [rows, s] bf16 and `sums` [rows] f32.
extern "C" __global__ void engy_attention_softmax_bf16(
    const float* __restrict__ scores, const float* __restrict__ mask, int has_mask,
    __nv_bfloat16* __restrict__ e, float* __restrict__ sums, unsigned t, unsigned s,
    float scale) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const float* x = scores + row * s;
    const float* mrow = mask + (size_t)(row % t) * s;
    float m = -INFINITY;
    for (unsigned j = threadIdx.x; j < s; j += blockDim.x) {
        float v = __fmul_rn(x[j], scale);
        if (has_mask) v = __fadd_rn(v, mrow[j]);
        m = fmaxf(m, v);
    }
    m = block_reduce<true>(m, red);
    float sum = 0.0f;
    __nv_bfloat16* out = e + row * s;
    for (unsigned j = threadIdx.x; j < s; j += blockDim.x) {
        float v = __fmul_rn(x[j], scale);
        if (has_mask) v = __fadd_rn(v, mrow[j]);
        const float ex = expf(__fsub_rn(v, m));
        sum = __fadd_rn(sum, ex);
        out[j] = __float2bfloat16_rn(ex);
    }
    sum = block_reduce<false>(sum, red);
    if (threadIdx.x == 0) sums[row] = sum;
}

// The same softmax for a rule that keeps the probabilities f32 (MLA's, as SDPA computes it):
// `e` is not rounded but written as three bf16 planes of row `r`, `[e₁ | e₂ | e₃]` (`3·s`
// values), e₁ = bf16(e), e₂ = bf16(e − e₁), e₃ = bf16(e − e₁ − e₂), so that one bf16 GEMM over
// the planes and `v` stacked three times sums the exact products of the f32 `e`.
extern "C" __global__ void engy_attention_softmax_split3(
    const float* __restrict__ scores, const float* __restrict__ mask, int has_mask,
    __nv_bfloat16* __restrict__ e, float* __restrict__ sums, unsigned t, unsigned s,
    float scale) {
    __shared__ float red[32];
    const size_t row = blockIdx.x;
    const float* x = scores + row * s;
    const float* mrow = mask + (size_t)(row % t) * s;
    float m = -INFINITY;
    for (unsigned j = threadIdx.x; j < s; j += blockDim.x) {
        float v = __fmul_rn(x[j], scale);
        if (has_mask) v = __fadd_rn(v, mrow[j]);
        m = fmaxf(m, v);
    }
    m = block_reduce<true>(m, red);
    float sum = 0.0f;
    __nv_bfloat16* out = e + row * 3 * (size_t)s;
    for (unsigned j = threadIdx.x; j < s; j += blockDim.x) {
        float v = __fmul_rn(x[j], scale);
        if (has_mask) v = __fadd_rn(v, mrow[j]);
        const float ex = expf(__fsub_rn(v, m));
        sum = __fadd_rn(sum, ex);
        const __nv_bfloat16 e1 = __float2bfloat16_rn(ex);
        const float r1 = __fsub_rn(ex, __bfloat162float(e1));
        const __nv_bfloat16 e2 = __float2bfloat16_rn(r1);
        const float r2 = __fsub_rn(r1, __bfloat162float(e2));
        out[j] = e1;
        out[s + j] = e2;
        out[2 * s + j] = __float2bfloat16_rn(r2);
    }
    sum = block_reduce<false>(sum, red);
    if (threadIdx.x == 0) sums[row] = sum;
}
