// The chunk-to-chunk loop of the chunked gated delta rule (src/arch/delta_rule.rs) as one
// kernel: per value head and chunk i, with the state S [dk, dv] carried from chunk to chunk,
//   v_new = value_i − Kc_i · S          [c, dv]
//   out_i = Qd_i · S + A_i · v_new      [c, dv]
//   S     = S · λ_i + Kdᵀ_i · v_new     [dk, dv]
// Columns of S are independent (each column of v_new, out and S reads only its own column of
// S), so each block takes one head and COLS columns, and keeps its slice of S in shared memory
// for the whole sequence. f32 throughout; the sums run in another order than the unfused
// matmuls' (as between any two GEMM kernels), the products and the decay's multiply-add are
// the same operations.
#define COLS 16

// Inputs chunk-major and contiguous: value [n, h, c, dv], kc (k_cumdecay) and qd (q_dec)
// [n, h, c, dk], attn [n, h, c, c], kdt (decayed kᵀ) [n, h, dk, c], lambda (last decay)
// [n, h]. `state` [h, dk, dv] is read as the state before chunk 0 and overwritten with the
// state after the last chunk; `out` [h, n·c, dv]. Launch: grid (h, ceil(dv / COLS)), any
// block size of at least c · COLS / 8 threads; dynamic shared memory (tile + (dk + c) · COLS)
// floats, tile = max(c·(dk + 1), dk·(c + 1), c·(c + 1)): one of the chunk's operands at a
// time (rows padded by one float against bank conflicts), the block's columns of S, and of
// v_new.
extern "C" __global__ void engy_delta_rule_chunks(
    const float* __restrict__ value, const float* __restrict__ kc, const float* __restrict__ qd,
    const float* __restrict__ attn, const float* __restrict__ kdt,
    const float* __restrict__ lambda, float* __restrict__ state, float* __restrict__ out,
    unsigned n, unsigned h, unsigned c, unsigned dk, unsigned dv) {
    extern __shared__ float sh[];
    // The tile holds the largest of c × (dk + 1), dk × (c + 1) and c × (c + 1) floats.
    const unsigned tile_len = max(max(c * (dk + 1), dk * (c + 1)), c * (c + 1));
    float* tile = sh;
    float* S = sh + tile_len;            // [dk][COLS]
    float* vn = S + dk * COLS;           // [c][COLS]
    const unsigned head = blockIdx.x;
    const unsigned j0 = blockIdx.y * COLS;
    const unsigned cols = min((unsigned)COLS, dv - j0);
    float* st = state + (size_t)head * dk * dv;
    for (unsigned x = threadIdx.x; x < dk * COLS; x += blockDim.x) {
        const unsigned p = x / COLS, j = x % COLS;
        S[x] = j < cols ? st[(size_t)p * dv + j0 + j] : 0.0f;
    }
    // Copies a rows × width block of `src` (contiguous) into `tile` with row stride width + 1.
    auto load = [&](const float* src, unsigned rows, unsigned width) {
        for (unsigned x = threadIdx.x; x < rows * width; x += blockDim.x)
            tile[(x / width) * (width + 1) + x % width] = src[x];
    };
    __syncthreads();
    for (unsigned i = 0; i < n; ++i) {
        const size_t hc = (size_t)i * h + head;  // (chunk, head) entry
        const float* val = value + hc * c * dv;
        const float lam = lambda[hc];
        // v_new = value − Kc · S
        load(kc + hc * c * dk, c, dk);
        __syncthreads();
        for (unsigned x = threadIdx.x; x < c * COLS; x += blockDim.x) {
            const unsigned r = x / COLS, j = x % COLS;
            const float* row = tile + r * (dk + 1);
            float acc = 0.0f;
            for (unsigned p = 0; p < dk; ++p) acc = fmaf(row[p], S[p * COLS + j], acc);
            vn[x] = j < cols ? __fsub_rn(val[(size_t)r * dv + j0 + j], acc) : 0.0f;
        }
        __syncthreads();
        // out = Qd · S + A · v_new, the two products in turn through the tile.
        load(qd + hc * c * dk, c, dk);
        __syncthreads();
        float part[8];  // this thread's Qd · S terms (c · COLS / blockDim.x ≤ 8 of them)
        {
            unsigned m = 0;
            for (unsigned x = threadIdx.x; x < c * COLS && m < 8; x += blockDim.x, ++m) {
                const unsigned r = x / COLS, j = x % COLS;
                const float* row = tile + r * (dk + 1);
                float a = 0.0f;
                for (unsigned p = 0; p < dk; ++p) a = fmaf(row[p], S[p * COLS + j], a);
                part[m] = a;
            }
        }
        __syncthreads();
        load(attn + hc * c * c, c, c);
        __syncthreads();
        {
            unsigned m = 0;
            for (unsigned x = threadIdx.x; x < c * COLS && m < 8; x += blockDim.x, ++m) {
                const unsigned r = x / COLS, j = x % COLS;
                const float* row = tile + r * (c + 1);
                float b = 0.0f;
                for (unsigned q = 0; q < c; ++q) b = fmaf(row[q], vn[q * COLS + j], b);
                if (j < cols)
                    out[((size_t)head * n * c + (size_t)i * c + r) * dv + j0 + j] = __fadd_rn(part[m], b);
            }
        }
        __syncthreads();
        // S = S · λ + Kdᵀ · v_new
        load(kdt + hc * dk * c, dk, c);
        __syncthreads();
        for (unsigned x = threadIdx.x; x < dk * COLS; x += blockDim.x) {
            const unsigned p = x / COLS, j = x % COLS;
            const float* row = tile + p * (c + 1);
            float acc = 0.0f;
            for (unsigned q = 0; q < c; ++q) acc = fmaf(row[q], vn[q * COLS + j], acc);
            S[x] = __fadd_rn(__fmul_rn(S[x], lam), acc);
        }
        __syncthreads();
    }
    for (unsigned x = threadIdx.x; x < dk * COLS; x += blockDim.x) {
        const unsigned p = x / COLS, j = x % COLS;
        if (j < cols) st[(size_t)p * dv + j0 + j] = S[x];
    }
}
