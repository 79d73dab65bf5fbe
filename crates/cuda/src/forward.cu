// Whole-forward kernels (forward.rs): a plain decoder's layers with activations, KV cache
// and routing on the device. Appended to kernels.cu (deq8, h2f come from there).
//
// Owns: the weight products over chunk tables (dense matrices and routed experts alike):
// `mvt_*` / `mvt1_*` on tensor cores (f16 operands, f32 sums), for Q8_0 and Q4_K their
// int8 forms (`quant_x8` + `mvi_*` / `mvi1_*` / `mvid_*` on s8 tensor cores, Q4_K's decode
// `mvq_q4_k` on dp4a: the same bits; SLUICE_CUDA_INT8=0 for the f16 ones) and `mvg_*` in
// f32 (F32 and BF16 weights, or SLUICE_CUDA_MMA=0); embedding rows, RMS norms fused with the residual
// add, q/k norm + NEOX RoPE, the f16 KV cache store, attention (online softmax, tiles of
// keys), the softmax top-k router, grouping (token, slot) pairs by expert on the device
// (`moe_chunks`), the GLU activation and the weighted sum of a token's experts.
//
// Every (token, slot) row of a product is computed with the same arithmetic whatever chunk
// (and whatever column of a tensor-core product) it lands in, so chunking a prompt or the
// order experts were grouped in never changes a bit; only the weights' addresses differ
// between resident experts and a VRAM expert cache, so cache budgets never change a bit
// either.

// Rows (tokens, or (token, slot) pairs) of one chunk: `mvt_*` multiplies each dequantized
// weight group with up to MVG_N of them (four 8-column tiles of the tensor-core product),
// `mvg_*` with groups of MVG_SUB at a time.
#define MVG_N 32
#define MVG_SUB 8
// Warps (= weight rows, one each) of a `mvg_*` block.
#define MVG_WARPS 4

#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Up to MVG_N rows (tokens, or (token, slot) pairs) that use the same weight matrix
// (`unit`: an index into the launch's pointer table). 40 bytes; forward.rs writes the
// same layout.
struct Chunk {
    int unit;
    int count;
    int rows[MVG_N];
};

// Y[rows[i] * out_rows + r] = sum_c W[r, c] * X[(rows[i] / x_div) * cols + c] for every
// chunk (blockIdx.y; the grid may hold more blocks than chunks: *n_chunks says how many).
template <int TY>
__device__ __forceinline__ void mv_chunks(const u64* __restrict__ wtab,
                                          const Chunk* __restrict__ chunks,
                                          const int* __restrict__ n_chunks,
                                          const float* __restrict__ X, int x_div,
                                          float* __restrict__ Y, int out_rows, int cols,
                                          long long row_bytes, int bx) {
    if ((int)blockIdx.y >= *n_chunks) return;
    const Chunk* c = chunks + blockIdx.y;
    const int warp = (bx * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= out_rows) return;
    const u8* row = (const u8*)wtab[c->unit] + (size_t)warp * (size_t)row_bytes;
    const int count = c->count;
    // MVG_SUB rows at a time (registers); each row's sum is the same whichever group.
    for (int t0 = 0; t0 < count; t0 += MVG_SUB) {
        const int n = (count - t0 < MVG_SUB) ? count - t0 : MVG_SUB;
        float acc[MVG_SUB];
        row_dots<TY, MVG_SUB>(
            row, cols, n, lane,
            [&](int t) { return X + (size_t)(c->rows[t0 + t] / x_div) * cols; }, acc);
#pragma unroll
        for (int t = 0; t < MVG_SUB; t++) {
            if (t < n) {
                const float v = warp_sum(acc[t]);
                if (lane == 0) Y[(size_t)c->rows[t0 + t] * out_rows + warp] = v;
            }
        }
    }
}

// Tensor-core form of mv_chunks (`mvt_*`, sm_80+; the host takes it for every format but
// F32 and BF16, whose values f16 cannot hold, unless SLUICE_CUDA_MMA=0): a block of
// MVT_WARPS warps computes MVT_ROWS weight rows for one chunk of up to MVG_N rows of X
// (tiles of 8); warp w takes the groups of 32 columns whose index is w (mod MVT_WARPS), and
// the warps' partial sums are added in one fixed tree. Weights (deq8) and activations are
// rounded to f16 and multiplied by mma.m16n8k16 with f32 accumulation. Lane (g, q) =
// (lane / 4, lane % 4) puts columns 8q .. 8q+7 of a group (one deq8) of weight rows g and
// g + 8 into its A fragments, the first four in one mma, the last four in the next; its B
// fragments take the same columns of X row g of each tile, so both operands see the same
// column order. A dequantized group serves every tile of the chunk. Each row of X is one
// column of a product, computed the same way whichever column and tile it is in, so
// chunking never changes a bit (checked on the GPU: prompts in chunks of 512 and 7, and
// the expert-cache tests, give the same bits).
#define MVT_ROWS 16
#define MVT_WARPS 16
#define MVT_TILES (MVG_N / 8)

// Two floats as one f16x2 register (lo in the low half).
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// c += A (16 x 16, f16, row) * B (16 x 8, f16, col) in f32.
__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Bytes one step of `mvt_*` stages in shared memory: MVT_ROWS rows of MVT_WARPS * 32
// columns, at most 2 bytes a column (F16). (Steps of as many columns as 32 KB holds were
// slower on the H200: 100 vs 115 t/s decode, 2127 vs 2277 t/s prefill on the 30B Q4_K.)
#define MVT_STAGE (MVT_ROWS * MVT_WARPS * 32 * 2)
// Warps of a block of the decode kernel `mvd_*` (`mvt1_*`'s chains in blocks of 4 warps).
#define MVD_WARPS 4
// The decode kernel `mvt1_*` takes its step (columns, a multiple of 512) and how many
// steps are staged at once (at most MVT1_MAX_STAGES; the copies of the next stages - 1 are
// in flight while one is multiplied) from the host, in dynamic shared memory.
#define MVT1_MAX_STAGES 8

// Asynchronous copies global -> shared (sm_80+): `bytes` is 4 or 16; the copies a
// thread issued since its last commit form one group; wait_group N waits until at most N
// of the thread's groups are still in flight.
__device__ __forceinline__ void cp_async(void* dst, const void* src, int bytes) {
#if __CUDA_ARCH__ >= 800
    u32 d;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(d) : "l"(dst));
    if (bytes == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src));
    }
#else
    if (bytes == 16) {
        *(uint4*)dst = *(const uint4*)src;
    } else {
        *(u32*)dst = *(const u32*)src;
    }
#endif
}
// cp.async.wait_group takes an immediate: n (0 .. MVT1_MAX_STAGES - 1) by a switch.
__device__ __forceinline__ void cp_async_wait_n(int n);
__device__ __forceinline__ void cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N));
#endif
}
__device__ __forceinline__ void cp_async_wait_n(int n) {
    switch (n) {
        case 0: cp_async_wait<0>(); break;
        case 1: cp_async_wait<1>(); break;
        case 2: cp_async_wait<2>(); break;
        case 3: cp_async_wait<3>(); break;
        case 4: cp_async_wait<4>(); break;
        case 5: cp_async_wait<5>(); break;
        case 6: cp_async_wait<6>(); break;
        default: cp_async_wait<7>(); break;
    }
}

// Stages the bytes of columns k0 .. k0 + ncols of the block's `nrows` weight rows into
// `dst` (row r at r * segb), spread over all threads: with ASYNC, 16-byte asynchronous
// copies when the rows' addresses and sizes allow, else 4-byte ones; without, 4-byte loads;
// single bytes (synchronous) when the rows are not 4-byte aligned.
template <bool ASYNC, int W = MVT_WARPS>
__device__ __forceinline__ void mvt_stage(u8* __restrict__ dst, const u8* __restrict__ base,
                                          int nrows, long long row_bytes, int cols, int k0,
                                          int ncols) {
    const long long start = (long long)k0 * row_bytes / cols;
    const int segb = (int)((long long)ncols * row_bytes / cols);
    const size_t align = (size_t)(base + start) | (size_t)row_bytes | (size_t)segb;
    const int width = (ASYNC && (align & 15) == 0) ? 16 : (align & 3) == 0 ? 4 : 1;
    if (ASYNC && width > 1) {
        const int per_row = segb / width;
        const int total = nrows * per_row;
        for (int i = threadIdx.x; i < total; i += W * 32) {
            const int r = i / per_row;
            const int w = i - r * per_row;
            cp_async(dst + (size_t)i * width,
                     base + (size_t)r * (size_t)row_bytes + start + (size_t)w * width, width);
        }
    } else if (width == 4) {
        const int per_row = segb >> 2;
        const int total = nrows * per_row;
#pragma unroll 4
        for (int i = threadIdx.x; i < total; i += W * 32) {
            const int r = i / per_row;
            const int w = i - r * per_row;
            ((u32*)dst)[i] = ((const u32*)(base + (size_t)r * (size_t)row_bytes + start))[w];
        }
    } else {
        const int total = nrows * segb;
#pragma unroll 4
        for (int i = threadIdx.x; i < total; i += W * 32) {
            const int r = i / segb;
            dst[i] = base[(size_t)r * (size_t)row_bytes + start + (i - r * segb)];
        }
    }
}

// Int8 tensor-core products (`mvi_*` / `mvi1_*` / `mvid_*`, Q4_K and Q8_0; the host's
// choice unless SLUICE_CUDA_INT8=0): the same blocks, staging, chains and tree as
// `mvt_*` / `mvt1_*` / `mvd_*`, but no weight is turned into a float. The product's
// input rows are first quantized by `quant_x8`, per row (a token, or a (token, slot)
// pair reading its token's row) and per 32-column block, into {i8 q[32]; f32 d; f32 s;
// 8 bytes unused} (QX_BYTES, 16-byte aligned): d = amax / 127, q = rint(x * (127 / amax)) (to nearest even, |q| <= 127), s =
// the block's f32 sum of x (for Q4_K's min term). Each weight block of 32 columns (a
// Q8_0 block, a Q4_K sub-block) goes into `mma.m16n8k32.s8` as its integer quants
// (Q8_0's bytes as they are, Q4_K's nibbles by and / shift of 32-bit words) against the
// quants of 8 rows of X: an exact int32 dot of 32 products each (|dot| <= 32 * 128 *
// 127 < 2^22). Then, per (weight row r, X row t, block b), in f32 with explicit rounding
// (no contraction left to the compiler):
//   acc = fma(dw[r,b] * dx[t,b], dot, acc)                     (Q8_0: dw = d)
//   acc = fma(-mw[r,b], s[t,b], acc)                            (Q4_K: dw = d * sc, mw = dmin * m)
// where chain w takes the blocks b = w (mod MVT_WARPS) in order, as the f16 path's
// chains do. Why the bits are the same in any chunk and any kernel: the quants of a row
// depend only on that row's 32 values (the same instructions wherever the row sits);
// the int32 dot is exact, so where the row sits in the mma (its column) and which tile
// it is in change nothing; dw, mw, dx, s and the two fmas are the same f32 operations
// for the row in every kernel (`mvi_*` for prefill chunks, `mvi1_*` / `mvid_*` for
// decode), and the chains and the tree are the f16 path's. The dot goes to f32 exactly:
// the accumulator starts at the bits of 2^23 + 2^22 (0x4B400000), so the s32 result read
// as f32 is 12582912 + dot, and subtracting 12582912 is exact for |dot| < 2^22.
#define QX_BYTES 48
#define QX_MAGIC 0x4B400000

// c (s32, from QX_MAGIC) += A (16 x 32, s8, row) * B (32 x 8, s8, col).
__device__ __forceinline__ void mma16832(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Which formats have the int8 form (the host asks the same of `Funcs`).
#define I8_FORMAT(TY) ((TY) == T_Q8_0 || (TY) == T_Q4_K)

// Block kl (32 columns) of a staged weight row `row` (the step's bytes): the quants of
// columns 4q .. 4q+3 (*lo) and 16+4q .. 16+4q+3 (*hi), the block's scale *dw and min
// *mw (Q4_K; 0 otherwise).
template <int TY>
__device__ __forceinline__ void wi8(const u8* __restrict__ row, int kl, int q, u32* lo,
                                    u32* hi, float* dw, float* mw) {
    if (TY == T_Q8_0) {
        const u8* b = row + kl * 34;
        const u16* qs = (const u16*)(b + 2 + 4 * q);  // 2-byte aligned
        *lo = (u32)qs[0] | ((u32)qs[1] << 16);
        *hi = (u32)qs[8] | ((u32)qs[9] << 16);
        *dw = h2f(*(const u16*)b);
        *mw = 0.0f;
    } else if (TY == T_Q4_K) {
        // A step starts on a 256-column block; blocks of 144 bytes, 8-byte aligned.
        const u8* b = row + (kl >> 3) * 144;
        const int j = kl & 7;
        const u32 dm = *(const u32*)b;
        const u32* sw = (const u32*)(b + 4);
        int sc, m;
        k4_scale_min_words(sw[0], sw[1], sw[2], j, &sc, &m);
        *dw = __fmul_rn(h2f((u16)(dm & 0xFFFF)), (float)sc);
        *mw = __fmul_rn(h2f((u16)(dm >> 16)), (float)m);
        const u32* qs = (const u32*)(b + 16 + 32 * (j >> 1));
        const int shift = (j & 1) * 4;
        *lo = (qs[q] >> shift) & 0x0F0F0F0Fu;
        *hi = (qs[4 + q] >> shift) & 0x0F0F0F0Fu;
    } else {
        *lo = 0;
        *hi = 0;
        *dw = 0.0f;
        *mw = 0.0f;
    }
}

// One chain's step through block kl of the stage (block kc of the row) for every tile:
// weight rows g and g + 8 of the block's 16 against X rows 8j + g (see above).
template <int TY, int TILES>
__device__ __forceinline__ void mvi_group(const u8* __restrict__ stage, int segb, int kl,
                                          int kc, int g, int q, int nrows, int tiles,
                                          const float* const* xr, float (*acc)[4]) {
    u32 a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    float da = 0.0f, ma = 0.0f, db = 0.0f, mb = 0.0f;
    if (g < nrows) wi8<TY>(stage + g * segb, kl, q, &a0, &a2, &da, &ma);
    if (g + 8 < nrows) wi8<TY>(stage + (g + 8) * segb, kl, q, &a1, &a3, &db, &mb);
#pragma unroll
    for (int j = 0; j < TILES; j++) {
        if (j < tiles) {
            const u8* xb = (const u8*)xr[j] + (size_t)kc * QX_BYTES;
            const float2 ds = *(const float2*)(xb + 32);
            const u32* xq = (const u32*)xb;
            int c[4] = {QX_MAGIC, QX_MAGIC, QX_MAGIC, QX_MAGIC};
            mma16832(c, a0, a1, a2, a3, xq[q], xq[4 + q]);
            // X rows 2q and 2q + 1 of the tile (the fragment's columns): lanes 8q, 8q + 4.
            const float d0 = __shfl_sync(0xffffffffu, ds.x, 8 * q);
            const float d1 = __shfl_sync(0xffffffffu, ds.x, 8 * q + 4);
            const float f0 = __fsub_rn(__int_as_float(c[0]), 12582912.0f);
            const float f1 = __fsub_rn(__int_as_float(c[1]), 12582912.0f);
            const float f2 = __fsub_rn(__int_as_float(c[2]), 12582912.0f);
            const float f3 = __fsub_rn(__int_as_float(c[3]), 12582912.0f);
            acc[j][0] = __fmaf_rn(__fmul_rn(da, d0), f0, acc[j][0]);
            acc[j][1] = __fmaf_rn(__fmul_rn(da, d1), f1, acc[j][1]);
            acc[j][2] = __fmaf_rn(__fmul_rn(db, d0), f2, acc[j][2]);
            acc[j][3] = __fmaf_rn(__fmul_rn(db, d1), f3, acc[j][3]);
            if (TY == T_Q4_K) {
                const float s0 = __shfl_sync(0xffffffffu, ds.y, 8 * q);
                const float s1 = __shfl_sync(0xffffffffu, ds.y, 8 * q + 4);
                acc[j][0] = __fmaf_rn(-ma, s0, acc[j][0]);
                acc[j][1] = __fmaf_rn(-ma, s1, acc[j][1]);
                acc[j][2] = __fmaf_rn(-mb, s0, acc[j][2]);
                acc[j][3] = __fmaf_rn(-mb, s1, acc[j][3]);
            }
        }
    }
}

// One lane's share of `quant_x8`'s block: `x` its 8 values (columns 8 sub .. 8 sub + 7 of
// the block; zeros where the row is absent), lanes 4i .. 4i + 3 of the warp one block, every
// lane of the warp taking part (the xor tree). Writes the lane's 8 quants and, lane sub 0,
// the scale and the sum, to `out` (the block's QX_BYTES) where `ok`. `quant_x8` and the
// dp4a decode product (which quantizes its chunk's rows into shared memory) both call
// this: a row's bytes are the same whoever computes them.
__device__ __forceinline__ void quant_lane(const float* x, bool ok, int sub, u8* out) {
    float amax = 0.0f, sum = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        amax = fmaxf(amax, fabsf(x[k]));
        sum = __fadd_rn(sum, x[k]);
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 2));
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = (amax > 0.0f) ? __fdiv_rn(127.0f, amax) : 0.0f;
    u32 w[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        u32 v = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int qv = __float2int_rn(__fmul_rn(x[4 * h + k], id));
            qv = max(-127, min(127, qv));
            v |= ((u32)qv & 0xFFu) << (8 * k);
        }
        w[h] = v;
    }
    if (!ok) return;
    *(uint2*)(out + 8 * sub) = make_uint2(w[0], w[1]);
    if (sub == 0) *(float2*)(out + 32) = make_float2(d, sum);
}

// Lane (blk, sub)'s 8 values of row `src` (`ok`), zeros otherwise.
__device__ __forceinline__ void quant_load(const float* __restrict__ src, bool ok, float* x) {
    if (ok) {
        const float4 u = ((const float4*)src)[0], v = ((const float4*)src)[1];
        x[0] = u.x; x[1] = u.y; x[2] = u.z; x[3] = u.w;
        x[4] = v.x; x[5] = v.y; x[6] = v.z; x[7] = v.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) x[k] = 0.0f;
    }
}

// The int8 products' input: row t of chunk blockIdx.y (X row rows[t] / x_div, `cols`
// values) into row blockIdx.y * MVG_N + t of `xq` (cols / 32 blocks of QX_BYTES). Four
// lanes a block, 8 values each; the amax and the sum in a fixed xor tree, so a row's
// bytes depend only on its values.
extern "C" __global__ void __launch_bounds__(256)
    quant_x8(const Chunk* __restrict__ chunks, const int* __restrict__ n_chunks,
             const float* __restrict__ X, int x_div, u8* __restrict__ xq, int cols) {
    if ((int)blockIdx.y >= *n_chunks) return;
    const Chunk* c = chunks + blockIdx.y;
    const int nb = cols >> 5;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int blk = i >> 2, sub = i & 3;
    const int t = blk / nb, b = blk - t * nb;
    const bool ok = t < c->count;  // the same for a block's four lanes
    float x[8];
    quant_load(ok ? X + (size_t)(c->rows[t] / x_div) * cols + 32 * b + 8 * sub : X, ok, x);
    quant_lane(x, ok, sub,
               xq + ((size_t)blockIdx.y * MVG_N + t) * (size_t)nb * QX_BYTES + (size_t)b * QX_BYTES);
}

// Bytes of the warps' partial sums `mvt_chunks` leaves in shared memory after its column
// loop: [warp][tile * 4 + fragment element][lane] (conflict-free writes and reads).
#define MVT_PART(TILES) (MVT_WARPS * (TILES) * 4 * 32 * 4)

// `smem`: `stages` staging buffers of `stage_bytes` (a multiple of 16, at least MVT_ROWS
// rows of `step` columns) during the column loop, then the partial sums (MVT_PART).
template <int TY, int TILES, bool ASYNC, int W = MVT_WARPS, bool I8 = false>
__device__ __forceinline__ void mvt_chunks(u8* __restrict__ smem, int stages, int step,
                                           int stage_bytes, const u64* __restrict__ wtab,
                                           const Chunk* __restrict__ chunks,
                                           const int* __restrict__ n_chunks,
                                           const float* __restrict__ X, int x_div,
                                           float* __restrict__ Y, int out_rows, int cols,
                                           long long row_bytes, int bx) {
    // W warps run the MVT_WARPS chains of partial sums: warp w the chains w, w + W, ..
    // (CPW of them), each over the same column groups in the same order whatever W.
    static_assert(MVT_WARPS % W == 0 && W >= TILES * 4, "warps");
    constexpr int CPW = MVT_WARPS / W;
    if ((int)blockIdx.y >= *n_chunks) return;
    const Chunk* c = chunks + blockIdx.y;
    const int count = c->count;
    const int tiles = (count + 7) >> 3;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, q = lane & 3;
    const int r0 = bx * MVT_ROWS;
    const int nrows = (out_rows - r0 < MVT_ROWS) ? out_rows - r0 : MVT_ROWS;
    const u8* base = (const u8*)wtab[c->unit] + (size_t)r0 * (size_t)row_bytes;
    const float* xr[TILES];
    bool vt[TILES];
    float acc[CPW][TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; j++) {
        const int t = 8 * j + g;
        vt[j] = t < count;
        // I8: X is `quant_x8`'s output, row blockIdx.y * MVG_N + t (the chunk's row t).
        xr[j] = I8 ? (const float*)((const u8*)X + ((size_t)blockIdx.y * MVG_N + (vt[j] ? t : 0)) *
                                                    (size_t)(cols >> 5) * QX_BYTES)
                   : X + (size_t)(c->rows[vt[j] ? t : 0] / x_div) * cols;
#pragma unroll
        for (int ci = 0; ci < CPW; ci++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[ci][j][i] = 0.0f;
    }
    // Steps of `step` columns, a multiple of MVT_WARPS * 32 = 512 (whole blocks of every
    // format): the block copies the rows' bytes of a step into shared memory, then warp w
    // dequantizes the step's column groups w, w + 16, ... from there, so every warp takes
    // the groups whose index is w mod MVT_WARPS, in order, whatever the step. With stages
    // > 1 (the decode kernel `mvt1_*`, whose few rows of X leave the block waiting on its
    // loads) the copies of the next stages - 1 steps are in flight (asynchronous, into
    // buffers of their own) while a step is multiplied; the prefill kernel, whose
    // multiplications hide the loads, was slower so (1900 vs 2314 t/s pp256 on the 30B
    // Q4_K, H200) and stages one 512-column step at a time. Which buffer a step sits in,
    // and how many columns it has, never changes what is computed from it.
    for (int i = 0; i < stages - 1; i++) {
        const int k = i * step;
        if (k < cols)
            mvt_stage<ASYNC, W>(smem + i * stage_bytes, base, nrows, row_bytes, cols, k,
                             (cols - k < step) ? cols - k : step);
        if (ASYNC) cp_async_commit();
    }
    for (int k0 = 0, s = 0; k0 < cols; k0 += step, s = (s + 1 == stages) ? 0 : s + 1) {
        const int ncols = (cols - k0 < step) ? cols - k0 : step;
        const int segb = (int)((long long)ncols * row_bytes / cols);
        // Step s + stages - 1 goes into the buffer step s - 1 used: every thread finished
        // reading it before the barrier that ended the previous step.
        const int kn = k0 + (stages - 1) * step;
        if (kn < cols) {
            const int b = (s + stages - 1) % stages;
            mvt_stage<ASYNC, W>(smem + b * stage_bytes, base, nrows, row_bytes, cols, kn,
                             (cols - kn < step) ? cols - kn : step);
        }
        if (ASYNC) {
            cp_async_commit();
            cp_async_wait_n(stages - 1);  // step s's copies (this thread's) are done
        }
        __syncthreads();  // step s's bytes, copied by every thread, are in place
        const u8* stage = smem + s * stage_bytes;
        // Chain warp + W ci takes the step's groups kl = kb + warp + W ci (kb: 0, 16, ..):
        // every chain the groups whose index is its own mod MVT_WARPS, in order.
        const int ng = ncols >> 5;
        for (int kb = 0; kb < ng; kb += MVT_WARPS) {
#pragma unroll
            for (int ci = 0; ci < CPW; ci++) {
                const int kl = kb + warp + W * ci;
                if (kl >= ng) continue;
                const int kc = (k0 >> 5) + kl;
                if (I8) {
                    mvi_group<TY, TILES>(stage, segb, kl, kc, g, q, nrows, tiles, xr, acc[ci]);
                    continue;
                }
                const int p = 4 * kl + q;  // group of 8 within the step
                float wa[8], wb[8];
                if (g < nrows) {
                    deq8<TY>(stage + g * segb, p, wa);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++) wa[i] = 0.0f;
                }
                if (g + 8 < nrows) {
                    deq8<TY>(stage + (g + 8) * segb, p, wb);
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++) wb[i] = 0.0f;
                }
                const u32 a0 = pack_h2(wa[0], wa[1]), a1 = pack_h2(wb[0], wb[1]);
                const u32 a2 = pack_h2(wa[2], wa[3]), a3 = pack_h2(wb[2], wb[3]);
                const u32 a4 = pack_h2(wa[4], wa[5]), a5 = pack_h2(wb[4], wb[5]);
                const u32 a6 = pack_h2(wa[6], wa[7]), a7 = pack_h2(wb[6], wb[7]);
                const int xp = 4 * kc + q;
#pragma unroll
                for (int j = 0; j < TILES; j++) {
                    if (j < tiles) {
                        float4 x0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), x1 = x0;
                        if (vt[j]) {
                            const float4* x = (const float4*)(xr[j] + 8 * xp);
                            x0 = x[0];
                            x1 = x[1];
                        }
                        mma16816(acc[ci][j], a0, a1, a2, a3, pack_h2(x0.x, x0.y),
                                 pack_h2(x0.z, x0.w));
                        mma16816(acc[ci][j], a4, a5, a6, a7, pack_h2(x1.x, x1.y),
                                 pack_h2(x1.z, x1.w));
                    }
                }
            }
        }
        __syncthreads();  // step s's buffer is free for the next copy into it
    }
    // (The loop's last barrier: the staging area becomes the partial sums.)
    float(*part)[TILES * 4][32] = (float(*)[TILES * 4][32])smem;
#pragma unroll
    for (int ci = 0; ci < CPW; ci++)
#pragma unroll
        for (int j = 0; j < TILES; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) part[warp + W * ci][4 * j + i][lane] = acc[ci][j][i];
    __syncthreads();
    // Thread (e, lane) = (warp, lane), e < TILES * 4, sums element e of every warp's
    // fragments in a fixed tree and writes it: tile e / 4, fragment element e % 4 = weight
    // row g (e % 4 < 2) or g + 8, X row 8 (e / 4) + 2q + (e & 1).
    const int e = warp, j = e >> 2;
    if (e >= TILES * 4 || j >= tiles) return;
    float s[MVT_WARPS];
#pragma unroll
    for (int w = 0; w < MVT_WARPS; w++) s[w] = part[w][e][lane];
#pragma unroll
    for (int step = 1; step < MVT_WARPS; step <<= 1)
#pragma unroll
        for (int w = 0; w < MVT_WARPS; w += 2 * step) s[w] += s[w + step];
    const int r = r0 + g + (((e & 3) >> 1) << 3);
    const int t = 8 * j + 2 * q + (e & 1);
    if (r < out_rows && t < count) Y[(size_t)c->rows[t] * out_rows + r] = s[0];
}

// Embedding rows: x[t] = dequantized row tokens[t] of W, times scale.
template <int TY>
__device__ __forceinline__ void embed_rows(const u8* __restrict__ W, long long row_bytes,
                                           const int* __restrict__ tokens,
                                           float* __restrict__ x, int cols, float scale) {
    const int t = blockIdx.x;
    const u8* row = W + (size_t)tokens[t] * (size_t)row_bytes;
    for (int p = threadIdx.x; p < (cols >> 3); p += blockDim.x) {
        float w[8];
        deq8<TY>(row, p, w);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            x[(size_t)t * cols + 8 * p + i] = (scale != 1.0f) ? w[i] * scale : w[i];
        }
    }
}

// Up to three matrices of the same format and column count that multiply the same X
// through the same chunk table (q, k and v; gate and up) in one launch: the grid's x
// blocks cover matrix 0's rows, then matrix 1's, then matrix 2's (`rows1`, `rows2` = 0 for
// fewer); `per_block` weight rows a block. A row is computed the same way in any launch.
struct Parts {
    const u64* w;
    float* y;
    int rows;
    int bx;
};
__device__ __forceinline__ Parts pick_part(const u64* w0, const u64* w1, const u64* w2,
                                           float* y0, float* y1, float* y2, int rows0,
                                           int rows1, int rows2, int per_block) {
    const int b0 = (rows0 + per_block - 1) / per_block;
    const int b1 = (rows1 + per_block - 1) / per_block;
    const int bx = blockIdx.x;
    if (bx < b0) return Parts{w0, y0, rows0, bx};
    if (bx < b0 + b1) return Parts{w1, y1, rows1, bx - b0};
    return Parts{w2, y2, rows2, bx - b0 - b1};
}

#define MV_PARAMS                                                                             \
    const u64 *w0, const u64 *w1, const u64 *w2, const Chunk *chunks, const int *n_chunks,   \
        const float *X, int x_div, float *y0, float *y1, float *y2, int rows0, int rows1,     \
        int rows2, int cols, long long row_bytes
#define PICK_PART(per_block) pick_part(w0, w1, w2, y0, y1, y2, rows0, rows1, rows2, per_block)

#define FWD_KERNELS(name, TY)                                                                 \
    extern "C" __global__ void __launch_bounds__(MVG_WARPS * 32) mvg_##name(MV_PARAMS) {     \
        const Parts pp = PICK_PART(MVG_WARPS);                                                \
        mv_chunks<TY>(pp.w, chunks, n_chunks, X, x_div, pp.y, pp.rows, cols, row_bytes,       \
                      pp.bx);                                                                 \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MVT_WARPS * 32) mvt_##name(MV_PARAMS) {     \
        __shared__ __align__(16) u8 smem[MVT_PART(MVT_TILES) > MVT_STAGE ? MVT_PART(MVT_TILES) \
                                                                        : MVT_STAGE];         \
        const Parts pp = PICK_PART(MVT_ROWS);                                                 \
        mvt_chunks<TY, MVT_TILES, false>(smem, 1, MVT_WARPS * 32, MVT_STAGE, pp.w, chunks,   \
                                         n_chunks, X, x_div, pp.y, pp.rows, cols, row_bytes, \
                                         pp.bx);                                              \
    }                                                                                         \
    /* Dynamic shared memory: max(MVT_PART(1), stages * stage_bytes) bytes (the host's). */  \
    extern "C" __global__ void __launch_bounds__(MVT_WARPS * 32)                              \
        mvt1_##name(MV_PARAMS, int stages, int step, int stage_bytes) {                       \
        extern __shared__ __align__(16) u8 dsmem[];                                           \
        const Parts pp = PICK_PART(MVT_ROWS);                                                 \
        mvt_chunks<TY, 1, true>(dsmem, stages, step, stage_bytes, pp.w, chunks, n_chunks, X,  \
                                x_div, pp.y, pp.rows, cols, row_bytes, pp.bx);                \
    }                                                                                         \
    /* The decode kernel again with MVD_WARPS warps a block (each runs MVT_WARPS / MVD_WARPS  \
       chains): the same chains, so the same bits as mvt1_ / mvt_, in smaller blocks (more of \
       them in flight per SM). Dynamic shared memory as mvt1_'s. */                           \
    extern "C" __global__ void __launch_bounds__(MVD_WARPS * 32)                              \
        mvd_##name(MV_PARAMS, int stages, int step, int stage_bytes) {                        \
        extern __shared__ __align__(16) u8 dsmem[];                                           \
        const Parts pp = PICK_PART(MVT_ROWS);                                                 \
        mvt_chunks<TY, 1, true, MVD_WARPS>(dsmem, stages, step, stage_bytes, pp.w, chunks,    \
                                           n_chunks, X, x_div, pp.y, pp.rows, cols,          \
                                           row_bytes, pp.bx);                                 \
    }                                                                                         \
    extern "C" __global__ void embed_##name(const u8* W, long long row_bytes,                \
                                            const int* tokens, float* x, int cols,           \
                                            float scale) {                                   \
        embed_rows<TY>(W, row_bytes, tokens, x, cols, scale);                                \
    }

// The decode form of the Q4_K int8 product (`mvq_q4_k`, chunks of at most MV_MAX_N rows):
// no tensor cores, the same bits as `mvi_*` / `mvi1_*` / `mvid_*`. The block first
// quantizes its chunk's rows of X into shared memory with `quant_x8`'s arithmetic
// (`quant_lane`), so decode launches no `quant_x8`. Half a warp per weight row: lane c of
// the half is chain c, taking the row's 32-column blocks b = c (mod MVT_WARPS) in order
// (the chains of the tensor-core forms); it loads the block's 32 nibbles and its
// super-block's scales from global memory, forms the exact int32 dot with each X row's 32
// quants by dp4a (an integer sum: any order gives the same value, the value the mma
// gives), and adds it with the same two f32 operations; the 16 chains are then added by
// shfl_down in the tensor-core forms' tree (s[w] += s[w + step], steps 1, 2, 4, 8). Rows
// a block: MVQ_ROWS (`mvq_q4_k_q`: 8 lanes a row, twice the rows).
#define MVQ_WARPS 4
#define MVQ_ROWS (MVQ_WARPS * 2)

__device__ __forceinline__ void q4k_block(const u8* __restrict__ row, int b, bool wide, u32* w,
                                          float* dw, float* mw) {
    const u8* sb = row + (b >> 3) * 144;
    const int j = b & 7;
    u32 hd[4];
    const u8* qs = sb + 16 + 32 * (j >> 1);
    u32 q[8];
    if (wide) {
        const uint4 h = *(const uint4*)sb;
        hd[0] = h.x; hd[1] = h.y; hd[2] = h.z; hd[3] = h.w;
        const uint4 a = *(const uint4*)qs, c = *(const uint4*)(qs + 16);
        q[0] = a.x; q[1] = a.y; q[2] = a.z; q[3] = a.w;
        q[4] = c.x; q[5] = c.y; q[6] = c.z; q[7] = c.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) hd[i] = ((const u32*)sb)[i];
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = ((const u32*)qs)[i];
    }
    int sc, m;
    k4_scale_min_words(hd[1], hd[2], hd[3], j, &sc, &m);
    *dw = __fmul_rn(h2f((u16)(hd[0] & 0xFFFF)), (float)sc);
    *mw = __fmul_rn(h2f((u16)(hd[0] >> 16)), (float)m);
    const int shift = (j & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = (q[i] >> shift) & 0x0F0F0F0Fu;
}

// One weight block's dots with the chunk's quantized rows (in shared memory) into acc.
__device__ __forceinline__ void mvq_block(const u8* __restrict__ row, int b, bool wide,
                                          const u8* __restrict__ x0, size_t xs, int count,
                                          float* acc) {
    u32 w[8];
    float dw, mw;
    q4k_block(row, b, wide, w, &dw, &mw);
#pragma unroll
    for (int t = 0; t < MV_MAX_N; t++) {
        if (t < count) {
            const u8* xb = x0 + (size_t)t * xs + (size_t)b * QX_BYTES;
            const uint4 xa = *(const uint4*)xb, xc = *(const uint4*)(xb + 16);
            const float2 ds = *(const float2*)(xb + 32);
            int dot = __dp4a((int)w[0], (int)xa.x, 0);
            dot = __dp4a((int)w[1], (int)xa.y, dot);
            dot = __dp4a((int)w[2], (int)xa.z, dot);
            dot = __dp4a((int)w[3], (int)xa.w, dot);
            dot = __dp4a((int)w[4], (int)xc.x, dot);
            dot = __dp4a((int)w[5], (int)xc.y, dot);
            dot = __dp4a((int)w[6], (int)xc.z, dot);
            dot = __dp4a((int)w[7], (int)xc.w, dot);
            acc[t] = __fmaf_rn(__fmul_rn(dw, ds.x), (float)dot, acc[t]);
            acc[t] = __fmaf_rn(-mw, ds.y, acc[t]);
        }
    }
}

// LPR lanes a weight row: 16 (lane c = chain c) or 8 (lane c the chains c and c + 8, for
// rows of few blocks: the routed down product's 24 leave half of 16 lanes a block short);
// either way chain c takes the blocks c (mod 16) in order and the tree is the same.
template <int LPR>
__device__ __forceinline__ void mvq_q4k_chunks(const u64* __restrict__ wtab,
                                               const Chunk* __restrict__ chunks,
                                               const int* __restrict__ n_chunks,
                                               const float* __restrict__ X, int x_div,
                                               u8* __restrict__ xs_smem,
                                               float* __restrict__ Y, int out_rows, int cols,
                                               long long row_bytes, int bx) {
    static_assert(LPR == 16 || LPR == 8, "lanes a row");
    if ((int)blockIdx.y >= *n_chunks) return;
    const Chunk* c = chunks + blockIdx.y;
    const int count = c->count;
    const int lane = threadIdx.x & 31;
    const int chain = lane & (LPR - 1);
    const int r = bx * (MVQ_WARPS * 32 / LPR) + (threadIdx.x >> 5) * (32 / LPR) + lane / LPR;
    const bool live = r < out_rows;
    const u8* row = (const u8*)wtab[c->unit] + (size_t)(live ? r : 0) * (size_t)row_bytes;
    const bool wide = (((size_t)row | (size_t)row_bytes) & 15) == 0;
    const int nb = cols >> 5;
    const size_t xs = (size_t)nb * QX_BYTES;
    // The chunk's rows of X quantized into shared memory (`quant_x8`'s arithmetic, by
    // `quant_lane`; row t at t * xs): no separate launch, no round trip through global
    // memory. The host gives at least count * xs bytes.
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if ((size_t)count * xs > (size_t)dyn) __trap();
        const int total = count * nb * 4;
        // The loop's bound is the same for a warp's lanes (the xor tree needs them all).
        for (int i = threadIdx.x; i - lane < total; i += MVQ_WARPS * 32) {
            const int blk = i >> 2, sub = i & 3;
            const int t = blk / nb, b = blk - t * nb;
            const bool ok = i < total;
            float x[8];
            quant_load(ok ? X + (size_t)(c->rows[t] / x_div) * cols + 32 * b + 8 * sub : X, ok,
                       x);
            quant_lane(x, ok, sub, xs_smem + (size_t)t * xs + (size_t)b * QX_BYTES);
        }
        __syncthreads();
    }
    float acc[MV_MAX_N], acc2[MV_MAX_N];
#pragma unroll
    for (int t = 0; t < MV_MAX_N; t++) acc[t] = acc2[t] = 0.0f;
    if (LPR == 16) {
#pragma unroll 2
        for (int b = chain; b < nb; b += MVT_WARPS) mvq_block(row, b, wide, xs_smem, xs, count, acc);
    } else {
        for (int b = chain; b < nb; b += MVT_WARPS) {
            mvq_block(row, b, wide, xs_smem, xs, count, acc);
            if (b + 8 < nb) mvq_block(row, b + 8, wide, xs_smem, xs, count, acc2);
        }
    }
#pragma unroll
    for (int t = 0; t < MV_MAX_N; t++) {
        if (t < count) {
            // s[w] += s[w + step], steps 1, 2, 4, 8 (LPR 8: chain w + 8's sums in acc2).
            float v = acc[t];
#pragma unroll
            for (int step = 1; step < LPR; step <<= 1)
                v = __fadd_rn(v, __shfl_down_sync(0xffffffffu, v, step));
            if (LPR == 8) {
                float v2 = acc2[t];
#pragma unroll
                for (int step = 1; step < 8; step <<= 1)
                    v2 = __fadd_rn(v2, __shfl_down_sync(0xffffffffu, v2, step));
                v = __fadd_rn(v, v2);
            }
            if (chain == 0 && live) Y[(size_t)c->rows[t] * out_rows + r] = v;
        }
    }
}

// X: the product's f32 input (not `quant_x8`'s output); dynamic shared memory: the
// launch's most rows a chunk times cols / 32 blocks of QX_BYTES (the host's).
// `mvq_q4_k`: 8 rows a block (16 lanes a row); `mvq_q4_k_q`: 16 (8 lanes a row).
extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32) mvq_q4_k(MV_PARAMS) {
    extern __shared__ __align__(16) u8 dsmem[];
    const Parts pp = PICK_PART(MVQ_ROWS);
    mvq_q4k_chunks<16>(pp.w, chunks, n_chunks, X, x_div, dsmem, pp.y, pp.rows, cols, row_bytes,
                       pp.bx);
}
extern "C" __global__ void __launch_bounds__(MVQ_WARPS * 32) mvq_q4_k_q(MV_PARAMS) {
    extern __shared__ __align__(16) u8 dsmem[];
    const Parts pp = PICK_PART(2 * MVQ_ROWS);
    mvq_q4k_chunks<8>(pp.w, chunks, n_chunks, X, x_div, dsmem, pp.y, pp.rows, cols, row_bytes,
                      pp.bx);
}

// The int8 forms (see mvi_group) of mvt_ / mvt1_ / mvd_: the same parameters, X being
// `quant_x8`'s output for the launch's chunk table.
#define I8_KERNELS(name, TY)                                                                  \
    extern "C" __global__ void __launch_bounds__(MVT_WARPS * 32) mvi_##name(MV_PARAMS) {     \
        __shared__ __align__(16) u8 smem[MVT_PART(MVT_TILES) > MVT_STAGE ? MVT_PART(MVT_TILES) \
                                                                        : MVT_STAGE];         \
        const Parts pp = PICK_PART(MVT_ROWS);                                                 \
        mvt_chunks<TY, MVT_TILES, false, MVT_WARPS, true>(smem, 1, MVT_WARPS * 32, MVT_STAGE, \
                                                          pp.w, chunks, n_chunks, X, x_div,   \
                                                          pp.y, pp.rows, cols, row_bytes,     \
                                                          pp.bx);                             \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MVT_WARPS * 32)                              \
        mvi1_##name(MV_PARAMS, int stages, int step, int stage_bytes) {                       \
        extern __shared__ __align__(16) u8 dsmem[];                                           \
        const Parts pp = PICK_PART(MVT_ROWS);                                                 \
        mvt_chunks<TY, 1, true, MVT_WARPS, true>(dsmem, stages, step, stage_bytes, pp.w,      \
                                                 chunks, n_chunks, X, x_div, pp.y, pp.rows,   \
                                                 cols, row_bytes, pp.bx);                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(MVD_WARPS * 32)                              \
        mvid_##name(MV_PARAMS, int stages, int step, int stage_bytes) {                       \
        extern __shared__ __align__(16) u8 dsmem[];                                           \
        const Parts pp = PICK_PART(MVT_ROWS);                                                 \
        mvt_chunks<TY, 1, true, MVD_WARPS, true>(dsmem, stages, step, stage_bytes, pp.w,      \
                                                 chunks, n_chunks, X, x_div, pp.y, pp.rows,   \
                                                 cols, row_bytes, pp.bx);                     \
    }

I8_KERNELS(q8_0, T_Q8_0)
I8_KERNELS(q4_k, T_Q4_K)

FWD_KERNELS(f32, T_F32)
FWD_KERNELS(f16, T_F16)
FWD_KERNELS(bf16, T_BF16)
FWD_KERNELS(q8_0, T_Q8_0)
FWD_KERNELS(q5_0, T_Q5_0)
FWD_KERNELS(q4_k, T_Q4_K)
FWD_KERNELS(q6_k, T_Q6_K)
FWD_KERNELS(q4_0, T_Q4_0)
FWD_KERNELS(q4_1, T_Q4_1)
FWD_KERNELS(q5_1, T_Q5_1)
FWD_KERNELS(iq4_nl, T_IQ4_NL)
FWD_KERNELS(mxfp4, T_MXFP4)
FWD_KERNELS(q2_k, T_Q2_K)
FWD_KERNELS(q3_k, T_Q3_K)
FWD_KERNELS(q5_k, T_Q5_K)
FWD_KERNELS(iq4_xs, T_IQ4_XS)
FWD_KERNELS(iq2_xxs, T_IQ2_XXS)
FWD_KERNELS(iq2_xs, T_IQ2_XS)
FWD_KERNELS(iq3_xxs, T_IQ3_XXS)

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float part[32];
    __syncthreads();  // part[] may still be read by an earlier call
    v = warp_sum(v);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = v;
    __syncthreads();
    const int nw = blockDim.x >> 5;
    float s = 0.0f;
    for (int i = 0; i < nw; i++) s += part[i];
    return s;
}

// 1 / sqrt(mean(x^2) + eps) of the block's row x[0..n) (every thread gets it; each sums
// its elements i = tid, tid + blockDim, .. in order, then block_sum).
__device__ __forceinline__ float rms_inv(const float* x, int n, float eps) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += x[i] * x[i];
    ss = block_sum(ss);
    return rsqrtf(ss / (float)n + eps);
}

// out[i] = x[src] * rsqrt(mean(x[src]^2) + eps) * w for row i (src = rows ? rows[i] : i; w
// null: unweighted); one block per row.
//
// The row kernels here take restrict pointers (their buffers never overlap) and unroll
// their loops, so the compiler may keep a thread's loads in flight together; each thread
// still adds its elements in the same order. (On the H200 this left residual_norm at
// 8.1 us for a 2048-wide decode row, 8.5 before: its time goes elsewhere, not found yet.)
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x,
                                         const float* __restrict__ w, float* __restrict__ out,
                                         const int* __restrict__ rows, int cols, float eps) {
    const int r = blockIdx.x;
    const float* xr = x + (size_t)(rows ? rows[r] : r) * cols;
    float ss = 0.0f;
#pragma unroll 8
    for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float s = rsqrtf(ss / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        out[(size_t)r * cols + i] = w ? xr[i] * s * w[i] : xr[i] * s;
}

// o[t][i] = sum over slots, in slot order, of wts[t k + s] * d[t k + s][i], plus the shared
// expert's output sh[t][i] when given, times sigmoid(sg[t]) when its gate's logits sg are
// given: the weighted sum of a token's experts (moe_combine, and residual_norm when it
// takes the combine).
__device__ __forceinline__ float combine_at(const float* __restrict__ d,
                                            const float* __restrict__ wts,
                                            const float* __restrict__ sh,
                                            const float* __restrict__ sg, int t, int k, int cols,
                                            int i) {
    float v = 0.0f;
#pragma unroll 8
    for (int s = 0; s < k; s++) v += d[((size_t)t * k + s) * cols + i] * wts[t * k + s];
    if (sh) {
        const float w = sh[(size_t)t * cols + i];
        v = sg ? v + (1.0f / (1.0f + expf(-sg[t]))) * w : v + w;
    }
    return v;
}

// Values a thread of residual_norm keeps in registers (rows of up to RN_REGS * 256).
#define RN_REGS 8

// Residual step of one row (one block per row): x += (post ? rms_norm(o) * post : o),
// then h = rms_norm(x) * next when next is given (the next half-block's input norm).
// With d given, o is first written as the MoE layer's combine of d, wts, sh, sg (k slots;
// what moe_combine computes, the same arithmetic per column), saving that launch: each
// thread writes the columns it reads below, so no barrier is needed.
extern "C" __global__ void residual_norm(float* __restrict__ x, float* __restrict__ o,
                                         const float* __restrict__ post,
                                         const float* __restrict__ next, float* __restrict__ h,
                                         int cols, float eps, const float* __restrict__ d,
                                         const float* __restrict__ wts,
                                         const float* __restrict__ sh,
                                         const float* __restrict__ sg, int k) {
    const size_t base = (size_t)blockIdx.x * cols;
    if (d && (post || cols > RN_REGS * (int)blockDim.x)) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x)
            o[base + i] = combine_at(d, wts, sh, sg, blockIdx.x, k, cols, i);
        d = nullptr;
    }
    float so = 1.0f;
    if (post) {
        float ss = 0.0f;
#pragma unroll 8
        for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += o[base + i] * o[base + i];
        ss = block_sum(ss);
        so = rsqrtf(ss / (float)cols + eps);
    }
    if (cols <= RN_REGS * (int)blockDim.x) {
        // A row of at most RN_REGS values a thread: the same sums in the same order as the
        // loops below, with the row, its combine and the next norm's weights held in
        // registers (the norm weights loaded before the block sum, not after it).
        float xv[RN_REGS], nw[RN_REGS];
        float ss = 0.0f;
#pragma unroll
        for (int u = 0; u < RN_REGS; u++) {
            const int i = threadIdx.x + u * blockDim.x;
            if (i < cols) {
                if (next) nw[u] = next[i];
                float ov;
                if (d) {
                    ov = combine_at(d, wts, sh, sg, blockIdx.x, k, cols, i);
                    o[base + i] = ov;
                } else {
                    ov = o[base + i];
                }
                const float add = post ? ov * so * post[i] : ov;
                const float v = x[base + i] + add;
                x[base + i] = v;
                xv[u] = v;
                ss += v * v;
            }
        }
        if (!next) return;
        ss = block_sum(ss);
        const float s = rsqrtf(ss / (float)cols + eps);
#pragma unroll
        for (int u = 0; u < RN_REGS; u++) {
            const int i = threadIdx.x + u * blockDim.x;
            if (i < cols) h[base + i] = xv[u] * s * nw[u];
        }
        return;
    }
    float ss = 0.0f;
#pragma unroll 8
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float add = post ? o[base + i] * so * post[i] : o[base + i];
        const float v = x[base + i] + add;
        x[base + i] = v;
        ss += v * v;
    }
    if (!next) return;
    ss = block_sum(ss);
    const float s = rsqrtf(ss / (float)cols + eps);
#pragma unroll 8
    for (int i = threadIdx.x; i < cols; i += blockDim.x) h[base + i] = x[base + i] * s * next[i];
}

// Per (token, head) (grid n x (nh + nkv)): optional RMS norm over the head (qn / kn), then
// the NEOX rotation by pos * inv_freq (element i pairs with i + hd/2).
//
// With kc given (the GQA block, fused: no kv_store launch), a key head's block then
// stores its rotated key and the token's value head j to the cache rows pos[t] (kv_f32:
// f32 cache, else f16), as kv_store_rows does: the same values, the same conversion.
extern "C" __global__ void qk_norm_rope(float* q, float* k, const float* qn, const float* kn,
                                        const int* pos, const float* inv_freq, int nh, int nkv,
                                        int hd, float eps, void* kc, void* vc, const float* v,
                                        int kv_f32, int kdim, int vdim) {
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    float* x;
    const float* nw;
    if (h < nh) {
        x = q + ((size_t)t * nh + h) * hd;
        nw = qn;
    } else {
        x = k + ((size_t)t * nkv + (h - nh)) * hd;
        nw = kn;
    }
    float s = 1.0f;
    if (nw) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += x[i] * x[i];
        ss = block_sum(ss);
        s = rsqrtf(ss / (float)hd + eps);
    }
    const int half = hd >> 1;
    const float p = (float)pos[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float a = x[i], b = x[i + half];
        if (nw) {
            a = a * s * nw[i];
            b = b * s * nw[i + half];
        }
        double sn, cs;
        sincos((double)(p * inv_freq[i]), &sn, &cs);
        const float c = (float)cs, sf = (float)sn;
        x[i] = a * c - b * sf;
        x[i + half] = a * sf + b * c;
    }
    if (kc && h >= nh) {
        __syncthreads();  // the head's rotated values, written by other threads, in place
        const int j = h - nh;
        const int hdv = vdim / nkv;
        const size_t p = (size_t)pos[t];
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            const size_t o = p * kdim + (size_t)j * hd + i;
            if (kv_f32) {
                ((float*)kc)[o] = x[i];
            } else {
                ((u16*)kc)[o] = f2h(x[i]);
            }
        }
        const float* vr = v + (size_t)t * vdim + (size_t)j * hdv;
        for (int i = threadIdx.x; i < hdv; i += blockDim.x) {
            const size_t o = p * vdim + (size_t)j * hdv + i;
            if (kv_f32) {
                ((float*)vc)[o] = vr[i];
            } else {
                ((u16*)vc)[o] = f2h(vr[i]);
            }
        }
    }
}

// KV cache elements: f16 (llama.cpp's default cache) or f32 (`--kv-f32`).
__device__ __forceinline__ float kv_load(const u16* p, size_t i) { return h2f(p[i]); }
__device__ __forceinline__ float kv_load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ void kv_put(u16* p, size_t i, float v) { p[i] = f2h(v); }
__device__ __forceinline__ void kv_put(float* p, size_t i, float v) { p[i] = v; }

// Keys and values of n tokens (grid n) into the cache rows pos[t] (read on the device, so
// a captured decode step replays for every position).
template <typename KT>
__device__ __forceinline__ void kv_store_rows(const float* k, const float* v, KT* kc, KT* vc,
                                              const int* pos, int kdim, int vdim) {
    const int t = blockIdx.x;
    const size_t p = (size_t)pos[t];
    for (int i = threadIdx.x; i < kdim; i += blockDim.x)
        kv_put(kc, p * kdim + i, k[(size_t)t * kdim + i]);
    for (int i = threadIdx.x; i < vdim; i += blockDim.x)
        kv_put(vc, p * vdim + i, v[(size_t)t * vdim + i]);
}

#define ATT_THREADS 256
#define ATT_TILE 1024
// Widest key (query) and value rows: absorbed MLA's `[c | k_rope]` keys of 512 + 64 and
// latent values of 512 (GLM-5); values wider than ATT_THREADS take ATT_MAX_V /
// ATT_THREADS output elements a thread.
#define ATT_MAX_D 576
#define ATT_MAX_V 512
#define ATT_V_PER_THREAD (ATT_MAX_V / ATT_THREADS)

// One tile's softmax step of the online attention (`attend`, `dsv4_attention`; every
// thread of the ATT_THREADS block takes part): `tmax` is the largest score this thread
// wrote to the tile's sc[0..tn); the block's largest and the running maximum m give the new
// maximum, each score becomes exp(score - maximum), their block sum is added to the running
// sum l after it is rescaled; returns that rescaling factor (the caller's output sums take
// it too). `red` is shared scratch of ATT_THREADS / 32 values.
__device__ __forceinline__ float tile_softmax(float* sc, int tn, float tmax, float* red,
                                              float& m, float& l) {
    const int tid = threadIdx.x;
    tmax = warp_max(tmax);
    if ((tid & 31) == 0) red[tid >> 5] = tmax;
    __syncthreads();
    float bm = NEG_INF;
    for (int w = 0; w < ATT_THREADS / 32; w++) bm = fmaxf(bm, red[w]);
    const float mn = fmaxf(m, bm);
    float ts = 0.0f;
    for (int j = tid; j < tn; j += ATT_THREADS) {
        const float e = __expf(sc[j] - mn);
        sc[j] = e;
        ts += e;
    }
    __syncthreads();  // red[] reads above are done; sc[] is complete
    ts = warp_sum(ts);
    if ((tid & 31) == 0) red[tid >> 5] = ts;
    __syncthreads();
    float bs = 0.0f;
    for (int w = 0; w < ATT_THREADS / 32; w++) bs += red[w];
    const float corr = (m == NEG_INF) ? 0.0f : __expf(m - mn);
    l = l * corr + bs;
    m = mn;
    return corr;
}

// Query head h of token t (grid n x nh, ATT_THREADS threads): softmax over keys lo..=pos of
// (q . k) * scale, times V; K/V rows [pos][nkv * hd]. Keys go in tiles of ATT_TILE: every
// thread scores its own keys (a whole dot product each, four partial sums, so many rows are
// in flight at once), the tile's maximum and sum are block reductions, then each output
// element is accumulated over the tile's keys by KG key groups (keys j with j % KG == group,
// KG = ATT_THREADS / 128 when hdv <= 128, else 1) whose partial sums are added in group
// order; with KG = 1 a thread takes output elements d0, d0 + ATT_THREADS, ... (one when
// hdv <= ATT_THREADS, computed as before such heads had the second). A running maximum and
// sum carry over between tiles. Nothing depends on how many tokens the launch has, so a
// token's bits do not depend on the chunk it came in.
template <typename KT>
__device__ __forceinline__ void attend(const float* q, const KT* kc, const KT* vc, float* out,
                                       const int* pos, int nh, int nkv, int hd, int hdv,
                                       float scale, int window, const int* sel,
                                       const int* nsel, int top_k) {
    __shared__ float qs[ATT_MAX_D];
    __shared__ float sc[ATT_TILE];
    __shared__ float red[32];
    __shared__ float part[ATT_THREADS];
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int g = h / (nh / nkv);
    const int tid = threadIdx.x;
    const int p = pos[t];
    const int lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
    // The keys: positions lo..=p, or the nsel[t] positions sel[t * top_k ..] (ascending).
    const int* selp = sel ? sel + (size_t)t * top_k : nullptr;
    const int total = sel ? nsel[t] : p + 1 - lo;
    const float* qh = q + ((size_t)t * nh + h) * hd;
    for (int i = tid; i < hd; i += ATT_THREADS) qs[i] = qh[i];
    const size_t kstride = (size_t)nkv * hd, vstride = (size_t)nkv * hdv;
    const KT* kbase = kc + (size_t)g * hd;
    const KT* vbase = vc + (size_t)g * hdv;
    // Output element(s) and key group of this thread.
    const int kg = (hdv <= 128) ? ATT_THREADS / 128 : 1;
    const int grp = (kg > 1) ? tid / 128 : 0;
    const int d0 = (kg > 1) ? tid % 128 : tid;
    const int nv = (kg > 1) ? 1 : (hdv + ATT_THREADS - 1) / ATT_THREADS;
    float acc[ATT_V_PER_THREAD];
#pragma unroll
    for (int u = 0; u < ATT_V_PER_THREAD; u++) acc[u] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    __syncthreads();
    for (int j0 = 0; j0 < total; j0 += ATT_TILE) {
        const int tn = min(ATT_TILE, total - j0);
        float tmax = NEG_INF;
        for (int j = tid; j < tn; j += ATT_THREADS) {
            const int kpos = selp ? selp[j0 + j] : lo + j0 + j;
            const KT* kr = kbase + (size_t)kpos * kstride;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            int i = 0;
            for (; i + 3 < hd; i += 4) {
                s0 += qs[i] * kv_load(kr, i);
                s1 += qs[i + 1] * kv_load(kr, i + 1);
                s2 += qs[i + 2] * kv_load(kr, i + 2);
                s3 += qs[i + 3] * kv_load(kr, i + 3);
            }
            for (; i < hd; i++) s0 += qs[i] * kv_load(kr, i);
            const float d = ((s0 + s1) + (s2 + s3)) * scale;
            sc[j] = d;
            tmax = fmaxf(tmax, d);
        }
        const float corr = tile_softmax(sc, tn, tmax, red, m, l);
#pragma unroll
        for (int u = 0; u < ATT_V_PER_THREAD; u++) {
            if (u >= nv) break;
            const int d = d0 + u * ATT_THREADS;
            float v = 0.0f;
            if (d < hdv && !selp) {
                float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
                const KT* vr = vbase + (size_t)(lo + j0) * vstride + d;
                const size_t st = (size_t)kg * vstride;
                int j = grp;
                for (; j + 3 * kg < tn; j += 4 * kg) {
                    v0 += sc[j] * kv_load(vr, (size_t)j * vstride);
                    v1 += sc[j + kg] * kv_load(vr, (size_t)j * vstride + st);
                    v2 += sc[j + 2 * kg] * kv_load(vr, (size_t)j * vstride + 2 * st);
                    v3 += sc[j + 3 * kg] * kv_load(vr, (size_t)j * vstride + 3 * st);
                }
                for (; j < tn; j += kg) v0 += sc[j] * kv_load(vr, (size_t)j * vstride);
                v = (v0 + v1) + (v2 + v3);
            } else if (d < hdv) {
                // Selected positions: the same sums, each key's row found through selp.
                const KT* vr = vbase + d;
                const int* tj = selp + j0;
                float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
                int j = grp;
                for (; j + 3 * kg < tn; j += 4 * kg) {
                    v0 += sc[j] * kv_load(vr, (size_t)tj[j] * vstride);
                    v1 += sc[j + kg] * kv_load(vr, (size_t)tj[j + kg] * vstride);
                    v2 += sc[j + 2 * kg] * kv_load(vr, (size_t)tj[j + 2 * kg] * vstride);
                    v3 += sc[j + 3 * kg] * kv_load(vr, (size_t)tj[j + 3 * kg] * vstride);
                }
                for (; j < tn; j += kg) v0 += sc[j] * kv_load(vr, (size_t)tj[j] * vstride);
                v = (v0 + v1) + (v2 + v3);
            }
            if (kg > 1) {
                part[tid] = v;
                __syncthreads();
                if (grp == 0) {
                    v = 0.0f;
                    for (int k2 = 0; k2 < kg; k2++) v += part[d0 + 128 * k2];
                }
            }
            acc[u] = acc[u] * corr + v;
        }
        __syncthreads();  // sc[], red[] and part[] are reused by the next tile
    }
    const float inv = (l > 0.0f) ? 1.0f / l : 0.0f;
    float* oh = out + ((size_t)t * nh + h) * hdv;
    if (grp == 0) {
#pragma unroll
        for (int u = 0; u < ATT_V_PER_THREAD; u++) {
            const int d = d0 + u * ATT_THREADS;
            if (u < nv && d < hdv) oh[d] = acc[u] * inv;
        }
    }
}

#define KV_KERNELS(name, KT)                                                                  \
    extern "C" __global__ void kv_store_##name(const float* k, const float* v, KT* kc,        \
                                               KT* vc, const int* pos, int kdim, int vdim) {  \
        kv_store_rows<KT>(k, v, kc, vc, pos, kdim, vdim);                                     \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS)                                        \
        attention_##name(const float* q, const KT* kc, const KT* vc, float* out,              \
                         const int* pos, int nh, int nkv, int hd, int hdv, float scale,       \
                         int window, const int* sel, const int* nsel, int top_k) {            \
        attend<KT>(q, kc, vc, out, pos, nh, nkv, hd, hdv, scale, window, sel, nsel, top_k);   \
    }

KV_KERNELS(f16, u16)
KV_KERNELS(f32, float)

#define ROUTER_MAX 1024

// One warp per token (blockIdx.x): the router's scores of n_expert logits (`score` 0:
// softmax, 1: sigmoid, 2: sqrt(softplus)), the k experts with the largest score + bias[e]
// (bias null: the score alone; ties to the lower index) into ids, their scores into wts,
// renormalised to sum 1 if norm, then times scale (sluice_models::blocks::moe::Router:
// Softmax is score 0 without bias, scale 1; Biased the others; Hash takes its experts from
// `table` by the token ids, see below).
//
// The weights' renormalisation / scale: lane s takes slot s's (k <= 32; lane 0 all of them
// in order otherwise), the same arithmetic. With `chunks` given (one token, k <= 32: a
// decode step's resident experts) the warp also writes moe_chunks' table for its k pairs,
// which the products then read: one chunk a chosen expert, in ascending expert order,
// count 1, row = slot; *n_chunks = k (the experts are distinct: hashed tables are checked).
extern "C" __global__ void topk_route(const float* logits, const float* bias, int n_expert,
                                      int k, int score, int norm, float scale, int* ids,
                                      float* wts, const int* table, const int* tokens,
                                      Chunk* chunks, int* n_chunks) {
    const int t = blockIdx.x;
    const int lane = threadIdx.x;
    const float* l = logits + (size_t)t * n_expert;
    float pr[ROUTER_MAX / 32];
    if (score == 0) {
        float mx = NEG_INF;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX / 32; i++) {
            const int e = lane + 32 * i;
            pr[i] = (e < n_expert) ? l[e] : NEG_INF;
            mx = fmaxf(mx, pr[i]);
        }
        mx = warp_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX / 32; i++) {
            pr[i] = (lane + 32 * i < n_expert) ? expf(pr[i] - mx) : 0.0f;
            sum += pr[i];
        }
        sum = warp_sum(sum);
        const float inv = 1.0f / sum;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX / 32; i++) pr[i] = pr[i] * inv;
    } else {
#pragma unroll
        for (int i = 0; i < ROUTER_MAX / 32; i++) {
            const int e = lane + 32 * i;
            const float x = (e < n_expert) ? l[e] : 0.0f;
            if (score == 1) {
                pr[i] = 1.0f / (1.0f + expf(-x));
            } else {
                pr[i] = sqrtf(x > 20.0f ? x : log1pf(expf(x)));
            }
        }
    }
    // What the choice compares: the score plus the bias; NEG_INF past n_expert and for
    // experts already chosen. A hashed router (table given) takes the token's k experts
    // from table[token * k + slot] instead; either way their scores are the weights.
    float sel[ROUTER_MAX / 32];
#pragma unroll
    for (int i = 0; i < ROUTER_MAX / 32; i++) {
        const int e = lane + 32 * i;
        sel[i] = (e < n_expert) ? (bias ? pr[i] + bias[e] : pr[i]) : NEG_INF;
    }
    float chosen_sum = 0.0f;
    // Lane s keeps slot s's expert and weight when k <= 32 (`lanes`).
    const bool lanes = k <= 32 && (norm || scale != 1.0f);
    int my_id = 0;
    float my_w = 0.0f;
    for (int s = 0; s < k; s++) {
        int bi;
        if (table) {
            bi = table[(size_t)tokens[t] * k + s];
        } else {
            float bv = NEG_INF;
            bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < ROUTER_MAX / 32; i++) {
                if (sel[i] > bv) {
                    bv = sel[i];
                    bi = lane + 32 * i;
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) {
                    bv = ov;
                    bi = oi;
                }
            }
        }
        // The chosen expert's score, from the lane that holds it.
        float mine = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX / 32; i++) {
            if (lane + 32 * i == bi) {
                mine = pr[i];
                sel[i] = NEG_INF;
            }
        }
        const float w = __shfl_sync(0xffffffffu, mine, bi & 31);
        if (lane == 0) {
            ids[t * k + s] = bi;
            if (!lanes) wts[t * k + s] = w;
        }
        if (lane == s) {
            my_id = bi;
            my_w = w;
        }
        chosen_sum += w;
    }
    if (lanes) {
        if (lane < k) {
            float w = my_w;
            if (norm) w = w / chosen_sum;
            if (scale != 1.0f) w = w * scale;
            wts[t * k + lane] = w;
        }
    } else if (lane == 0 && (norm || scale != 1.0f)) {
        for (int s = 0; s < k; s++) {
            float w = wts[t * k + s];
            if (norm) w = w / chosen_sum;
            if (scale != 1.0f) w = w * scale;
            wts[t * k + s] = w;
        }
    }
    if (chunks && k <= 32) {
        // Slot lane's expert's rank among the k chosen (ascending ids).
        int rank = 0;
        for (int j = 0; j < k; j++) {
            const int other = __shfl_sync(0xffffffffu, my_id, j);
            rank += (other < my_id);
        }
        if (lane < k) {
            chunks[rank].unit = my_id;
            chunks[rank].count = 1;
            chunks[rank].rows[0] = lane;
        }
        if (lane == 0) *n_chunks = k;
    }
}

// Group the n_pairs (token, slot) pairs by the expert ids[] names into chunks of up to
// MVG_N pairs, in pair order within an expert, experts in id order. One block of 1024
// threads; chunks[] must hold n_pairs / MVG_N + min(n_expert, n_pairs) entries.
#define CHUNK_IDS_SHARED 8192
extern "C" __global__ void __launch_bounds__(1024)
    moe_chunks(const int* gids, int n_pairs, int n_expert, Chunk* chunks, int* n_chunks) {
    __shared__ int first[ROUTER_MAX + 1];
    __shared__ int sids[CHUNK_IDS_SHARED];
    const int* ids = gids;
    if (n_pairs <= CHUNK_IDS_SHARED) {
        for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) sids[i] = gids[i];
        __syncthreads();
        ids = sids;
    }
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int c = 0;
        for (int i = 0; i < n_pairs; i++) c += (ids[i] == e);
        first[e + 1] = (c + MVG_N - 1) / MVG_N;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        first[0] = 0;
        for (int e = 0; e < n_expert; e++) first[e + 1] += first[e];
        *n_chunks = first[n_expert];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        int ci = first[e], fill = 0;
        for (int i = 0; i < n_pairs; i++) {
            if (ids[i] != e) continue;
            if (fill == 0) chunks[ci].unit = e;
            chunks[ci].rows[fill++] = i;
            if (fill == MVG_N) {
                chunks[ci].count = fill;
                ci++;
                fill = 0;
            }
        }
        if (fill > 0) chunks[ci].count = fill;
    }
}

// g[i] = act(g[i]) * u[i]: act 0 = SiLU, 1 = GELU (tanh form, as sluice_kernels::act), 2 =
// SiLU with the gate clamped above at `limit` and the up value to [-limit, limit]
// (DeepSeek V4's clamped SwiGLU), 3 = sigmoid (QSA's output gate).
extern "C" __global__ void glu_act(float* g, const float* u, long long n, int act,
                                   float limit) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = g[i];
    float a;
    if (act == 2) {
        x = fminf(x, limit);
        a = x / (1.0f + expf(-x));
        g[i] = a * fminf(fmaxf(u[i], -limit), limit);
        return;
    }
    if (act == 0) {
        a = x / (1.0f + expf(-x));
    } else if (act == 3) {
        a = 1.0f / (1.0f + expf(-x));
    } else {
        const float uu = 0.7978846f * (x + 0.044715f * x * x * x);
        a = x / (1.0f + expf(-2.0f * uu));
    }
    g[i] = a * u[i];
}

// o[t] = combine_at(..) of every column (grid n tokens x blocks of the columns).
extern "C" __global__ void moe_combine(const float* __restrict__ d,
                                       const float* __restrict__ wts,
                                       const float* __restrict__ sh,
                                       const float* __restrict__ sg, float* __restrict__ o,
                                       int k, int cols) {
    const int t = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= cols) return;
    o[(size_t)t * cols + i] = combine_at(d, wts, sh, sg, t, k, cols, i);
}

// Absorbed MLA, the latent cache row of each token (grid n): c = rms_norm(kva[t][..kl]) *
// norm, the interleaved-pair RoPE (pairs 2j, 2j + 1 by pos * inv_freq[j]) of the shared
// key kva[t][kl..kl + rope]; k[t] = [c | k_rope] (the key row), v[t] = c (the value row),
// stored to the cache by kv_store (sluice_models::blocks::mla::attention).
extern "C" __global__ void mla_kv_prep(const float* __restrict__ kva,
                                       const float* __restrict__ norm,
                                       const int* __restrict__ pos,
                                       const float* __restrict__ inv_freq,
                                       float* __restrict__ k, float* __restrict__ v, int kl,
                                       int rope, float eps) {
    const int t = blockIdx.x;
    const int row = kl + rope;
    const float* r = kva + (size_t)t * row;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < kl; i += blockDim.x) ss += r[i] * r[i];
    ss = block_sum(ss);
    const float s = rsqrtf(ss / (float)kl + eps);
    for (int i = threadIdx.x; i < kl; i += blockDim.x) {
        const float c = r[i] * s * norm[i];
        k[(size_t)t * row + i] = c;
        v[(size_t)t * kl + i] = c;
    }
    const float p = (float)pos[t];
    for (int j = threadIdx.x; j < (rope >> 1); j += blockDim.x) {
        const float a = r[kl + 2 * j], b = r[kl + 2 * j + 1];
        double sn, cs;
        sincos((double)(p * inv_freq[j]), &sn, &cs);
        const float c = (float)cs, sf = (float)sn;
        k[(size_t)t * row + kl + 2 * j] = a * c - b * sf;
        k[(size_t)t * row + kl + 2 * j + 1] = b * c + a * sf;
    }
}

// Absorbed MLA queries, per (token, head) (grid n x nh): the head's nope part of q
// (`[t][h][nope | rope]`) gathered to qn[t * nh + h] (the rows the k_b product reads).
extern "C" __global__ void mla_q_split(const float* __restrict__ q, float* __restrict__ qn,
                                       int nh, int nope, int rope) {
    const size_t th = (size_t)blockIdx.x * nh + blockIdx.y;
    const float* qh = q + th * (nope + rope);
    for (int i = threadIdx.x; i < nope; i += blockDim.x) qn[th * nope + i] = qh[i];
}

// The attention query of each (token, head) (grid n x nh): [qabs (the k_b product, kl) |
// the interleaved-pair RoPE of q's rope part], `kl + rope` wide.
extern "C" __global__ void mla_q_join(const float* __restrict__ qabs,
                                      const float* __restrict__ q, const int* __restrict__ pos,
                                      const float* __restrict__ inv_freq,
                                      float* __restrict__ qatt, int nh, int nope, int rope,
                                      int kl) {
    const int t = blockIdx.x;
    const size_t th = (size_t)t * nh + blockIdx.y;
    const float* qr = q + th * (nope + rope) + nope;
    float* out = qatt + th * (kl + rope);
    for (int i = threadIdx.x; i < kl; i += blockDim.x) out[i] = qabs[th * kl + i];
    const float p = (float)pos[t];
    for (int j = threadIdx.x; j < (rope >> 1); j += blockDim.x) {
        const float a = qr[2 * j], b = qr[2 * j + 1];
        double sn, cs;
        sincos((double)(p * inv_freq[j]), &sn, &cs);
        const float c = (float)cs, sf = (float)sn;
        out[kl + 2 * j] = a * c - b * sf;
        out[kl + 2 * j + 1] = b * c + a * sf;
    }
}

// ---- DeepSeek V4 (sluice_models::blocks::hyper, blocks::dsv4_attention) ----------------

// Most residual streams of a hyper-connection.
#define HC_MAX 8

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// x[t][i] = e[t] for every stream i < hc (grid n x column blocks): the embedding copied
// into each stream.
extern "C" __global__ void hc_expand(const float* __restrict__ src, float* __restrict__ x,
                                     int e, int hc) {
    const int t = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= e) return;
    const float v = src[(size_t)t * e + j];
    for (int i = 0; i < hc; i++) x[((size_t)t * hc + i) * e + j] = v;
}

// The mix of one token's streams (grid n, at least HC_MAX * HC_MAX threads): m[t] holds
// `nseg` partial projections of its RMS-normalised concatenated streams (`rms_norm_rows`
// without weights, then the hc_*_fn product split into column segments), summed in segment
// order. pre_i = sigmoid(m_i scale[0] + base_i) + eps; h[t] = sum_i pre_i x[t][i] (in stream
// order), then RMS-normed with `norm` unless norm is null (the head's collapse). With `pc`
// (a block, m has (2 + hc) hc values): post_i = 2 sigmoid(m[hc + i] scale[1] + base[hc + i])
// and comb (src * hc + dst) = Sinkhorn of m[2 hc + k] scale[2] + base[2 hc + k] (softmax
// over each row + eps, a column pass, then iters - 1 row and column passes, every
// denominator + eps; a thread per row or column, each sum in index order), stored to
// pc[t] = [post | comb] for hc_post. Without pc, m has hc values.
extern "C" __global__ void hc_pre(const float* __restrict__ m, const float* __restrict__ base,
                                  const float* __restrict__ scale, const float* __restrict__ x,
                                  float* __restrict__ pc, const float* __restrict__ norm,
                                  float* __restrict__ h, int hc, int e, int iters, int nseg,
                                  float eps, float rms_eps) {
    __shared__ float mv[(2 + HC_MAX) * HC_MAX];
    __shared__ float pre[HC_MAX];
    __shared__ float c[HC_MAX * HC_MAX];
    const int t = blockIdx.x;
    const int k = threadIdx.x;
    const int n_out = pc ? (2 + hc) * hc : hc;
    const float* mt = m + (size_t)t * nseg * n_out;
    if (k < n_out) {
        float v = 0.0f;
        for (int s = 0; s < nseg; s++) v += mt[(size_t)s * n_out + k];
        mv[k] = v;
    }
    __syncthreads();
    if (k < hc) pre[k] = sigmoidf_(mv[k] * scale[0] + base[k]) + eps;
    if (pc) {
        float* out = pc + (size_t)t * (hc + hc * hc);
        if (k < hc) out[k] = 2.0f * sigmoidf_(mv[hc + k] * scale[1] + base[hc + k]);
        if (k < hc * hc) c[k] = mv[2 * hc + k] * scale[2] + base[2 * hc + k];
        __syncthreads();
        if (k < hc) {
            float* row = c + k * hc;
            float mx = NEG_INF;
            for (int d = 0; d < hc; d++) mx = fmaxf(mx, row[d]);
            float sum = 0.0f;
            for (int d = 0; d < hc; d++) {
                row[d] = expf(row[d] - mx);
                sum += row[d];
            }
            const float inv = 1.0f / sum;
            for (int d = 0; d < hc; d++) row[d] = row[d] * inv + eps;
        }
        __syncthreads();
        for (int it = 0; it < (iters > 1 ? iters : 1); it++) {
            if (it > 0) {
                if (k < hc) {
                    float* row = c + k * hc;
                    float sum = 0.0f;
                    for (int d = 0; d < hc; d++) sum += row[d];
                    for (int d = 0; d < hc; d++) row[d] /= sum + eps;
                }
                __syncthreads();
            }
            if (k < hc) {
                float sum = 0.0f;
                for (int r = 0; r < hc; r++) sum += c[r * hc + k];
                for (int r = 0; r < hc; r++) c[r * hc + k] /= sum + eps;
            }
            __syncthreads();
        }
        if (k < hc * hc) out[hc + k] = c[k];
    }
    __syncthreads();
    const float* xt = x + (size_t)t * hc * e;
    float* ht = h + (size_t)t * e;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < e; j += blockDim.x) {
        float v = 0.0f;
        for (int i = 0; i < hc; i++) v += pre[i] * xt[(size_t)i * e + j];
        ht[j] = v;
        ss += v * v;
    }
    if (!norm) return;
    ss = block_sum(ss);
    const float s = rsqrtf(ss / (float)e + rms_eps);
    for (int j = threadIdx.x; j < e; j += blockDim.x) ht[j] = ht[j] * s * norm[j];
}

// A block's output y put back into the streams (grid n x column blocks): x[t][dst] =
// post[dst] y[t] + sum_src comb[src][dst] x[t][src] (pc[t] = [post | comb] from hc_pre).
extern "C" __global__ void hc_post(float* __restrict__ x, const float* __restrict__ y,
                                   const float* __restrict__ pc, int hc, int e) {
    const int t = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= e) return;
    const float* p = pc + (size_t)t * (hc + hc * hc);
    float* xt = x + (size_t)t * hc * e;
    float xs[HC_MAX];
    for (int i = 0; i < hc; i++) xs[i] = xt[(size_t)i * e + j];
    const float yv = y[(size_t)t * e + j];
    for (int d = 0; d < hc; d++) {
        float o = p[d] * yv;
        for (int s = 0; s < hc; s++) o += p[hc + s * hc + d] * xs[s];
        xt[(size_t)d * e + j] = o;
    }
}

// Rotate the trailing n_rot dims of a row as interleaved pairs by pos * inv_freq (inverse:
// by -angle), each thread its own pairs.
__device__ __forceinline__ void rope_tail_row(float* r, int hd, int n_rot, float p,
                                              const float* inv_freq, bool inverse) {
    const int off = hd - n_rot;
    for (int j = threadIdx.x; j < (n_rot >> 1); j += blockDim.x) {
        const float a = r[off + 2 * j], b = r[off + 2 * j + 1];
        double sn, cs;
        sincos((double)(p * inv_freq[j]), &sn, &cs);
        const float c = (float)cs;
        const float sf = inverse ? -(float)sn : (float)sn;
        r[off + 2 * j] = a * c - b * sf;
        r[off + 2 * j + 1] = b * c + a * sf;
    }
}

// Per (token, head) of x (grid n x n_heads, rows [t][head][hd]): flags & 1: an unweighted
// RMS norm over the head; then the interleaved RoPE of its trailing n_rot dims at pos[t]
// (flags & 2: the inverse rotation, the attention output's de-rotation; flags & 4: its
// FIRST n_rot dims instead, GLM's DSA indexer queries).
extern "C" __global__ void dsv4_heads(float* __restrict__ x, const int* __restrict__ pos,
                                      const float* __restrict__ inv_freq, int n_heads, int hd,
                                      int n_rot, int flags, float eps) {
    float* r = x + ((size_t)blockIdx.x * n_heads + blockIdx.y) * hd;
    if (flags & 1) {
        const float s = rms_inv(r, hd, eps);
        for (int i = threadIdx.x; i < hd; i += blockDim.x) r[i] = r[i] * s;
        __syncthreads();
    }
    rope_tail_row((flags & 4) ? r - (hd - n_rot) : r, hd, n_rot, (float)pos[blockIdx.x],
                  inv_freq, (flags & 2) != 0);
}

// GLM's DSA indexer key of each token (grid n): LayerNorm (mean, variance over d) with
// weight and bias, the interleaved RoPE of its FIRST n_rot dims at pos[t], stored (f32) to
// keys[pos[t]] (sluice_models::blocks::dsa_indexer::select).
extern "C" __global__ void dsa_key_prep(const float* __restrict__ ik,
                                        const float* __restrict__ w,
                                        const float* __restrict__ b,
                                        const int* __restrict__ pos,
                                        const float* __restrict__ inv_freq,
                                        float* __restrict__ keys, int d, int n_rot, float eps) {
    const int t = blockIdx.x;
    const float* r = ik + (size_t)t * d;
    float* out = keys + (size_t)pos[t] * d;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) sum += r[i];
    const float mean = block_sum(sum) / (float)d;
    float var = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) var += (r[i] - mean) * (r[i] - mean);
    const float inv = rsqrtf(block_sum(var) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = (r[i] - mean) * inv * w[i] + b[i];
    __syncthreads();
    rope_tail_row(out - (d - n_rot), d, n_rot, (float)pos[t], inv_freq, false);
}

// The shared key/value row of each token (grid n, in place): RMS norm with `norm`, the
// interleaved RoPE of the trailing n_rot dims, then f16 rounding when `round` (the cache
// type's precision; the rows stay f32).
extern "C" __global__ void dsv4_kv_prep(float* __restrict__ kv, const float* __restrict__ norm,
                                        const int* __restrict__ pos,
                                        const float* __restrict__ inv_freq, int hd, int n_rot,
                                        int round, float eps) {
    float* r = kv + (size_t)blockIdx.x * hd;
    const float s = rms_inv(r, hd, eps);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) r[i] = r[i] * s * norm[i];
    __syncthreads();
    rope_tail_row(r, hd, n_rot, (float)pos[blockIdx.x], inv_freq, false);
    if (!round) return;
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) r[i] = h2f(f2h(r[i]));
}

// Most values of one compressed row a thread keeps (hd <= 2 * DSV4_PAIRS * 256).
#define DSV4_PAIRS 2

// A KV compressor's rows (grid n, 256 threads): token t at position p = pos[t] ends a block
// when (p + 1) % ratio == 0; then the row (p + 1) / ratio - 1 of `rows` is, per column j,
// the softmax over the pooled entries of (z + ape[q % ratio]) times c: for coff 2 the
// previous block's positions at column j (from the second block on), then this block's at
// column hd + j; for coff 1 this block's at j. An entry at q comes from the batch
// (c[q - pos0]) or, before it, from the carry ring (rc[q % (coff ratio)]). The row is then
// RMS-normed with `norm`, its trailing n_rot dims roped at the block start, rounded to f16
// when `round` (sluice_models::blocks::dsv4_attention::compress_step).
extern "C" __global__ void __launch_bounds__(256)
    dsv4_compress(const float* __restrict__ c, const float* __restrict__ z,
                  const float* __restrict__ rc, const float* __restrict__ rz,
                  const float* __restrict__ ape, const float* __restrict__ norm,
                  const int* __restrict__ pos, const float* __restrict__ inv_freq,
                  float* __restrict__ rows, int ratio, int hd, int coff, int n_rot, int round,
                  float eps) {
    const int t = blockIdx.x;
    const int p = pos[t];
    if ((p + 1) % ratio != 0) return;
    const int pos0 = pos[0];
    const int width = coff * hd, slots = coff * ratio;
    const int start = p + 1 - ratio;
    const int n_prev = (coff == 2 && start >= ratio) ? ratio : 0;
    const int cur_off = (coff == 2) ? hd : 0;
    float* out = rows + (size_t)((p + 1) / ratio - 1) * hd;
    float v[2 * DSV4_PAIRS];
    float ss = 0.0f;
#pragma unroll
    for (int u = 0; u < DSV4_PAIRS; u++) {
        for (int w = 0; w < 2; w++) {
            const int j = 2 * (threadIdx.x + u * 256) + w;
            float acc = 0.0f;
            if (j < hd) {
                // Entry e: q = start - ratio + e (previous block) or start + e - n_prev.
                float mx = NEG_INF;
                for (int en = 0; en < n_prev + ratio; en++) {
                    const int q = (en < n_prev) ? start - ratio + en : start + en - n_prev;
                    const int col = ((en < n_prev) ? 0 : cur_off) + j;
                    const float zz = (q >= pos0 ? z[(size_t)(q - pos0) * width + col]
                                                : rz[(size_t)(q % slots) * width + col]) +
                                     ape[(size_t)(q % ratio) * width + col];
                    mx = fmaxf(mx, zz);
                }
                float sum = 0.0f;
                for (int en = 0; en < n_prev + ratio; en++) {
                    const int q = (en < n_prev) ? start - ratio + en : start + en - n_prev;
                    const int col = ((en < n_prev) ? 0 : cur_off) + j;
                    const float zz = (q >= pos0 ? z[(size_t)(q - pos0) * width + col]
                                                : rz[(size_t)(q % slots) * width + col]) +
                                     ape[(size_t)(q % ratio) * width + col];
                    sum += expf(zz - mx);
                }
                const float inv = 1.0f / sum;
                for (int en = 0; en < n_prev + ratio; en++) {
                    const int q = (en < n_prev) ? start - ratio + en : start + en - n_prev;
                    const int col = ((en < n_prev) ? 0 : cur_off) + j;
                    const bool in_batch = q >= pos0;
                    const float zz = (in_batch ? z[(size_t)(q - pos0) * width + col]
                                               : rz[(size_t)(q % slots) * width + col]) +
                                     ape[(size_t)(q % ratio) * width + col];
                    const float cv = in_batch ? c[(size_t)(q - pos0) * width + col]
                                              : rc[(size_t)(q % slots) * width + col];
                    acc += (expf(zz - mx) * inv) * cv;
                }
            }
            v[2 * u + w] = acc;
            ss += acc * acc;
        }
    }
    ss = block_sum(ss);
    const float s = rsqrtf(ss / (float)hd + eps);
    const int off = hd - n_rot;
    double sn, cs;
#pragma unroll
    for (int u = 0; u < DSV4_PAIRS; u++) {
        const int j = 2 * (threadIdx.x + u * 256);
        if (j >= hd) continue;
        float a = v[2 * u] * s * norm[j], b = v[2 * u + 1] * s * norm[j + 1];
        if (j >= off) {
            sincos((double)((float)start * inv_freq[(j - off) >> 1]), &sn, &cs);
            const float co = (float)cs, si = (float)sn;
            const float a2 = a * co - b * si;
            b = b * co + a * si;
            a = a2;
        }
        if (round) {
            a = h2f(f2h(a));
            b = h2f(f2h(b));
        }
        out[j] = a;
        out[j + 1] = b;
    }
}

// A per-sequence ring of the last `slots` positions (DeepSeek V4's window and compressor
// carries, the DeltaNet / KDA / PLE convolution histories; grid n x column blocks): row t of
// c (and z, when given) to slot pos[t] % slots of rc (rz), for t >= n - slots. Queued after
// every kernel that reads the ring for this batch.
extern "C" __global__ void ring_store(const float* __restrict__ c, const float* __restrict__ z,
                                      float* __restrict__ rc, float* __restrict__ rz,
                                      const int* __restrict__ pos, int width, int slots, int n) {
    const int t = blockIdx.x;
    if (t < n - slots) return;
    const size_t s = (size_t)(pos[t] % slots) * width;
    for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < width; i += gridDim.y * blockDim.x) {
        rc[s + i] = c[(size_t)t * width + i];
        if (z) rz[s + i] = z[(size_t)t * width + i];
    }
}

// Most indexer query values (heads x head size) one block keeps in shared memory.
#define IDX_MAX_Q 8192

// The lightning indexer's score of every compressed row each token sees (grid n x blocks,
// a warp per row, rows strided over the grid): row r < (p + 1) / ratio of `rows`, score =
// sum over heads h, in order, of (max(q_h . k_r, 0) / sqrt(ihd)) * (w_h / sqrt(n_head));
// into scores[t * stride + r]. Without head weights (wh null, QSA's indexer): (sum over
// heads of max(q_h . k_r, 0)) / sqrt(ihd).
extern "C" __global__ void __launch_bounds__(256)
    dsv4_index_scores(const float* __restrict__ iq, const float* __restrict__ wh,
                      const float* __restrict__ rows, const int* __restrict__ pos,
                      float* __restrict__ scores, int n_head, int ihd, int ratio, int stride) {
    __shared__ float qs[IDX_MAX_Q];
    const int t = blockIdx.x;
    const int n_rows = (pos[t] + 1) / ratio;
    const int qn = n_head * ihd;
    for (int i = threadIdx.x; i < qn; i += blockDim.x) qs[i] = iq[(size_t)t * qn + i];
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    const float ks = 1.0f / sqrtf((float)ihd), ws = 1.0f / sqrtf((float)n_head);
    for (int r = blockIdx.y * warps + (threadIdx.x >> 5); r < n_rows; r += gridDim.y * warps) {
        const float* k = rows + (size_t)r * ihd;
        float acc = 0.0f;
        for (int h = 0; h < n_head; h++) {
            float d = 0.0f;
            for (int i = lane; i < ihd; i += 32) d += qs[h * ihd + i] * k[i];
            d = warp_sum(d);
            acc += wh ? (fmaxf(d, 0.0f) * ks) * (wh[(size_t)t * n_head + h] * ws) : fmaxf(d, 0.0f);
        }
        if (lane == 0) scores[(size_t)t * stride + r] = wh ? acc : acc * ks;
    }
}

// A float's bits as an unsigned key in f32::total_cmp order.
__device__ __forceinline__ unsigned ordered_key(float f) {
    const unsigned b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

#define TOPK_THREADS 256

// Exclusive prefix sum of v over the block (TOPK_THREADS threads); *total gets the sum.
__device__ __forceinline__ int block_scan(int v, int* total) {
    __shared__ int ws[TOPK_THREADS / 32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) ws[w] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int i = 0; i < TOPK_THREADS / 32; i++) {
        if (i < w) before += ws[i];
        all += ws[i];
    }
    *total = all;
    return before + x - v;
}

// The compressed rows each token's attention reads (grid n, TOPK_THREADS threads): of the n =
// (p + 1) / ratio rows it sees, all when n <= k, else the k with the largest scores (ties to
// the lower index, sluice_models::ops::top_k), in ascending row order, into sel[t * k ..],
// their count into nsel[t]. The k-th largest key is found by a radix select over the
// scores' ordered bits, 8 at a time.
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    dsv4_topk(const float* __restrict__ scores, const int* __restrict__ pos,
              int* __restrict__ sel, int* __restrict__ nsel, int ratio, int stride, int k) {
    __shared__ int hist[256];
    __shared__ unsigned s_prefix;
    __shared__ int s_need;
    const int t = blockIdx.x;
    const int n = (pos[t] + 1) / ratio;
    int* out = sel + (size_t)t * k;
    if (n <= k) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = i;
        if (threadIdx.x == 0) nsel[t] = n;
        return;
    }
    const float* sc = scores + (size_t)t * stride;
    // The k-th largest key: fixed from the top byte down; `need` = how many of the keys
    // with the prefix fixed so far still belong to the top k.
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_need = k;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        const unsigned prefix = s_prefix;
        const unsigned hi_mask = (shift == 24) ? 0u : (0xffffffffu << (shift + 8));
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned key = ordered_key(sc[i]);
            if ((key & hi_mask) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int need = s_need;
            int b = 255;
            for (; b > 0; b--) {
                if (hist[b] >= need) break;
                need -= hist[b];
            }
            s_prefix = prefix | ((unsigned)b << shift);
            s_need = need;
        }
        __syncthreads();
    }
    const unsigned kth = s_prefix;
    const int ties = s_need;  // keys equal to kth that are taken, lowest indices first
    int eq_before = 0, out_before = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        const unsigned key = (i < n) ? ordered_key(sc[i]) : 0u;
        const int gt = (i < n) && key > kth;
        const int eq = (i < n) && key == kth;
        int eq_total, out_total;
        const int eq_rank = eq_before + block_scan(eq, &eq_total);
        const int take = gt || (eq && eq_rank < ties);
        const int at = out_before + block_scan(take, &out_total);
        if (take) out[at] = i;
        eq_before += eq_total;
        out_before += out_total;
    }
    if (threadIdx.x == 0) nsel[t] = k;
}

// DeepSeek V4 attention of query head h of token t (grid n x nh, ATT_THREADS threads): the
// keys are the raw rows of positions lo..=p (lo = p + 1 - window, at least 0: rows at or
// past the batch's first position from `kb`, the batch's own prepared rows, earlier ones
// from the ring `ring[q % window]`), then the compressed rows it sees (ratio 0: none; `sel`
// given: nsel[t] rows sel[t * top_k + i]; else rows 0 .. (p + 1) / ratio). Softmax of
// (q . k) * scale with the head's sink as one more logit (whose value is 0), times the
// keys (K = V); online over tiles of keys like `attend`.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
    dsv4_attention(const float* __restrict__ q, const float* __restrict__ kb,
                   const float* __restrict__ ring, const float* __restrict__ rows,
                   const int* __restrict__ sel, const int* __restrict__ nsel,
                   const float* __restrict__ sinks, float* __restrict__ out,
                   const int* __restrict__ pos, int nh, int hd, int window, int ratio,
                   int top_k, float scale) {
    __shared__ float qs[ATT_MAX_D];
    __shared__ float sc[ATT_TILE];
    __shared__ const float* kp[ATT_TILE];
    __shared__ float red[32];
    const int t = blockIdx.x;
    const int h = blockIdx.y;
    const int tid = threadIdx.x;
    const int p = pos[t], pos0 = pos[0];
    const int lo = (p + 1 > window) ? p + 1 - window : 0;
    const int nw = p + 1 - lo;
    const int nc = (ratio == 0) ? 0 : (sel ? nsel[t] : (p + 1) / ratio);
    const int total = nw + nc;
    const float* qh = q + ((size_t)t * nh + h) * hd;
    for (int i = tid; i < hd; i += ATT_THREADS) qs[i] = qh[i];
    const int nv = (hd + ATT_THREADS - 1) / ATT_THREADS;
    float acc[ATT_V_PER_THREAD];
#pragma unroll
    for (int u = 0; u < ATT_V_PER_THREAD; u++) acc[u] = 0.0f;
    // The sink: a logit whose value row is 0.
    float m = sinks[h], l = 1.0f;
    __syncthreads();
    for (int j0 = 0; j0 < total; j0 += ATT_TILE) {
        const int tn = min(ATT_TILE, total - j0);
        float tmax = NEG_INF;
        // Key pointers first, then a warp per key: lanes take dims lane, lane + 32, ...
        // (coalesced), four partial sums, a warp sum.
        for (int j = tid; j < tn; j += ATT_THREADS) {
            const int jj = j0 + j;
            const float* kr;
            if (jj < nw) {
                const int qp = lo + jj;
                kr = (qp >= pos0) ? kb + (size_t)(qp - pos0) * hd
                                  : ring + (size_t)(qp % window) * hd;
            } else {
                const int r = sel ? sel[(size_t)t * top_k + (jj - nw)] : jj - nw;
                kr = rows + (size_t)r * hd;
            }
            kp[j] = kr;
        }
        __syncthreads();
        const int lane = tid & 31;
        for (int j = tid >> 5; j < tn; j += ATT_THREADS / 32) {
            const float* kr = kp[j];
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            int i = lane;
            for (; i + 96 < hd; i += 128) {
                s0 += qs[i] * kr[i];
                s1 += qs[i + 32] * kr[i + 32];
                s2 += qs[i + 64] * kr[i + 64];
                s3 += qs[i + 96] * kr[i + 96];
            }
            for (; i < hd; i += 32) s0 += qs[i] * kr[i];
            const float d = warp_sum((s0 + s1) + (s2 + s3)) * scale;
            if (lane == 0) sc[j] = d;
            tmax = fmaxf(tmax, d);
        }
        const float corr = tile_softmax(sc, tn, tmax, red, m, l);
#pragma unroll
        for (int u = 0; u < ATT_V_PER_THREAD; u++) {
            if (u >= nv) break;
            const int d = tid + u * ATT_THREADS;
            float v = 0.0f;
            if (d < hd) {
                float v0 = 0.0f, v1 = 0.0f, v2 = 0.0f, v3 = 0.0f;
                int j = 0;
                for (; j + 3 < tn; j += 4) {
                    v0 += sc[j] * kp[j][d];
                    v1 += sc[j + 1] * kp[j + 1][d];
                    v2 += sc[j + 2] * kp[j + 2][d];
                    v3 += sc[j + 3] * kp[j + 3][d];
                }
                for (; j < tn; j++) v0 += sc[j] * kp[j][d];
                v = (v0 + v1) + (v2 + v3);
            }
            acc[u] = acc[u] * corr + v;
        }
        __syncthreads();
    }
    const float inv = 1.0f / l;
    float* oh = out + ((size_t)t * nh + h) * hd;
#pragma unroll
    for (int u = 0; u < ATT_V_PER_THREAD; u++) {
        const int d = tid + u * ATT_THREADS;
        if (u < nv && d < hd) oh[d] = acc[u] * inv;
    }
}
