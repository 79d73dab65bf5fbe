// sluice CUDA kernels, compiled by NVRTC at start-up (no headers: NVRTC finds none).
//
// Owns: dequantization of 8 consecutive weights of one row (`deq8`, per format, the same
// block layouts as crates/kernels/src/reference.rs: ggml's, byte for byte) and two
// products over it, both computing Y[t, r] = sum_c W[r, c] * X[t, c] in f32:
// - `mv_*`: one warp per row, MV_MAX_N tokens per blockIdx.z, every job of a call (table
//   of MvJob, blockIdx.y) in one launch: the same bits for a token whatever the batch (the
//   default for every n);
// - `mm_*`: 64 rows x 64 tokens per block of 256 threads, K in steps of 32 (prefill; its
//   summation order differs from mv's, so only used when asked: SLUICE_CUDA_TILED=1).
// Activations stay f32 (the CPU path quantizes them to Q8 blocks), so results differ
// from the CPU's by rounding only. Weights are read byte-wise: a row of Q8_0/Q5_0/Q6_K
// blocks has no alignment beyond 2 bytes.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#define MV_MAX_N 8

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf2f(u16 h) { return __int_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

// Format ids (template arguments).
#define T_F32 0
#define T_F16 1
#define T_BF16 2
#define T_Q8_0 3
#define T_Q5_0 4
#define T_Q4_K 5
#define T_Q6_K 6

// Elements 8p .. 8p+7 of the row at `row`, as f32.
template <int TY>
__device__ __forceinline__ void deq8(const u8* __restrict__ row, int p, float* out) {
    if (TY == T_F32) {
        const float* r = (const float*)row + 8 * p;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = r[i];
    } else if (TY == T_F16) {
        const u16* r = (const u16*)row + 8 * p;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = h2f(r[i]);
    } else if (TY == T_BF16) {
        const u16* r = (const u16*)row + 8 * p;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = bf2f(r[i]);
    } else if (TY == T_Q8_0) {
        // { f16 d; i8 qs[32] }, 34 bytes.
        const u8* b = row + (p >> 2) * 34;
        const float d = h2f(ld16(b));
        const u8* q = b + 2 + (p & 3) * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = d * (float)(i8)q[i];
    } else if (TY == T_Q5_0) {
        // { f16 d; u8 qh[4]; u8 qs[16] }, 22 bytes; element j < 16: low nibble of qs[j],
        // high bit qh bit j; j >= 16: high nibble of qs[j - 16], high bit qh bit j.
        const u8* b = row + (p >> 2) * 22;
        const float d = h2f(ld16(b));
        const u32 qh = (u32)b[2] | ((u32)b[3] << 8) | ((u32)b[4] << 16) | ((u32)b[5] << 24);
        const u8* qs = b + 6;
        const int j0 = (p & 3) * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = j0 + i;
            int q;
            if (j < 16) {
                q = (qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10);
            } else {
                q = (qs[j - 16] >> 4) | ((qh >> (j - 4)) & 0x10);
            }
            out[i] = d * (float)(q - 16);
        }
    } else if (TY == T_Q4_K) {
        // { f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }, 144 bytes, 256 elements.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 144;
        const int j = (e0 & 255) >> 5;  // sub-block of 32
        const int l0 = e0 & 31;
        const float d = h2f(ld16(b));
        const float dmin = h2f(ld16(b + 2));
        const u8* s = b + 4;
        int sc, m;
        if (j < 4) {
            sc = s[j] & 63;
            m = s[j + 4] & 63;
        } else {
            sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        const float d1 = d * (float)sc;
        const float m1 = dmin * (float)m;
        const u8* qs = b + 16 + 32 * (j >> 1);
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = d1 * (float)((qs[l0 + i] >> shift) & 0x0F) - m1;
    } else if (TY == T_Q6_K) {
        // { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }, 210 bytes, 256 elements in two
        // halves of 128; quarter k of a half takes ql[l + 32 (k & 1)] nibble (k >> 1) and
        // qh[l] bits 2k..2k+1.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 210;
        const int i0 = e0 & 255;
        const int h = i0 >> 7;
        const int k = (i0 & 127) >> 5;
        const int l0 = i0 & 31;
        const float d = h2f(ld16(b + 208));
        const float ds = d * (float)(i8)b[192 + (i0 >> 4)];
        const u8* ql = b + 64 * h + 32 * (k & 1);
        const u8* qh = b + 128 + 32 * h;
        const int lshift = (k >> 1) * 4;
        const int hshift = 2 * k;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int l = l0 + i;
            const int q = ((ql[l] >> lshift) & 0x0F) | (((qh[l] >> hshift) & 3) << 4);
            out[i] = ds * (float)(q - 32);
        }
    }
}

// One product of a grouped matvec launch (48 bytes; the host writes the same layout).
struct MvJob {
    const u8* W;
    const float* X;
    float* Y;
    long long row_bytes;
    int rows;
    int cols;
    int n;
    int pad;
};

// One warp per row; lanes stride over the row's groups of 8 elements.
template <int TY>
__device__ __forceinline__ void matvec(const u8* __restrict__ W, const float* __restrict__ X,
                                       float* __restrict__ Y, int rows, int cols,
                                       long long row_bytes, int n, int tgroup) {
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (warp >= rows) return;
    // tgroup picks a group of MV_MAX_N tokens: every token gets the same arithmetic
    // whatever n is, so results do not depend on how a prompt is chunked.
    const int tbase = tgroup * MV_MAX_N;
    if (tbase >= n) return;
    X += (size_t)tbase * cols;
    Y += (size_t)tbase * rows;
    n = (n - tbase < MV_MAX_N) ? n - tbase : MV_MAX_N;
    const u8* row = W + (size_t)warp * (size_t)row_bytes;
    const int parts = cols >> 3;
    float acc[MV_MAX_N];
#pragma unroll
    for (int t = 0; t < MV_MAX_N; t++) acc[t] = 0.0f;
    for (int p = lane; p < parts; p += 32) {
        float w[8];
        deq8<TY>(row, p, w);
#pragma unroll
        for (int t = 0; t < MV_MAX_N; t++) {
            if (t < n) {
                const float4* x = (const float4*)(X + (size_t)t * cols + 8 * p);
                const float4 a = x[0];
                const float4 c = x[1];
                acc[t] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * c.x +
                          w[5] * c.y + w[6] * c.z + w[7] * c.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MV_MAX_N; t++) {
        if (t < n) {
            float v = acc[t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) Y[(size_t)t * rows + warp] = v;
        }
    }
}

// Tiled product: block (64 rows, 64 tokens), 256 threads, each 4 rows x 4 tokens; the W
// tile is dequantized into shared memory as f32, 32 columns at a time.
template <int TY>
__device__ __forceinline__ void matmul(const u8* __restrict__ W, const float* __restrict__ X,
                                       float* __restrict__ Y, int rows, int cols,
                                       long long row_bytes, int n) {
    __shared__ float Ws[32][65];
    __shared__ float Xs[32][65];
    const int r0 = blockIdx.x * 64;
    const int t0 = blockIdx.y * 64;
    const int tid = threadIdx.x;
    const int tr = tid & 15;
    const int tt = tid >> 4;
    const int lr = tid >> 2;  // loader's row / token
    const int lp = tid & 3;   // loader's group of 8 columns
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < cols; k0 += 32) {
        float w[8];
        if (r0 + lr < rows) {
            deq8<TY>(W + (size_t)(r0 + lr) * (size_t)row_bytes, (k0 >> 3) + lp, w);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] = 0.0f;
        }
#pragma unroll
        for (int i = 0; i < 8; i++) Ws[lp * 8 + i][lr] = w[i];
        if (t0 + lr < n) {
            const float4* x = (const float4*)(X + (size_t)(t0 + lr) * cols + k0 + lp * 8);
            const float4 a = x[0];
            const float4 c = x[1];
            Xs[lp * 8 + 0][lr] = a.x;
            Xs[lp * 8 + 1][lr] = a.y;
            Xs[lp * 8 + 2][lr] = a.z;
            Xs[lp * 8 + 3][lr] = a.w;
            Xs[lp * 8 + 4][lr] = c.x;
            Xs[lp * 8 + 5][lr] = c.y;
            Xs[lp * 8 + 6][lr] = c.z;
            Xs[lp * 8 + 7][lr] = c.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) Xs[lp * 8 + i][lr] = 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < 32; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = Ws[k][tr + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = Xs[k][tt + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int t = t0 + tt + 16 * j;
        if (t < n) {
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int r = r0 + tr + 16 * i;
                if (r < rows) Y[(size_t)t * rows + r] = acc[i][j];
            }
        }
    }
}

// mv_*: every product of a call in one launch: blockIdx.y = job, blockIdx.z = token group.
#define KERNELS(name, TY)                                                                     \
    extern "C" __global__ void mv_##name(const MvJob* jobs) {                                 \
        const MvJob j = jobs[blockIdx.y];                                                     \
        matvec<TY>(j.W, j.X, j.Y, j.rows, j.cols, j.row_bytes, j.n, blockIdx.z);              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) mm_##name(                             \
        const u8* W, const float* X, float* Y, int rows, int cols, long long row_bytes, int n) { \
        matmul<TY>(W, X, Y, rows, cols, row_bytes, n);                                        \
    }

KERNELS(f32, T_F32)
KERNELS(f16, T_F16)
KERNELS(bf16, T_BF16)
KERNELS(q8_0, T_Q8_0)
KERNELS(q5_0, T_Q5_0)
KERNELS(q4_k, T_Q4_K)
KERNELS(q6_k, T_Q6_K)
