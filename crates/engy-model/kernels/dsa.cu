// The DSA indexer's top-k of key positions and the attention mask built from it, on the device
// (src/arch/dsa_kernels.rs). The host's rule (src/arch/glm_moe_dsa.rs, `indexer`): query row r
// at position off + r reads the first causal = off + r + 1 index scores; when causal <= k it
// keeps them all (0 .. causal, ascending), else the k largest by f32 `total_cmp` with ties
// broken by index (lower first, or higher first for the other DSA tie order), largest first
// (`ops::topk_indices_ordered`). That is a strict total order on (value, index), so any correct
// sort gives the host's list exactly: here one block per row sorts its (value, index) pairs as
// 64-bit keys in shared memory (bitonic, descending) and keeps the first k.
#include <stdint.h>

// f32 `total_cmp` as an unsigned order: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN.
__device__ __forceinline__ uint32_t total_order(float v) {
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// index [rows, total] f32; sel [rows, k] u32 (row r's first min(causal, k) entries are its keys
// in order, the rest 0xFFFFFFFF). Dynamic shared memory: `pow2` u64 keys, pow2 a power of two
// >= total. higher_first != 0: equal values keep the higher index first.
extern "C" __global__ void engy_dsa_topk(const float* __restrict__ index, uint32_t rows,
                                         uint32_t total, uint32_t off, uint32_t k,
                                         uint32_t higher_first, uint32_t* __restrict__ sel) {
    extern __shared__ unsigned long long keys[];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const uint32_t causal = off + r + 1;
    uint32_t* out = sel + (size_t)r * k;
    if (causal <= k || causal > total) {
        // All causal keys, in position order (causal > total cannot happen for total = off +
        // rows; written the same way so that every entry is defined).
        for (uint32_t j = threadIdx.x; j < k; j += blockDim.x) out[j] = j < causal ? j : 0xFFFFFFFFu;
        return;
    }
    uint32_t n = 1;
    while (n < causal) n <<= 1;
    const float* row = index + (size_t)r * total;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        unsigned long long key = 0ull;  // padding: below every real key that can be kept
        if (i < causal) {
            const uint32_t tie = higher_first ? i : ~i;
            key = ((unsigned long long)total_order(row[i]) << 32) | tie;
        }
        keys[i] = key;
    }
    __syncthreads();
    for (uint32_t size = 2; size <= n; size <<= 1) {
        for (uint32_t stride = size >> 1; stride > 0; stride >>= 1) {
            for (uint32_t p = threadIdx.x; p < n / 2; p += blockDim.x) {
                const uint32_t a = 2 * p - (p & (stride - 1));
                const uint32_t b = a + stride;
                const unsigned long long x = keys[a], y = keys[b];
                const bool down = (a & size) == 0;  // this run sorts descending
                if (down ? x < y : x > y) {
                    keys[a] = y;
                    keys[b] = x;
                }
            }
            __syncthreads();
        }
    }
    for (uint32_t j = threadIdx.x; j < k; j += blockDim.x) {
        const uint32_t tie = (uint32_t)keys[j];
        out[j] = higher_first ? tie : ~tie;
    }
}

// mask [rows, total] f32: 0 at each kept key s of row r with s <= off + r (sel [rows, k], entries
// >= total ignored), -inf elsewhere: the host's mask, value for value.
extern "C" __global__ void engy_dsa_mask(const uint32_t* __restrict__ sel, uint32_t rows,
                                         uint32_t total, uint32_t off, uint32_t k,
                                         float* __restrict__ mask) {
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    float* m = mask + (size_t)r * total;
    for (uint32_t s = threadIdx.x; s < total; s += blockDim.x) m[s] = __int_as_float(0xff800000);  // -inf
    __syncthreads();
    const uint32_t* row = sel + (size_t)r * k;
    for (uint32_t j = threadIdx.x; j < k; j += blockDim.x) {
        const uint32_t s = row[j];
        if (s < total && s <= off + r) m[s] = 0.0f;
    }
}
