// The element-wise steps around the routed experts' grouped GEMMs (src/arch/experts.rs) in a
// bf16 recompute, one kernel each instead of a chain of candle operations, with the same
// rounding points (docs/AUDITOR.md "bf16 recompute"; the combine's sum in top-k order, where
// candle's GPU sum adds as a tree):
//   gather:  the rows of the experts' tokens, rounded to bf16 for the GEMM;
//   swiglu:  round(round(silu(gate)) * up), silu(x) = x / (1 + exp(-x)) in f32 as candle's;
//   combine: per token, Σ_j round(w_j · y[row_j]) in f32 in top-k order (the product rounded
//            only when the model rounds it), a missing choice adding nothing.
// Products and sums are kept apart (__fmul_rn, __fadd_rn, __fdiv_rn) so that nvcc does not
// contract them into fused multiply-adds, which round differently from candle's kernels.
#include <cuda_bf16.h>
#include <stdint.h>

// out [n, width] bf16 = x[idx[r]] (x [rows, width] f32). Grid-stride over n · width.
extern "C" __global__ void engy_gather_rows_bf16(
    const float* __restrict__ x, const uint32_t* __restrict__ idx,
    __nv_bfloat16* __restrict__ out, uint32_t n, uint32_t width) {
    const size_t total = (size_t)n * width;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / width, c = i % width;
        out[i] = __float2bfloat16_rn(x[(size_t)idx[r] * width + c]);
    }
}

// act [n] bf16 = round(round(silu(g)) * u), g and u [n] bf16.
extern "C" __global__ void engy_swiglu_bf16(
    const __nv_bfloat16* __restrict__ g, const __nv_bfloat16* __restrict__ u,
    __nv_bfloat16* __restrict__ act, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float x = __bfloat162float(g[i]);
        const float s = __fdiv_rn(x, __fadd_rn(1.0f, expf(-x)));
        const float sr = __bfloat162float(__float2bfloat16_rn(s));
        act[i] = __float2bfloat16_rn(__fmul_rn(sr, __bfloat162float(u[i])));
    }
}

// out [t, width] f32: out[tok] = Σ_{j < k} p(w[tok, j] · y[pick[tok, j]]), where p rounds to
// bf16 when `round_products` is set; pick[tok, j] == rows marks no choice (adds nothing).
// y [rows, width] bf16. Grid-stride over t · width.
extern "C" __global__ void engy_combine_experts(
    const __nv_bfloat16* __restrict__ y, const uint32_t* __restrict__ pick,
    const float* __restrict__ w, float* __restrict__ out, uint32_t t, uint32_t k,
    uint32_t width, uint32_t rows, int round_products) {
    const size_t total = (size_t)t * width;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t tok = i / width, c = i % width;
        float acc = 0.0f;
        for (uint32_t j = 0; j < k; ++j) {
            const uint32_t r = pick[tok * k + j];
            float p = 0.0f;
            if (r < rows) p = __fmul_rn(w[tok * k + j], __bfloat162float(y[(size_t)r * width + c]));
            if (round_products) p = __bfloat162float(__float2bfloat16_rn(p));
            acc = __fadd_rn(acc, p);
        }
        out[i] = acc;
    }
}
