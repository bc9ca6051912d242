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
// The most chunk rows (c / 16) and key rows (dk / 16) one thread accumulates: c ≤ 64, dk ≤ 128.
#define MAX_C 4
#define MAX_K 8

// Inputs chunk-major and contiguous: value [n, h, c, dv], kc (k_cumdecay) and qd (q_dec)
// [n, h, c, dk], attn [n, h, c, c], kdt (decayed kᵀ) [n, h, dk, c], lambda (last decay)
// [n, h]. `state` [h, dk, dv] is read as the state before chunk 0 and overwritten with the
// state after the last chunk; `out` [h, n·c, dv]. c and dk multiples of 16, c ≤ 16·MAX_C,
// dk ≤ 16·MAX_K. Launch: grid (h, ceil(dv / COLS)), 256 threads (16 × COLS); dynamic shared
// memory (2 · tile + (dk + c) · COLS) floats, tile = max(c·(dk + 1), dk·(c + 1), c·(c + 1)):
// two operand tiles (rows padded by one float against bank conflicts), the block's columns of
// S, and of v_new.
//
// The chunk's four operands (Kc, Qd, A, Kdᵀ) do not depend on the state, so they stream
// through the two tiles one step ahead: while a step computes with one operand, the next
// operand (the next chunk's Kc after this chunk's Kdᵀ) is on its way into the other tile by
// `cp.async`, and the step only waits for its own. The arithmetic is the one-tile kernel's,
// operation for operation.

// Starts copying `rows × width` floats of `src` (contiguous) into `dst` (row stride
// width + 1), four bytes an instruction, as one `cp.async` group of this thread's copies.
__device__ __forceinline__ void start_tile(float* dst, const float* src, unsigned rows,
                                           unsigned width) {
    const unsigned total = rows * width;
    for (unsigned x = threadIdx.x; x < total; x += blockDim.x) {
        const unsigned sa = (unsigned)__cvta_generic_to_shared(dst + (x / width) * (width + 1) + x % width);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sa), "l"(src + x));
    }
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits for all but the most recent `cp.async` group of this thread, then for the block.
__device__ __forceinline__ void wait_previous() {
    asm volatile("cp.async.wait_group 1;\n" ::);
    __syncthreads();
}

extern "C" __global__ void engy_delta_rule_chunks(
    const float* __restrict__ value, const float* __restrict__ kc, const float* __restrict__ qd,
    const float* __restrict__ attn, const float* __restrict__ kdt,
    const float* __restrict__ lambda, float* __restrict__ state, float* __restrict__ out,
    unsigned n, unsigned h, unsigned c, unsigned dk, unsigned dv) {
    extern __shared__ float sh[];
    // Each tile holds the largest of c × (dk + 1), dk × (c + 1) and c × (c + 1) floats.
    const unsigned tile_len = max(max(c * (dk + 1), dk * (c + 1)), c * (c + 1));
    float* tiles[2] = {sh, sh + tile_len};
    float* S = sh + 2 * tile_len;        // [dk][COLS]
    float* vn = S + dk * COLS;           // [c][COLS]
    const unsigned head = blockIdx.x;
    const unsigned j0 = blockIdx.y * COLS;
    const unsigned cols = min((unsigned)COLS, dv - j0);
    float* st = state + (size_t)head * dk * dv;
    for (unsigned x = threadIdx.x; x < dk * COLS; x += blockDim.x) {
        const unsigned p = x / COLS, j = x % COLS;
        S[x] = j < cols ? st[(size_t)p * dv + j0 + j] : 0.0f;
    }
    // Operand g of the sequence: chunk g / 4, step g % 4 (Kc, Qd, A, Kdᵀ), into tile g % 2.
    // Past the last one an empty group, so that `wait_previous` always waits for the
    // operand of the step at hand.
    auto start = [&](unsigned g) {
        if (g >= 4 * n) {
            asm volatile("cp.async.commit_group;\n" ::);
            return;
        }
        const size_t hc = (size_t)(g / 4) * h + head;
        float* t = tiles[g % 2];
        switch (g % 4) {
            case 0: start_tile(t, kc + hc * c * dk, c, dk); break;
            case 1: start_tile(t, qd + hc * c * dk, c, dk); break;
            case 2: start_tile(t, attn + hc * c * c, c, c); break;
            default: start_tile(t, kdt + hc * dk * c, dk, c); break;
        }
    };
    // Thread layout (blockDim.x == 256): column j of the block's COLS, and rows rb, rb + 16, …
    // of each product, each row's sum its own accumulator (independent chains).
    const unsigned j = threadIdx.x % COLS, rb = threadIdx.x / COLS;
    const unsigned rows_c = c / 16, rows_k = dk / 16;  // ≤ MAX_C, ≤ MAX_K (checked by the host)
    start(0);
    __syncthreads();
    for (unsigned i = 0; i < n; ++i) {
        const size_t hc = (size_t)i * h + head;  // (chunk, head) entry
        const float* val = value + hc * c * dv;
        const float lam = lambda[hc];
        float acc[MAX_C];
        // v_new = value − Kc · S
        start(4 * i + 1);
        wait_previous();
        const float* tile = tiles[0];
#pragma unroll
        for (unsigned m = 0; m < MAX_C; ++m) acc[m] = 0.0f;
        for (unsigned p = 0; p < dk; ++p) {
            const float sv = S[p * COLS + j];
#pragma unroll
            for (unsigned m = 0; m < MAX_C; ++m)
                if (m < rows_c) acc[m] = fmaf(tile[(rb + 16 * m) * (dk + 1) + p], sv, acc[m]);
        }
#pragma unroll
        for (unsigned m = 0; m < MAX_C; ++m)
            if (m < rows_c) {
                const unsigned r = rb + 16 * m;
                vn[r * COLS + j] = j < cols ? __fsub_rn(val[(size_t)r * dv + j0 + j], acc[m]) : 0.0f;
            }
        __syncthreads();
        // out = Qd · S + A · v_new, the two products in turn through the tiles.
        start(4 * i + 2);
        wait_previous();
        tile = tiles[1];
#pragma unroll
        for (unsigned m = 0; m < MAX_C; ++m) acc[m] = 0.0f;
        for (unsigned p = 0; p < dk; ++p) {
            const float sv = S[p * COLS + j];
#pragma unroll
            for (unsigned m = 0; m < MAX_C; ++m)
                if (m < rows_c) acc[m] = fmaf(tile[(rb + 16 * m) * (dk + 1) + p], sv, acc[m]);
        }
        __syncthreads();
        start(4 * i + 3);
        wait_previous();
        tile = tiles[0];
        float b[MAX_C];
#pragma unroll
        for (unsigned m = 0; m < MAX_C; ++m) b[m] = 0.0f;
        for (unsigned q = 0; q < c; ++q) {
            const float v = vn[q * COLS + j];
#pragma unroll
            for (unsigned m = 0; m < MAX_C; ++m)
                if (m < rows_c) b[m] = fmaf(tile[(rb + 16 * m) * (c + 1) + q], v, b[m]);
        }
#pragma unroll
        for (unsigned m = 0; m < MAX_C; ++m)
            if (m < rows_c && j < cols) {
                const unsigned r = rb + 16 * m;
                out[((size_t)head * n * c + (size_t)i * c + r) * dv + j0 + j] = __fadd_rn(acc[m], b[m]);
            }
        __syncthreads();
        // S = S · λ + Kdᵀ · v_new
        start(4 * i + 4);
        wait_previous();
        tile = tiles[1];
        float s2[MAX_K];
#pragma unroll
        for (unsigned m = 0; m < MAX_K; ++m) s2[m] = 0.0f;
        for (unsigned q = 0; q < c; ++q) {
            const float v = vn[q * COLS + j];
#pragma unroll
            for (unsigned m = 0; m < MAX_K; ++m)
                if (m < rows_k) s2[m] = fmaf(tile[(rb + 16 * m) * (c + 1) + q], v, s2[m]);
        }
#pragma unroll
        for (unsigned m = 0; m < MAX_K; ++m)
            if (m < rows_k) {
                const unsigned x = (rb + 16 * m) * COLS + j;
                S[x] = __fadd_rn(__fmul_rn(S[x], lam), s2[m]);
            }
        __syncthreads();
    }
    asm volatile("cp.async.wait_all;\n" ::);
    for (unsigned x = threadIdx.x; x < dk * COLS; x += blockDim.x) {
        const unsigned p = x / COLS, j = x % COLS;
        if (j < cols) st[(size_t)p * dv + j0 + j] = S[x];
    }
}

// Everything of the chunked rule that does not depend on the state (src/arch/delta_rule.rs,
// `prepare`), per value head and chunk of c tokens, G the running sum of g inside the chunk,
// Γ_ij = exp(G_i − G_j) for j ≤ i:
//   L      = −strict_lower((β·K) Kᵀ ⊙ Γ)        T = (I − L)⁻¹ by forward substitution, row
//            by row (transformers' loop; T_ij = L_ij + Σ_{j<m<i} L_im T_mj, unit diagonal)
//   value  = T (β·V)                 [c, dv]      kc   = T (β·K ⊙ exp(G))   [c, dk]
//   attn   = lower(Q Kᵀ ⊙ Γ)         [c, c]       qd   = Q ⊙ exp(G)          [c, dk]
//   kdt    = (K ⊙ exp(G_last − G))ᵀ  [dk, c]      lambda = exp(G_last)
// Tokens past t (the last chunk's padding) are zeros, as the unfused path pads them. f32
// throughout; sums run in another order than the unfused matmuls', and the inverse is the
// substitution rather than the product form Π (I + L^(2^m)): equal but for f32 rounding.
// The four products run as register tiles: thread (ti, tj) of 16 × 16 owns rows ti + 16a
// (a < 4) and columns tj + 16b, so each operand loaded from shared memory feeds four or eight
// products. Inputs q, k [h, t, dk], v [h, t, dv], beta, g [h, t]; outputs chunk-major as
// `engy_delta_rule_chunks` reads them. c == 64 (four rows of 16 per thread). Launch: grid
// (h, n), 256 threads, dynamic shared memory (c·(dk + 1) + c·(c + 1) + 5c) floats.
#define PREP_ROWS 4   // c / 16
#define PREP_COLS 8   // output columns a thread owns per pass of 128
extern "C" __global__ void engy_delta_rule_prep(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ beta, const float* __restrict__ g, float* __restrict__ value,
    float* __restrict__ kc, float* __restrict__ qd, float* __restrict__ attn,
    float* __restrict__ kdt, float* __restrict__ lambda, unsigned t, unsigned n, unsigned h,
    unsigned c, unsigned dk, unsigned dv) {
    extern __shared__ float sh[];
    float* K = sh;                         // [c][dk + 1]: K, then β·K ⊙ exp(G)
    float* T = K + c * (dk + 1);           // [c][c + 1]: L, then T in place
    float* G = T + c * (c + 1);            // [c]
    float* B = G + c;                      // [c] beta
    float* R = B + c;                      // [c] the row being substituted
    float* E = R + c;                      // [c] exp(G)
    float* D = E + c;                      // [c] exp(G_last − G)
    const unsigned head = blockIdx.x, chunk = blockIdx.y;
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    const unsigned ti = tid / 16, tj = tid % 16;
    const size_t hc = (size_t)chunk * h + head;  // (chunk, head) entry of the outputs
    const size_t t0 = (size_t)chunk * c;          // first token of the chunk
    const unsigned rows = t0 + c <= t ? c : (unsigned)(t - t0);  // real tokens in the chunk
    const float* qh = q + (size_t)head * t * dk;
    const float* kh = k + (size_t)head * t * dk;
    const float* vh = v + (size_t)head * t * dv;
    for (unsigned x = tid; x < c * dk; x += nt) {
        const unsigned i = x / dk, d = x % dk;
        K[i * (dk + 1) + d] = i < rows ? kh[(t0 + i) * dk + d] : 0.0f;
    }
    for (unsigned i = tid; i < c; i += nt) {
        G[i] = i < rows ? g[(size_t)head * t + t0 + i] : 0.0f;
        B[i] = i < rows ? beta[(size_t)head * t + t0 + i] : 0.0f;
    }
    __syncthreads();
    if (tid == 0) {
        float s = 0.0f;
        for (unsigned i = 0; i < c; ++i) {
            s = __fadd_rn(s, G[i]);
            G[i] = s;
        }
    }
    __syncthreads();
    for (unsigned i = tid; i < c; i += nt) {
        E[i] = expf(G[i]);
        D[i] = expf(__fsub_rn(G[c - 1], G[i]));
    }
    // L (strictly below the diagonal, zeros elsewhere) and attn (on and below it): per d, four
    // rows' (β·k, q) and four columns' k feed 32 products.
    {
        float acc_k[PREP_ROWS][PREP_ROWS], acc_q[PREP_ROWS][PREP_ROWS];
#pragma unroll
        for (unsigned a = 0; a < PREP_ROWS; ++a)
#pragma unroll
            for (unsigned b = 0; b < PREP_ROWS; ++b) acc_k[a][b] = acc_q[a][b] = 0.0f;
        float bi[PREP_ROWS];
        const float* qr[PREP_ROWS];
#pragma unroll
        for (unsigned a = 0; a < PREP_ROWS; ++a) {
            const unsigned i = ti + 16 * a;
            bi[a] = B[i];
            qr[a] = i < rows ? qh + (t0 + i) * dk : nullptr;
        }
        for (unsigned d = 0; d < dk; ++d) {
            float kb[PREP_ROWS], qv[PREP_ROWS], kj[PREP_ROWS];
#pragma unroll
            for (unsigned a = 0; a < PREP_ROWS; ++a) {
                kb[a] = __fmul_rn(K[(ti + 16 * a) * (dk + 1) + d], bi[a]);
                qv[a] = qr[a] ? qr[a][d] : 0.0f;
                kj[a] = K[(tj + 16 * a) * (dk + 1) + d];
            }
#pragma unroll
            for (unsigned a = 0; a < PREP_ROWS; ++a)
#pragma unroll
                for (unsigned b = 0; b < PREP_ROWS; ++b) {
                    acc_k[a][b] = fmaf(kb[a], kj[b], acc_k[a][b]);
                    acc_q[a][b] = fmaf(qv[a], kj[b], acc_q[a][b]);
                }
        }
#pragma unroll
        for (unsigned a = 0; a < PREP_ROWS; ++a)
#pragma unroll
            for (unsigned b = 0; b < PREP_ROWS; ++b) {
                const unsigned i = ti + 16 * a, j = tj + 16 * b;
                float l = 0.0f, at = 0.0f;
                if (j <= i) {
                    const float decay = expf(__fsub_rn(G[i], G[j]));
                    at = __fmul_rn(acc_q[a][b], decay);
                    if (j < i) l = -__fmul_rn(acc_k[a][b], decay);
                }
                T[i * (c + 1) + j] = l;
                attn[(hc * c + i) * c + j] = at;
            }
    }
    __syncthreads();
    // Forward substitution, row by row: row i reads only rows above it (already final).
    for (unsigned i = 1; i < c; ++i) {
        if (tid < i) R[tid] = T[i * (c + 1) + tid];
        __syncthreads();
        if (tid < i) {
            const unsigned j = tid;
            float s = R[j];
            for (unsigned m = j + 1; m < i; ++m) s = fmaf(R[m], T[m * (c + 1) + j], s);
            T[i * (c + 1) + j] = s;
        }
        __syncthreads();
    }
    // T's unit diagonal (zeros stay above it); kdt from the raw K, i fastest so the stores
    // are contiguous; qd = Q ⊙ exp(G).
    for (unsigned i = tid; i < c; i += nt) T[i * (c + 1) + i] = 1.0f;
    for (unsigned x = tid; x < c * dk; x += nt) {
        const unsigned d = x / c, i = x % c;
        kdt[(hc * dk + d) * c + i] = __fmul_rn(K[i * (dk + 1) + d], D[i]);
    }
    for (unsigned x = tid; x < c * dk; x += nt) {
        const unsigned i = x / dk, d = x % dk;
        const float qv = i < rows ? qh[(t0 + i) * dk + d] : 0.0f;
        qd[(hc * c + i) * dk + d] = __fmul_rn(qv, E[i]);
    }
    __syncthreads();
    // K becomes β·K ⊙ exp(G), the operand of kc.
    for (unsigned x = tid; x < c * dk; x += nt) {
        const unsigned i = x / dk, d = x % dk;
        float* p = K + i * (dk + 1) + d;
        *p = __fmul_rn(__fmul_rn(*p, B[i]), E[i]);
    }
    __syncthreads();
    // value = T (β·V) and kc = T (β·K ⊙ exp(G)): per j, four rows of T and eight columns of the
    // operand feed 32 products; columns in passes of 128.
    for (unsigned which = 0; which < 2; ++which) {
        const unsigned width = which == 0 ? dv : dk;
        float* out = which == 0 ? value : kc;
        for (unsigned e0 = 0; e0 < width; e0 += 16 * PREP_COLS) {
            float acc[PREP_ROWS][PREP_COLS];
#pragma unroll
            for (unsigned a = 0; a < PREP_ROWS; ++a)
#pragma unroll
                for (unsigned b = 0; b < PREP_COLS; ++b) acc[a][b] = 0.0f;
            for (unsigned j = 0; j < c; ++j) {
                float tv[PREP_ROWS], src[PREP_COLS];
#pragma unroll
                for (unsigned a = 0; a < PREP_ROWS; ++a) tv[a] = T[(ti + 16 * a) * (c + 1) + j];
#pragma unroll
                for (unsigned b = 0; b < PREP_COLS; ++b) {
                    const unsigned e = e0 + tj + 16 * b;
                    float x = 0.0f;
                    if (e < width) {
                        if (which == 0) {
                            if (j < rows) x = __fmul_rn(vh[(t0 + j) * dv + e], B[j]);
                        } else {
                            x = K[j * (dk + 1) + e];
                        }
                    }
                    src[b] = x;
                }
#pragma unroll
                for (unsigned a = 0; a < PREP_ROWS; ++a)
#pragma unroll
                    for (unsigned b = 0; b < PREP_COLS; ++b)
                        acc[a][b] = fmaf(tv[a], src[b], acc[a][b]);
            }
#pragma unroll
            for (unsigned a = 0; a < PREP_ROWS; ++a)
#pragma unroll
                for (unsigned b = 0; b < PREP_COLS; ++b) {
                    const unsigned i = ti + 16 * a, e = e0 + tj + 16 * b;
                    if (e < width) out[(hc * c + i) * width + e] = acc[a][b];
                }
        }
    }
    if (tid == 0) lambda[hc] = E[c - 1];
}
