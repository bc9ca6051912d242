// Block-FP8 weights decoded on the device (src/arch/fp8_kernels.rs): each E4M3 code through
// the host decoder's 256-entry table (src/arch/quant.rs `e4m3_table`), times its tile's scale,
// one f32 product (__fmul_rn: never contracted), stored as f32 or rounded to bf16 nearest
// even (the value a bf16 model holds). The values are the host decode's bit for bit, but for
// E4M3's two NaN codes (0x7f, 0xff), a NaN either way, its sign and payload not kept.
#include <cuda_bf16.h>
#include <stdint.h>

// One block a row of one output matrix: output matrix i is stored matrix members[i] of
// `codes` [n, rows, cols] u8 with `scale` [n, tn, tk] f32, tn = ceil(rows / bn),
// tk = ceil(cols / bk) (a last partial tile reads its own scale). blockIdx.x = i · rows + r;
// the block's threads stride over the row's columns.
template <typename T> __device__ T store(float v);
template <> __device__ float store<float>(float v) { return v; }
template <> __device__ __nv_bfloat16 store<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

template <typename T>
__device__ void fp8_block_decode(const uint8_t* __restrict__ codes,
                                 const float* __restrict__ scale,
                                 const float* __restrict__ table,
                                 const uint32_t* __restrict__ members, T* __restrict__ out,
                                 uint32_t rows, uint32_t cols, uint32_t bn, uint32_t bk,
                                 uint32_t tn, uint32_t tk) {
    __shared__ float lut[256];
    for (uint32_t i = threadIdx.x; i < 256; i += blockDim.x) lut[i] = table[i];
    __syncthreads();
    const size_t row = blockIdx.x;
    const size_t e = members[row / rows];
    const uint32_t r = (uint32_t)(row % rows);
    const float* s = scale + (e * tn + r / bn) * tk;
    const uint8_t* in = codes + (e * rows + r) * cols;
    T* o = out + row * cols;
    for (uint32_t c = threadIdx.x; c < cols; c += blockDim.x) {
        o[c] = store<T>(__fmul_rn(lut[in[c]], s[c / bk]));
    }
}

extern "C" __global__ void engy_fp8_block_decode_f32(
    const uint8_t* __restrict__ codes, const float* __restrict__ scale,
    const float* __restrict__ table, const uint32_t* __restrict__ members,
    float* __restrict__ out, uint32_t rows, uint32_t cols, uint32_t bn, uint32_t bk,
    uint32_t tn, uint32_t tk) {
    fp8_block_decode<float>(codes, scale, table, members, out, rows, cols, bn, bk, tn, tk);
}

extern "C" __global__ void engy_fp8_block_decode_bf16(
    const uint8_t* __restrict__ codes, const float* __restrict__ scale,
    const float* __restrict__ table, const uint32_t* __restrict__ members,
    __nv_bfloat16* __restrict__ out, uint32_t rows, uint32_t cols, uint32_t bn, uint32_t bk,
    uint32_t tn, uint32_t tk) {
    fp8_block_decode<__nv_bfloat16>(codes, scale, table, members, out, rows, cols, bn, bk, tn,
                                    tk);
}
