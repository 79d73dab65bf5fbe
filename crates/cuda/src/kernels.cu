// sluice CUDA kernels, compiled by NVRTC at start-up (no headers: NVRTC finds none). The
// lookup tables (iq2xxs_grid, ksigns_iq2xs, kvalues_*, ...) are written in front of this
// source by lib.rs from sluice_kernels' own tables (`kernel_source`).
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
typedef unsigned long long u64;

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
#define T_Q4_0 7
#define T_Q4_1 8
#define T_Q5_1 9
#define T_IQ4_NL 10
#define T_MXFP4 11
#define T_Q2_K 12
#define T_Q3_K 13
#define T_Q5_K 14
#define T_IQ4_XS 15
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18

// Nibble j (0..31) of a 32-element block's 16 packed bytes: low nibbles first.
__device__ __forceinline__ int nib32(const u8* qs, int j) {
    return (j < 16) ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The same, from the block's three little-endian scale words (bytes 4..16 of the block as
// u32): the word form of the aligned paths, the same integers as `k4_scale_min`.
__device__ __forceinline__ void k4_scale_min_words(u32 s0, u32 s1, u32 s2, int j, int* sc,
                                                   int* m) {
    const int sh = 8 * (j & 3);
    const u32 w0 = (s0 >> sh) & 0xFF, w1 = (s1 >> sh) & 0xFF;
    if (j < 4) {
        *sc = (int)(w0 & 63);
        *m = (int)(w1 & 63);
    } else {
        const u32 w2 = (s2 >> sh) & 0xFF;
        *sc = (int)((w2 & 0x0F) | ((w0 >> 6) << 4));
        *m = (int)((w2 >> 4) | ((w1 >> 6) << 4));
    }
}

// Eight grid magnitudes `g` (bytes of a u64) with the signs of `signs` (bit i: negative).
__device__ __forceinline__ void signed8(u64 g, int signs, float scale, float* out) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float v = (float)((g >> (8 * i)) & 0xFF);
        out[i] = scale * (((signs >> i) & 1) ? -v : v);
    }
}

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
        if ((((size_t)b) & 7) == 0) {
            // An 8-byte aligned block (always, for rows in VRAM or staged): words instead of
            // bytes, the same values and the same arithmetic as the byte path below.
            const u32 dm = *(const u32*)b;
            const float d = h2f((u16)(dm & 0xFFFF));
            const float dmin = h2f((u16)(dm >> 16));
            const u32* sw = (const u32*)(b + 4);
            int sc, m;
            k4_scale_min_words(sw[0], sw[1], sw[2], j, &sc, &m);
            const float d1 = d * (float)sc;
            const float m1 = dmin * (float)m;
            const uint2 qw = *(const uint2*)(b + 16 + 32 * (j >> 1) + l0);
            const int shift = (j & 1) * 4;
            const u32 lo = (qw.x >> shift) & 0x0F0F0F0Fu, hi = (qw.y >> shift) & 0x0F0F0F0Fu;
            // Nibble q as a float: the bits 0x4B0000qq are 2^23 + q (exact).
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float qa = __int_as_float(__byte_perm(lo, 0x4B, 0x4550 + i)) - 8388608.0f;
                const float qb = __int_as_float(__byte_perm(hi, 0x4B, 0x4550 + i)) - 8388608.0f;
                out[i] = d1 * qa - m1;
                out[4 + i] = d1 * qb - m1;
            }
            return;
        }
        const float d = h2f(ld16(b));
        const float dmin = h2f(ld16(b + 2));
        int sc, m;
        k4_scale_min(b + 4, j, &sc, &m);
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
    } else if (TY == T_Q4_0 || TY == T_IQ4_NL) {
        // { f16 d; u8 qs[16] }, 18 bytes: d * (q - 8), or d * kvalues_iq4nl[q].
        const u8* b = row + (p >> 2) * 18;
        const float d = h2f(ld16(b));
        const int j0 = (p & 3) * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int q = nib32(b + 2, j0 + i);
            out[i] = d * (float)(TY == T_Q4_0 ? q - 8 : (int)kvalues_iq4nl[q]);
        }
    } else if (TY == T_Q4_1 || TY == T_Q5_1) {
        // Q4_1 { f16 d; f16 m; u8 qs[16] } (20 bytes), Q5_1 { f16 d; f16 m; u32 qh; u8
        // qs[16] } (24 bytes, bit j of qh is bit 4 of element j): d * q + m.
        const int bytes = (TY == T_Q4_1) ? 20 : 24;
        const u8* b = row + (p >> 2) * bytes;
        const float d = h2f(ld16(b));
        const float m = h2f(ld16(b + 2));
        const u32 qh = (TY == T_Q5_1) ? ((u32)b[4] | ((u32)b[5] << 8) | ((u32)b[6] << 16) |
                                         ((u32)b[7] << 24))
                                      : 0u;
        const u8* qs = b + ((TY == T_Q4_1) ? 4 : 8);
        const int j0 = (p & 3) * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = j0 + i;
            const int q = nib32(qs, j) | (int)(((qh >> j) & 1) << 4);
            out[i] = d * (float)q + m;
        }
    } else if (TY == T_MXFP4) {
        // { u8 e; u8 qs[16] }, 17 bytes: e8m0_half(e) * kvalues_mxfp4[q].
        const u8* b = row + (p >> 2) * 17;
        const u32 e = b[0];
        const float d = __int_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
        const int j0 = (p & 3) * 8;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = d * (float)kvalues_mxfp4[nib32(b + 1, j0 + i)];
    } else if (TY == T_Q2_K) {
        // { u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }, 84 bytes, 256 elements: element
        // 128 h + 32 s + l is bits 2s of qs[32 h + l]; (d * sc) * q - dmin * m per 16.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 84;
        const int i0 = e0 & 255;
        const int h = i0 >> 7, s = (i0 & 127) >> 5, l0 = i0 & 31;
        const u8 sc = b[i0 >> 4];
        const float dl = h2f(ld16(b + 80)) * (float)(sc & 0x0F);
        const float ml = h2f(ld16(b + 82)) * (float)(sc >> 4);
        const u8* qs = b + 16 + 32 * h;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = dl * (float)((qs[l0 + i] >> (2 * s)) & 3) - ml;
    } else if (TY == T_Q3_K) {
        // { u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }, 110 bytes, 256 elements: low
        // bits as Q2_K, minus 4 where bit e / 32 of hmask[e % 32] is clear; signed 6-bit
        // scale per 16: (d * sc) * q.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 110;
        const int i0 = e0 & 255;
        const int h = i0 >> 7, s = (i0 & 127) >> 5, l0 = i0 & 31;
        const int j = i0 >> 4;
        const u8* sb = b + 96;
        const int sc = (((sb[j & 7] >> (4 * (j >> 3))) & 0x0F) |
                        (((sb[8 + (j & 3)] >> (2 * (j >> 2))) & 3) << 4)) - 32;
        const float dl = h2f(ld16(b + 108)) * (float)sc;
        const u8* qs = b + 32 + 32 * h;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int l = l0 + i;
            const int q = ((qs[l] >> (2 * s)) & 3) - (((b[l] >> (i0 >> 5)) & 1) ? 0 : 4);
            out[i] = dl * (float)q;
        }
    } else if (TY == T_Q5_K) {
        // { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }, 176 bytes: sub-block j
        // of 32 takes nibble j & 1 of qs[32 (j / 2) + l] and bit j of qh[l].
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 176;
        const int j = (e0 & 255) >> 5;
        const int l0 = e0 & 31;
        int sc, m;
        k4_scale_min(b + 4, j, &sc, &m);
        const float d1 = h2f(ld16(b)) * (float)sc;
        const float m1 = h2f(ld16(b + 2)) * (float)m;
        const u8* qs = b + 48 + 32 * (j >> 1);
        const int shift = (j & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int l = l0 + i;
            const int q = ((qs[l] >> shift) & 0x0F) | (((b[16 + l] >> j) & 1) << 4);
            out[i] = d1 * (float)q - m1;
        }
    } else if (TY == T_IQ4_XS) {
        // { f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }, 136 bytes: sub-block j of
        // 32 is (d * (ls - 32)) * kvalues_iq4nl[nibble] over qs[16 j .. 16 j + 16].
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 136;
        const int j = (e0 & 255) >> 5;
        const int l0 = e0 & 31;
        const int ls = (((b[4 + (j >> 1)] >> (4 * (j & 1))) & 0x0F) |
                        (((ld16(b + 2) >> (2 * j)) & 3) << 4)) - 32;
        const float dl = h2f(ld16(b)) * (float)ls;
#pragma unroll
        for (int i = 0; i < 8; i++) out[i] = dl * (float)kvalues_iq4nl[nib32(b + 8 + 16 * j, l0 + i)];
    } else if (TY == T_IQ2_XXS) {
        // { f16 d; 8 x (u8 grid[4]; u32 signs_and_scale) }, 66 bytes: group l of sub-block
        // ib is iq2xxs_grid[grid[l]] with ksigns[(aux >> 7 l) & 127]; d * (2 s + 1) / 8.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 66;
        const u8* g = b + 2 + 8 * ((e0 & 255) >> 5);
        const int l = (e0 & 31) >> 3;
        const u32 aux = (u32)g[4] | ((u32)g[5] << 8) | ((u32)g[6] << 16) | ((u32)g[7] << 24);
        const float db = h2f(ld16(b)) * (float)(2 * (aux >> 28) + 1) * 0.125f;
        signed8(iq2xxs_grid[g[l]], ksigns_iq2xs[(aux >> (7 * l)) & 127], db, out);
    } else if (TY == T_IQ2_XS) {
        // { f16 d; u16 qs[32]; u8 scales[8] }, 74 bytes: each u16 is a 9-bit index into
        // iq2xs_grid and a 7-bit ksigns index; a 4-bit scale per 16 elements.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 74;
        const int i0 = e0 & 255;
        const u16 v = ld16(b + 2 + 2 * (i0 >> 3));
        const int s = (b[66 + (i0 >> 5)] >> (4 * ((i0 >> 4) & 1))) & 0x0F;
        const float db = h2f(ld16(b)) * (float)(2 * s + 1) * 0.125f;
        signed8(iq2xs_grid[v & 511], ksigns_iq2xs[v >> 9], db, out);
    } else if (TY == T_IQ3_XXS) {
        // { f16 d; u8 grid[64]; u32 signs_and_scale[8] }, 98 bytes: group l of sub-block ib
        // is two 4-value rows of iq3xxs_grid with ksigns[(aux >> 7 l) & 127]; d (2 s + 1) / 4.
        const int e0 = 8 * p;
        const u8* b = row + (e0 >> 8) * 98;
        const int ib = (e0 & 255) >> 5;
        const int l = (e0 & 31) >> 3;
        const u8* a = b + 66 + 4 * ib;
        const u32 aux = (u32)a[0] | ((u32)a[1] << 8) | ((u32)a[2] << 16) | ((u32)a[3] << 24);
        const float db = h2f(ld16(b)) * (float)(2 * (aux >> 28) + 1) * 0.25f;
        const u8* q = b + 2 + 8 * ib + 2 * l;
        const u64 g = (u64)iq3xxs_grid[q[0]] | ((u64)iq3xxs_grid[q[1]] << 32);
        signed8(g, ksigns_iq2xs[(aux >> (7 * l)) & 127], db, out);
    }
}

// w[0..8] . (a, b), summed left to right (the products of every f32 kernel).
__device__ __forceinline__ float dot8(const float* w, float4 a, float4 b) {
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y +
           w[6] * b.z + w[7] * b.w;
}

// Sum / maximum of v over the warp (every lane gets it): the same butterfly everywhere.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The f32 warp-per-row product: row `row` of W (cols elements of format TY) times up to N
// rows of X (`xrow(t)`, t < n), lanes striding over the groups of 8 columns; each lane's
// partial sums in acc[t] (warp_sum gives the row's). matvec and the whole forward pass's
// mv_chunks address X differently and share the rest.
template <int TY, int N, typename XRow>
__device__ __forceinline__ void row_dots(const u8* __restrict__ row, int cols, int n, int lane,
                                         XRow xrow, float* acc) {
#pragma unroll
    for (int t = 0; t < N; t++) acc[t] = 0.0f;
    for (int p = lane; p < (cols >> 3); p += 32) {
        float w[8];
        deq8<TY>(row, p, w);
#pragma unroll
        for (int t = 0; t < N; t++) {
            if (t < n) {
                const float4* x = (const float4*)(xrow(t) + 8 * p);
                acc[t] += dot8(w, x[0], x[1]);
            }
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
    float acc[MV_MAX_N];
    row_dots<TY, MV_MAX_N>(row, cols, n, lane,
                           [&](int t) { return X + (size_t)t * cols; }, acc);
#pragma unroll
    for (int t = 0; t < MV_MAX_N; t++) {
        if (t < n) {
            const float v = warp_sum(acc[t]);
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
KERNELS(q4_0, T_Q4_0)
KERNELS(q4_1, T_Q4_1)
KERNELS(q5_1, T_Q5_1)
KERNELS(iq4_nl, T_IQ4_NL)
KERNELS(mxfp4, T_MXFP4)
KERNELS(q2_k, T_Q2_K)
KERNELS(q3_k, T_Q3_K)
KERNELS(q5_k, T_Q5_K)
KERNELS(iq4_xs, T_IQ4_XS)
KERNELS(iq2_xxs, T_IQ2_XXS)
KERNELS(iq2_xs, T_IQ2_XS)
KERNELS(iq3_xxs, T_IQ3_XXS)
