//! AVX-512 (F/BW/VL/VNNI) kernels.
//!
//! Owns: the kernels where AVX-512 pays over the AVX2 tier. Today: the Q8_0-activation dots
//! (Q8_0, Q5_0 weights) with VNNI `vpdpbusd` doing the u8 x i8 -> i32 step in one
//! instruction; its i32 lanes equal AVX2's maddubs + madd exactly, so results are
//! bit-identical to the AVX2 tier. Q4_K / Q6_K: the same i32 lanes as the AVX2 kernels,
//! two 32-element groups per 512-bit `vpdpbusd` and the group scale applied by `vpdpwssd`
//! (each `vpdpbusd` lane is a sum of 4 products, |.| < 2^15, so its low i16 is the value and
//! the scale's high i16 is 0); the 512-bit halves are added into the AVX2 kernel's 8 lanes
//! (same elements per lane), then the float steps are the AVX2 kernel's. Other formats use
//! the AVX2 kernels. Single-token row kernels (`rows_*`: two rows interleaved, weights
//! prefetched ahead) for Q8_0, Q5_0, Q4_K and Q6_K.
//! The Q8_0 / Q5_0 row kernels convert f16 block scales with F16C, as the AVX2 tier's do:
//! the 256 KiB lookup table competed with the streamed weights (Gemma 3 270M decode on an
//! AMD EPYC Zen 4, 2 threads: 65-69 -> 87-100 tok/s; same bits).
//! Every function here is a `#[target_feature]` fn: callers must hold the `Avx512` token.

use core::arch::x86_64::*;

use super::avx2::{decode_q5_0, decode_q8_0, hsum4, hsum8, ld256_i8};
use super::avx2::{k4_block_head, ld128, ld256, ld256_i16, q6k_half, sub};
use crate::formats::{BlockQ8K, Q4_K_BYTES, Q5_0_BYTES, Q6_K_BYTES, Q8_0_BYTES};

crate::q8_like_kernel!(
    dot_q8_0,
    rows_q8_0,
    Q8_0_BYTES,
    decode_q8_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
crate::q8_like_kernel!(
    dot_q5_0,
    rows_q5_0,
    Q5_0_BYTES,
    decode_q5_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);

#[inline]
#[target_feature(enable = "avx512f")]
pub(super) fn ld512_i8(p: &[i8; 64]) -> __m512i {
    // SAFETY: `p` is 64 readable bytes; loadu has no alignment requirement.
    unsafe { _mm512_loadu_si512(p.as_ptr().cast()) }
}

/// `[lo; 8] ++ [hi; 8]` as i32 lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn halves(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The 8 i32 lanes of the AVX2 kernels: low half + high half.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
pub(super) fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// `Q4_SC_IDX[j]`: i32 lanes 0..7 get scale #2j, lanes 8..15 scale #2j+1 (Q4_K: one scale
/// per 32 elements; the low and high nibbles of 32 bytes are two sub-blocks).
pub(super) const Q4_SC_IDX: [[i32; 16]; 4] = {
    let mut m = [[0i32; 16]; 4];
    let mut j = 0;
    while j < 4 {
        let mut l = 0;
        while l < 16 {
            m[j][l] = 2 * j as i32 + l as i32 / 8;
            l += 1;
        }
        j += 1;
    }
    m
};

/// Q4_K row . N Q8_K rows (same bits as `avx2::dot_q4k`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn dot_q4k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = crate::formats::f16_table();
    let m4 = _mm512_set1_epi8(0x0F);
    let idx = Q4_SC_IDX.map(|m| {
        // SAFETY: `m` is 16 readable i32; loadu has no alignment requirement.
        unsafe { _mm512_loadu_si512(m.as_ptr().cast()) }
    });
    let mut acc = [_mm256_setzero_ps(); N];
    let mut accm = [_mm_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q4_K_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let (d, dmin, sm) = k4_block_head(b, tab);
        let mins = _mm256_extracti128_si256::<1>(_mm256_cvtepu8_epi16(sm));
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
        // The 8 sub-block scales (0..=63) as i32 lanes 0..7.
        let sc32 = _mm512_cvtepu8_epi32(_mm_move_epi64(sm));
        let mut sumi = [_mm512_setzero_si512(); N];
        for (j, &ix) in idx.iter().enumerate() {
            let scale = _mm512_permutexvar_epi32(ix, sc32);
            let q4 = ld256(sub::<32, u8>(b, 16 + 32 * j));
            let q4 = _mm512_and_si512(halves(q4, _mm256_srli_epi16::<4>(q4)), m4);
            for t in 0..N {
                let q8 = ld512_i8(sub::<64, i8>(&ys[t][i].qs, 64 * j));
                let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q4, q8);
                sumi[t] = _mm512_dpwssd_epi32(sumi[t], p, scale);
            }
        }
        for t in 0..N {
            let dd = _mm256_set1_ps(ys[t][i].d * d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(fold(sumi[t])), acc[t]);
        }
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum8(acc[t]) + hsum4(accm[t]);
    }
    out
}

/// `out[r] = row r . ys` for consecutive Q4_K rows of `w` (`rb` bytes each), two rows
/// interleaved: each row's accumulators see exactly the operations of `dot_q4k::<1>` in the
/// same order (same bits), while the activation block is loaded once for both rows, the
/// two rows' chains run side by side, and the weights of the rows `KQ_PREFETCH_ROWS` ahead
/// are prefetched block by block. An odd last row goes through `dot_q4k::<1>`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn rows_q4k(w: &[u8], rb: usize, ys: &[BlockQ8K], out: &mut [f32]) {
    let tab = crate::formats::f16_table();
    let m4 = _mm512_set1_epi8(0x0F);
    let idx = Q4_SC_IDX.map(|m| {
        // SAFETY: `m` is 16 readable i32; loadu has no alignment requirement.
        unsafe { _mm512_loadu_si512(m.as_ptr().cast()) }
    });
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
            let mut sumi = [_mm512_setzero_si512(); 2];
            let mut dd = [0.0f32; 2];
            for (k, b) in [x0, x1].into_iter().enumerate() {
                let (d, dmin, sm) = k4_block_head(b, tab);
                let mins = _mm256_extracti128_si256::<1>(_mm256_cvtepu8_epi16(sm));
                let prod = _mm_madd_epi16(mins, q8s);
                accm[k] = _mm_fmadd_ps(_mm_set1_ps(-yb.d * dmin), _mm_cvtepi32_ps(prod), accm[k]);
                let sc32 = _mm512_cvtepu8_epi32(_mm_move_epi64(sm));
                for (j, &ix) in idx.iter().enumerate() {
                    let scale = _mm512_permutexvar_epi32(ix, sc32);
                    let q4 = ld256(sub::<32, u8>(b, 16 + 32 * j));
                    let q4 = _mm512_and_si512(halves(q4, _mm256_srli_epi16::<4>(q4)), m4);
                    let q8 = ld512_i8(sub::<64, i8>(&yb.qs, 64 * j));
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q4, q8);
                    sumi[k] = _mm512_dpwssd_epi32(sumi[k], p, scale);
                }
                dd[k] = yb.d * d;
            }
            for k in 0..2 {
                let v = _mm256_set1_ps(dd[k]);
                acc[k] = _mm256_fmadd_ps(v, _mm256_cvtepi32_ps(fold(sumi[k])), acc[k]);
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

/// `Q6_SC_IDX[m]`: i32 lane l gets scale #(4m + l / 4) (Q6_K: one scale per 16 elements,
/// two 32-element groups per 512-bit vector).
pub(super) const Q6_SC_IDX: [[i32; 16]; 4] = {
    let mut m = [[0i32; 16]; 4];
    let mut k = 0;
    while k < 4 {
        let mut l = 0;
        while l < 16 {
            m[k][l] = 4 * k as i32 + l as i32 / 4;
            l += 1;
        }
        k += 1;
    }
    m
};

/// Q6_K row . N Q8_K rows (same bits as `avx2::dot_q6k`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn dot_q6k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = crate::formats::f16_table();
    let idx = Q6_SC_IDX.map(|m| {
        // SAFETY: `m` is 16 readable i32; loadu has no alignment requirement.
        unsafe { _mm512_loadu_si512(m.as_ptr().cast()) }
    });
    let mut acc = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q6_K_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[208], b[209]]) as usize];
        let sc8 = ld128(sub::<16, u8>(b, 192));
        let sc16 = _mm256_cvtepi8_epi16(sc8);
        // Scales are signed: keep each i32 lane's high i16 zero so `vpdpwssd` multiplies the
        // product's low i16 (its exact value) by the scale and its sign bits by 0.
        let sc32 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), _mm512_set1_epi32(0xFFFF));
        let mut sumi = [_mm512_setzero_si512(); N];
        let mut corr = [_mm256_setzero_si256(); N];
        for t in 0..N {
            let c = _mm256_madd_epi16(sc16, ld256_i16(&ys[t][i].bsums));
            corr[t] = _mm256_slli_epi32::<5>(c);
        }
        for h in 0..2 {
            let q = q6k_half(b, h);
            for m in 0..2 {
                let scale = _mm512_permutexvar_epi32(idx[2 * h + m], sc32);
                let qq = halves(q[2 * m], q[2 * m + 1]);
                for t in 0..N {
                    let q8 = ld512_i8(sub::<64, i8>(&ys[t][i].qs, 128 * h + 64 * m));
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qq, q8);
                    sumi[t] = _mm512_dpwssd_epi32(sumi[t], p, scale);
                }
            }
        }
        for t in 0..N {
            let s = _mm256_sub_epi32(fold(sumi[t]), corr[t]);
            let dd = _mm256_set1_ps(ys[t][i].d * d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc[t]);
        }
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum8(acc[t]);
    }
    out
}

/// `out[r] = row r . ys` for consecutive Q6_K rows of `w` (`rb` bytes each), two rows
/// interleaved as in [`rows_q4k`]: each row sees exactly the operations of `dot_q6k::<1>`
/// in the same order (same bits), the activation block is loaded once for both rows, and
/// the weights of the rows `KQ_PREFETCH_ROWS` ahead are prefetched block by
/// block. An odd last row goes through `dot_q6k::<1>`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) fn rows_q6k(w: &[u8], rb: usize, ys: &[BlockQ8K], out: &mut [f32]) {
    let tab = crate::formats::f16_table();
    let idx = Q6_SC_IDX.map(|m| {
        // SAFETY: `m` is 16 readable i32; loadu has no alignment requirement.
        unsafe { _mm512_loadu_si512(m.as_ptr().cast()) }
    });
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
            let mut sc32 = [_mm512_setzero_si512(); 2];
            let mut corr = [_mm256_setzero_si256(); 2];
            for (k, b) in [x0, x1].into_iter().enumerate() {
                let sc8 = ld128(sub::<16, u8>(b, 192));
                let sc16 = _mm256_cvtepi8_epi16(sc8);
                sc32[k] = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), _mm512_set1_epi32(0xFFFF));
                corr[k] = _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc16, bs));
            }
            let mut sumi = [_mm512_setzero_si512(); 2];
            for h in 0..2 {
                let q = [q6k_half(x0, h), q6k_half(x1, h)];
                for m in 0..2 {
                    let q8 = ld512_i8(sub::<64, i8>(&yb.qs, 128 * h + 64 * m));
                    for k in 0..2 {
                        let scale = _mm512_permutexvar_epi32(idx[2 * h + m], sc32[k]);
                        let qq = halves(q[k][2 * m], q[k][2 * m + 1]);
                        let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qq, q8);
                        sumi[k] = _mm512_dpwssd_epi32(sumi[k], p, scale);
                    }
                }
            }
            for (k, b) in [x0, x1].into_iter().enumerate() {
                let d = tab[u16::from_le_bytes([b[208], b[209]]) as usize];
                let s = _mm256_sub_epi32(fold(sumi[k]), corr[k]);
                let dd = _mm256_set1_ps(yb.d * d);
                acc[k] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc[k]);
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
