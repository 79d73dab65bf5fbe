//! AVX2 + FMA + F16C kernels: dot of one weight row with N activation rows at once.
//!
//! Owns: the 256-bit dots for every weight format. Each kernel decodes a weight block once
//! and feeds it to N tokens; the operations applied to token t's accumulator do not depend
//! on N, so a tile of N tokens gives bit-identical results to N single-token calls.
//!
//! Single-token row kernels (`rows_*`: two rows interleaved, the same per-row operations
//! as the one-row dot, weights prefetched ahead) for Q8_0, Q5_0, Q4_K and Q6_K.
//!
//! Integer parts are exact (as in the reference); floats: per block, the exact i32 lane
//! partials are converted to f32 and FMA'd into 8-lane accumulators, summed at the end.
//! Every function here is a `#[target_feature]` fn: callers must hold the `Avx2` token.

use core::arch::x86_64::*;

use crate::formats::{BlockQ8K, Q4_K_BYTES, Q5_0_BYTES, Q6_K_BYTES, Q8_0_BYTES};

/// `&b[off..off + L]` as an array reference (the bounds check folds for constant offsets).
#[inline(always)]
pub(super) fn sub<const L: usize, T>(b: &[T], off: usize) -> &[T; L] {
    b[off..off + L].try_into().expect("in bounds")
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld256(p: &[u8; 32]) -> __m256i {
    // SAFETY: `p` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld256_i8(p: &[i8; 32]) -> __m256i {
    // SAFETY: `p` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld256_i16(p: &[i16; 16]) -> __m256i {
    // SAFETY: `p` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn ld128(p: &[u8; 16]) -> __m128i {
    // SAFETY: `p` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    hsum4(s)
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn hsum4(s: __m128) -> f32 {
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// `K4_SHUF[k]` broadcasts i16 #k of each 128-bit lane to the whole lane (Q4_K: one scale
/// per 32 elements).
const fn k4_shuffles() -> [[u8; 32]; 8] {
    let mut m = [[0u8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        let mut i = 0;
        while i < 16 {
            m[k][2 * i] = 2 * k as u8;
            m[k][2 * i + 1] = 2 * k as u8 + 1;
            i += 1;
        }
        k += 1;
    }
    m
}
pub(super) const K4_SHUF: [[u8; 32]; 8] = k4_shuffles();

/// `K6_SHUF[k]`: low lane gets i16 #2k, high lane i16 #2k+1 (Q6_K: one scale per 16
/// elements).
const fn k6_shuffles() -> [[u8; 32]; 4] {
    let mut m = [[0u8; 32]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 8 {
            m[k][2 * i] = 4 * k as u8;
            m[k][2 * i + 1] = 4 * k as u8 + 1;
            m[k][16 + 2 * i] = 4 * k as u8 + 2;
            m[k][16 + 2 * i + 1] = 4 * k as u8 + 3;
            i += 1;
        }
        k += 1;
    }
    m
}
pub(super) const K6_SHUF: [[u8; 32]; 4] = k6_shuffles();

/// Q4_K scales and mins, 8 + 8 bytes (ggml's `utmp` unpacking of the 12 packed bytes).
#[inline(always)]
pub(super) fn q4k_scales_mins(s: &[u8; 12]) -> [u32; 4] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    [
        u0 & KMASK1,
        (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4),
        u1 & KMASK1,
        ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4),
    ]
}

/// A Q4_K / Q5_K block's header (`b` is the block, from byte 0): `d`, `dmin`, and its 12
/// packed bytes of 6-bit scales and mins unpacked into one vector, the 8 scales in bytes
/// 0..8 and the 8 mins in bytes 8..16.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn k4_block_head(b: &[u8], tab: &[f32; 65536]) -> (f32, f32, __m128i) {
    let d = tab[u16::from_le_bytes([b[0], b[1]]) as usize];
    let dmin = tab[u16::from_le_bytes([b[2], b[3]]) as usize];
    let u = q4k_scales_mins(sub::<12, u8>(b, 4));
    let sm = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
    (d, dmin, sm)
}

/// Q4_K row . N Q8_K rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q4k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = crate::formats::f16_table();
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut accm = [_mm_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q4_K_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let (d, dmin, sm) = k4_block_head(b, tab);
        let ms = _mm256_cvtepu8_epi16(sm);
        let mins = _mm256_extracti128_si256::<1>(ms);
        let sc = _mm256_castsi256_si128(ms);
        let scales = _mm256_set_m128i(sc, sc);
        let mut sumi = [_mm256_setzero_si256(); N];
        for t in 0..N {
            let yb = &ys[t][i];
            let bs = ld256_i16(&yb.bsums);
            let q8s = _mm_hadd_epi16(
                _mm256_castsi256_si128(bs),
                _mm256_extracti128_si256::<1>(bs),
            );
            let prod = _mm_madd_epi16(mins, q8s);
            accm[t] = _mm_fmadd_ps(_mm_set1_ps(-yb.d * dmin), _mm_cvtepi32_ps(prod), accm[t]);
        }
        for j in 0..4 {
            let scale_l = _mm256_shuffle_epi8(scales, ld256(&K4_SHUF[2 * j]));
            let scale_h = _mm256_shuffle_epi8(scales, ld256(&K4_SHUF[2 * j + 1]));
            let q4 = ld256(sub::<32, u8>(b, 16 + 32 * j));
            let q4l = _mm256_and_si256(q4, m4);
            let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
            for t in 0..N {
                let qs = &ys[t][i].qs;
                let q8l = ld256_i8(sub::<32, i8>(qs, 64 * j));
                let q8h = ld256_i8(sub::<32, i8>(qs, 64 * j + 32));
                let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
                let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
            }
        }
        for t in 0..N {
            let dd = _mm256_set1_ps(ys[t][i].d * d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum8(acc[t]) + hsum4(accm[t]);
    }
    out
}

/// The four 32-element groups of 6-bit quants (0..=63, unsigned) of half `h` of a Q6_K block.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q6k_half(b: &[u8; Q6_K_BYTES], h: usize) -> [__m256i; 4] {
    let m4 = _mm256_set1_epi8(0x0F);
    let ql1 = ld256(sub::<32, u8>(b, 64 * h));
    let ql2 = ld256(sub::<32, u8>(b, 64 * h + 32));
    let qh = ld256(sub::<32, u8>(b, 128 + 32 * h));
    let hb = |m: i8| _mm256_and_si256(qh, _mm256_set1_epi8(m));
    [
        _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16::<4>(hb(0x03))),
        _mm256_or_si256(_mm256_and_si256(ql2, m4), _mm256_slli_epi16::<2>(hb(0x0C))),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), hb(0x30)),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql2), m4),
            _mm256_srli_epi16::<2>(hb(0xC0u8 as i8)),
        ),
    ]
}

/// Q6_K row . N Q8_K rows. The -32 offset is folded in through the Q8_K bsums:
/// `sum sc*(q-32)*y = sum sc*q*y - 32 * sum_j sc_j * bsum_j` (all exact i32).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q6k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = crate::formats::f16_table();
    let mut acc = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q6_K_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[208], b[209]]) as usize];
        let sc16 = _mm256_cvtepi8_epi16(ld128(sub::<16, u8>(b, 192)));
        let mut sumi = [_mm256_setzero_si256(); N];
        for t in 0..N {
            let corr = _mm256_madd_epi16(sc16, ld256_i16(&ys[t][i].bsums));
            sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32::<5>(corr));
        }
        for h in 0..2 {
            let sch = if h == 0 {
                _mm256_permute2x128_si256::<0x00>(sc16, sc16)
            } else {
                _mm256_permute2x128_si256::<0x11>(sc16, sc16)
            };
            let q = q6k_half(b, h);
            for (k, qk) in q.iter().enumerate() {
                let scale = _mm256_shuffle_epi8(sch, ld256(&K6_SHUF[k]));
                for t in 0..N {
                    let q8 = ld256_i8(sub::<32, i8>(&ys[t][i].qs, 128 * h + 32 * k));
                    let p = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(*qk, q8));
                    sumi[t] = _mm256_add_epi32(sumi[t], p);
                }
            }
        }
        for t in 0..N {
            let dd = _mm256_set1_ps(ys[t][i].d * d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum8(acc[t]);
    }
    out
}

/// f16 bits to f32 with F16C: exact, the same value as `formats::f16_table`, without a
/// load from a 256 KiB table that competes with the streamed weights for the cache.
///
/// The f16 goes into the vector register by a `vmovd` (a full register write): with the
/// intrinsic alone LLVM folded the load into `vpinsrw`, which merges into a register of
/// its choice, and in the AVX-512 tier's `rows_q8_0` that was a row's accumulator, so each
/// block's scale conversion waited for the previous block's FMA (one chain through the
/// whole row).
#[inline]
#[target_feature(enable = "f16c")]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let v: __m128i;
    // SAFETY: `vmovd` from a general register to an xmm register (SSE2, x86-64 baseline)
    // reads and writes only the named registers.
    unsafe {
        core::arch::asm!(
            "vmovd {v}, {g:e}",
            v = out(xmm_reg) v,
            g = in(reg) h as u32,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    _mm_cvtss_f32(_mm_cvtph_ps(v))
}

/// Decode a Q8_0 block: scale (converted by F16C, not read from the 256 KiB table, which
/// competes with the streamed weights for the cache: on the AMD EPYC Zen 3 dev machine,
/// 2 threads, the 12-layer 30B-shape Q8_0 synth, tg32 27.1-27.5 -> 28.7-29.1 tok/s; same
/// bits) and the 32 quants as they are. `_tab`: the signature the kernel macros call.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn decode_q8_0(b: &[u8; Q8_0_BYTES], _tab: &[f32; 65536]) -> (f32, __m256i) {
    (
        f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
        ld256(sub::<32, u8>(b, 2)),
    )
}

/// Decode a Q5_0 block: scale (F16C, as [`decode_q8_0`]) and the 32 quants `q - 16` in
/// -16..=15.
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn decode_q5_0(b: &[u8; Q5_0_BYTES], _tab: &[f32; 65536]) -> (f32, __m256i) {
    (f16_to_f32(u16::from_le_bytes([b[0], b[1]])), q5_0_quants(b))
}

/// The 32 quants of a Q5_0 block as `q - 16` in -16..=15.
#[inline]
#[target_feature(enable = "avx2")]
fn q5_0_quants(b: &[u8; Q5_0_BYTES]) -> __m256i {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    // Byte e of `bits` is 0xFF when bit e of qh is set.
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0x0000_0000_0000_0000,
    );
    let rep = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
    let bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let bits = _mm256_cmpeq_epi8(_mm256_or_si256(rep, bit), _mm256_set1_epi64x(-1));
    let qs = ld128(sub::<16, u8>(b, 6));
    let nib = _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(qs), qs),
        _mm256_set1_epi8(0x0F),
    );
    // (nib | 0x10 if bit) - 16 == nib if bit else nib | 0xF0 (as i8).
    let hi = _mm256_andnot_si256(bits, _mm256_set1_epi8(0xF0u8 as i8));
    _mm256_or_si256(nib, hi)
}

crate::q8_like_kernel!(
    dot_q8_0,
    rows_q8_0,
    Q8_0_BYTES,
    decode_q8_0,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);
crate::q8_like_kernel!(
    dot_q5_0,
    rows_q5_0,
    Q5_0_BYTES,
    decode_q5_0,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);

/// Dense row (`ES` bytes per element, `load8` decodes 8) . N f32 rows: two 8-lane FMA
/// accumulators per token over 16-element steps, then the tail in index order with plain
/// mul + add.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_dense<const N: usize, const ES: usize>(
    row: &[u8],
    xs: [&[f32]; N],
    load8: impl Fn(&[u8]) -> __m256,
    scalar: impl Fn(&[u8]) -> f32,
) -> [f32; N] {
    let n = xs
        .iter()
        .map(|x| x.len())
        .min()
        .unwrap_or(0)
        .min(row.len() / ES);
    let mut acc0 = [_mm256_setzero_ps(); N];
    let mut acc1 = [_mm256_setzero_ps(); N];
    let main = n / 16 * 16;
    let mut i = 0;
    while i < main {
        let w0 = load8(&row[i * ES..(i + 8) * ES]);
        let w1 = load8(&row[(i + 8) * ES..(i + 16) * ES]);
        for t in 0..N {
            acc0[t] = _mm256_fmadd_ps(w0, xload8(&xs[t][i..i + 8]), acc0[t]);
            acc1[t] = _mm256_fmadd_ps(w1, xload8(&xs[t][i + 8..i + 16]), acc1[t]);
        }
        i += 16;
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        let mut s = hsum8(_mm256_add_ps(acc0[t], acc1[t]));
        for j in main..n {
            s += scalar(&row[j * ES..(j + 1) * ES]) * xs[t][j];
        }
        out[t] = s;
    }
    out
}

#[inline]
#[target_feature(enable = "avx2")]
fn xload8(x: &[f32]) -> __m256 {
    assert!(x.len() >= 8);
    // SAFETY: `x` has at least 8 readable floats (asserted); loadu needs no alignment.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

/// F32 row . N f32 rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_f32<const N: usize>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_dense::<N, 4>(
        row,
        xs,
        |w| {
            assert!(w.len() >= 32);
            // SAFETY: 32 readable bytes (asserted), unaligned load; AVX enabled here.
            unsafe { _mm256_loadu_ps(w.as_ptr().cast()) }
        },
        |w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]),
    )
}

/// F16 row . N f32 rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_f16<const N: usize>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_dense::<N, 2>(
        row,
        xs,
        |w| _mm256_cvtph_ps(ld128(sub::<16, u8>(w, 0))),
        |w| crate::formats::f16_to_f32(u16::from_le_bytes([w[0], w[1]])),
    )
}

/// BF16 row . N f32 rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_bf16<const N: usize>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    dot_dense::<N, 2>(
        row,
        xs,
        |w| {
            let h = _mm256_cvtepu16_epi32(ld128(sub::<16, u8>(w, 0)));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
        },
        |w| crate::formats::bf16_to_f32(u16::from_le_bytes([w[0], w[1]])),
    )
}

/// `out[r] = row r . ys` for consecutive Q4_K rows of `w` (`rb` bytes each), two rows
/// interleaved: each row's accumulators see exactly the operations of `dot_q4k::<1>` in the
/// same order (same bits), while the activation block is loaded once for both rows, the two
/// rows' chains run side by side, and the weights of the rows
/// `KQ_PREFETCH_ROWS` ahead are prefetched block by block. An odd last row goes
/// through `dot_q4k::<1>`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_q4k(w: &[u8], rb: usize, ys: &[BlockQ8K], out: &mut [f32]) {
    let tab = crate::formats::f16_table();
    let m4 = _mm256_set1_epi8(0x0F);
    let nb = rb / Q4_K_BYTES;
    let ys = &ys[..nb];
    let pf = super::KQ_PREFETCH_ROWS;
    let mut pairs = out.chunks_exact_mut(2);
    let mut r = 0;
    for o in &mut pairs {
        let (b0, _) = w[r * rb..(r + 1) * rb].as_chunks::<Q4_K_BYTES>();
        let (b1, _) = w[(r + 1) * rb..(r + 2) * rb].as_chunks::<Q4_K_BYTES>();
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut accm = [_mm_setzero_ps(); 2];
        for (i, ((x0, x1), yb)) in b0.iter().zip(b1).zip(ys).enumerate() {
            super::prefetch_block(w, (r + pf) * rb + i * Q4_K_BYTES, Q4_K_BYTES);
            super::prefetch_block(w, (r + pf + 1) * rb + i * Q4_K_BYTES, Q4_K_BYTES);
            let bs = ld256_i16(&yb.bsums);
            let q8s = _mm_hadd_epi16(
                _mm256_castsi256_si128(bs),
                _mm256_extracti128_si256::<1>(bs),
            );
            let mut scales = [_mm256_setzero_si256(); 2];
            let mut dd = [0.0f32; 2];
            for (k, b) in [x0, x1].into_iter().enumerate() {
                let (d, dmin, sm) = k4_block_head(b, tab);
                let ms = _mm256_cvtepu8_epi16(sm);
                let mins = _mm256_extracti128_si256::<1>(ms);
                let sc = _mm256_castsi256_si128(ms);
                scales[k] = _mm256_set_m128i(sc, sc);
                let prod = _mm_madd_epi16(mins, q8s);
                accm[k] = _mm_fmadd_ps(_mm_set1_ps(-yb.d * dmin), _mm_cvtepi32_ps(prod), accm[k]);
                dd[k] = yb.d * d;
            }
            let mut sumi = [_mm256_setzero_si256(); 2];
            for j in 0..4 {
                let q8l = ld256_i8(sub::<32, i8>(&yb.qs, 64 * j));
                let q8h = ld256_i8(sub::<32, i8>(&yb.qs, 64 * j + 32));
                let shl = ld256(&K4_SHUF[2 * j]);
                let shh = ld256(&K4_SHUF[2 * j + 1]);
                for (k, b) in [x0, x1].into_iter().enumerate() {
                    let scale_l = _mm256_shuffle_epi8(scales[k], shl);
                    let scale_h = _mm256_shuffle_epi8(scales[k], shh);
                    let q4 = ld256(sub::<32, u8>(b, 16 + 32 * j));
                    let q4l = _mm256_and_si256(q4, m4);
                    let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
                    let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
                    let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
                    sumi[k] = _mm256_add_epi32(sumi[k], _mm256_add_epi32(pl, ph));
                }
            }
            for k in 0..2 {
                let v = _mm256_set1_ps(dd[k]);
                acc[k] = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(sumi[k]), acc[k]);
            }
        }
        o[0] = hsum8(acc[0]) + hsum4(accm[0]);
        o[1] = hsum8(acc[1]) + hsum4(accm[1]);
        r += 2;
    }
    if let [last] = pairs.into_remainder() {
        *last = dot_q4k::<1>(&w[r * rb..(r + 1) * rb], [ys])[0];
    }
}

/// `out[r] = row r . ys` for consecutive Q6_K rows of `w` (`rb` bytes each), two rows
/// interleaved as in [`rows_q4k`]: each row sees exactly the operations of `dot_q6k::<1>`
/// in the same order (same bits). An odd last row goes through `dot_q6k::<1>`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_q6k(w: &[u8], rb: usize, ys: &[BlockQ8K], out: &mut [f32]) {
    let tab = crate::formats::f16_table();
    let nb = rb / Q6_K_BYTES;
    let ys = &ys[..nb];
    let pf = super::KQ_PREFETCH_ROWS;
    let mut pairs = out.chunks_exact_mut(2);
    let mut r = 0;
    for o in &mut pairs {
        let (b0, _) = w[r * rb..(r + 1) * rb].as_chunks::<Q6_K_BYTES>();
        let (b1, _) = w[(r + 1) * rb..(r + 2) * rb].as_chunks::<Q6_K_BYTES>();
        let mut acc = [_mm256_setzero_ps(); 2];
        for (i, ((x0, x1), yb)) in b0.iter().zip(b1).zip(ys).enumerate() {
            super::prefetch_block(w, (r + pf) * rb + i * Q6_K_BYTES, Q6_K_BYTES);
            super::prefetch_block(w, (r + pf + 1) * rb + i * Q6_K_BYTES, Q6_K_BYTES);
            let bs = ld256_i16(&yb.bsums);
            let mut sumi = [_mm256_setzero_si256(); 2];
            let mut sc16 = [_mm256_setzero_si256(); 2];
            for (k, b) in [x0, x1].into_iter().enumerate() {
                sc16[k] = _mm256_cvtepi8_epi16(ld128(sub::<16, u8>(b, 192)));
                let corr = _mm256_madd_epi16(sc16[k], bs);
                sumi[k] = _mm256_sub_epi32(sumi[k], _mm256_slli_epi32::<5>(corr));
            }
            for h in 0..2 {
                let q0 = q6k_half(x0, h);
                let q1 = q6k_half(x1, h);
                for kk in 0..4 {
                    let q8 = ld256_i8(sub::<32, i8>(&yb.qs, 128 * h + 32 * kk));
                    let sh = ld256(&K6_SHUF[kk]);
                    for (k, qk) in [q0[kk], q1[kk]].into_iter().enumerate() {
                        let sch = if h == 0 {
                            _mm256_permute2x128_si256::<0x00>(sc16[k], sc16[k])
                        } else {
                            _mm256_permute2x128_si256::<0x11>(sc16[k], sc16[k])
                        };
                        let scale = _mm256_shuffle_epi8(sch, sh);
                        let p = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(qk, q8));
                        sumi[k] = _mm256_add_epi32(sumi[k], p);
                    }
                }
            }
            for (k, b) in [x0, x1].into_iter().enumerate() {
                let d = tab[u16::from_le_bytes([b[208], b[209]]) as usize];
                let dd = _mm256_set1_ps(yb.d * d);
                acc[k] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi[k]), acc[k]);
            }
        }
        o[0] = hsum8(acc[0]);
        o[1] = hsum8(acc[1]);
        r += 2;
    }
    if let [last] = pairs.into_remainder() {
        *last = dot_q6k::<1>(&w[r * rb..(r + 1) * rb], [ys])[0];
    }
}
