// RMSNorm rows and bf16 roundings (src/arch/norm_kernels.rs), one kernel each instead of a
// chain of candle operations, bit for bit candle's chain:
//   round:    f32 -> bf16 (nearest even) -> f32, what `Compute::round` does with two casts;
//   rms_norm: per row of n, optionally after a residual add (sum = p(x + y), written out):
//             v = Σ x² as candle's `fast_sum` adds it (blockDim.x threads, thread t summing
//             elements t, t + blockDim.x, … in order, then a tree over the threads), the mean
//             as `sum * (1/n)`, `+ eps`, `sqrtf`, the reciprocal in double as candle's
//             `recipg`, then x · r and · w (or · (1 + w)), with the bf16 roundings the model
//             makes (flags below).
// Products and sums are kept apart (__fmul_rn, __fadd_rn) so that nvcc does not contract them
// into fused multiply-adds, which round differently from candle's kernels. The launch must
// use candle's block size for the sum: the next power of two of min(1024, n).
#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ float round_bf16(float x) {
    return __bfloat162float(__float2bfloat16(x));
}

// out [n] = round_bf16(x [n]). Grid-stride.
extern "C" __global__ void engy_round_bf16(const float* __restrict__ x, float* __restrict__ out,
                                           size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = round_bf16(x[i]);
    }
}

// Flags of engy_rms_norm.
#define NORM_ONE_PLUS 1u      // multiply by (1 + w) (Qwen3.5's zero-centred norm), not w
#define NORM_ROUND_NORMED 2u  // round x · r to bf16 before the weight (Llama-style bf16)
#define NORM_ROUND_OUT 4u     // round the output to bf16
#define NORM_ADD 8u           // normalise x + y, and write that sum to `sum`
#define NORM_ROUND_SUM 16u    // round the sum x + y to bf16 (a bf16 residual stream)

// One block per row of n: out[row] = norm(x[row] (+ y[row])) · w (flags above). `y` and `sum`
// are read and written only with NORM_ADD. blockDim.x: a power of two, at most 1024.
extern "C" __global__ void engy_rms_norm(const float* __restrict__ x, const float* __restrict__ y,
                                         const float* __restrict__ w, float* __restrict__ sum,
                                         float* __restrict__ out, uint32_t n, float inv_n,
                                         float eps, uint32_t flags) {
    __shared__ float shr[1024];
    const size_t row = blockIdx.x;
    const uint32_t tid = threadIdx.x;
    const float* xr = x + row * n;
    float* outr = out + row * n;
    const bool add = flags & NORM_ADD;
    float acc = 0.0f;
    for (uint32_t c = tid; c < n; c += blockDim.x) {
        float v = xr[c];
        if (add) {
            v = __fadd_rn(v, y[row * n + c]);
            if (flags & NORM_ROUND_SUM) v = round_bf16(v);
            sum[row * n + c] = v;
        }
        acc = __fadd_rn(acc, __fmul_rn(v, v));
    }
    shr[tid] = acc;
    for (uint32_t s = blockDim.x / 2; s > 0; s >>= 1) {
        __syncthreads();
        if (tid < s) shr[tid] = __fadd_rn(shr[tid], shr[tid + s]);
    }
    __syncthreads();
    const float mean = __fmul_rn(shr[0], inv_n);
    const float sd = __fsqrt_rn(__fadd_rn(mean, eps));
    const float r = (float)(1.0 / (double)sd);
    const float* src = add ? sum + row * n : xr;
    for (uint32_t c = tid; c < n; c += blockDim.x) {
        float v = __fmul_rn(src[c], r);
        if (flags & NORM_ROUND_NORMED) v = round_bf16(v);
        const float wc = (flags & NORM_ONE_PLUS) ? __fadd_rn(w[c], 1.0f) : w[c];
        v = __fmul_rn(v, wc);
        if (flags & NORM_ROUND_OUT) v = round_bf16(v);
        outr[c] = v;
    }
}
