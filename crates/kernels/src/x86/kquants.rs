//! AVX2 (and, for the Q8_0-activation ones, AVX-512 VNNI) dots for the quants-k formats:
//! Q4_0, IQ4_NL, MXFP4 with Q8_0 activations; Q4_1, Q5_1 with Q8_1 ones; Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0,
//! TQ2_0 with Q8_K activations.
//!
//! Owns: the block decoders to bytes and the N-token kernels. Same contract as `avx2.rs`:
//! integer parts exact (every i16 intermediate is bounded below 2^15, see each kernel), then
//! per block the i32 lane partials are converted to f32 and FMA'd into 8-lane accumulators
//! with the block's `dx * dy` (rounded to f32 exactly as the reference rounds it); the
//! operations on token t's accumulator do not depend on the tile size N, so matmul equals
//! matvec bit for bit. Offsets (Q3_K's -4, TQ's -1) go through the Q8_K `bsums`, and the
//! Q4_1/Q5_1 minimum through the Q8_1 block's stored sum.
//! Every function here is a `#[target_feature]` fn: callers must hold the matching token.

#![allow(clippy::needless_range_loop)] // index loops read like the layouts

use core::arch::x86_64::*;

use super::avx2::{hsum4, hsum8, k4_block_head, ld128, ld256, ld256_i16, ld256_i8, sub};
use super::avx2::{K4_SHUF, K6_SHUF};
use crate::formats::*;

/// The 16 packed bytes of 32 nibbles, as 32 bytes in element order (low nibbles first).
#[inline]
#[target_feature(enable = "avx2")]
fn nibbles(qs: &[u8; 16]) -> __m256i {
    let v = ld128(qs);
    _mm256_and_si256(
        _mm256_set_m128i(_mm_srli_epi16::<4>(v), v),
        _mm256_set1_epi8(0x0F),
    )
}

/// A 16-entry i8 table in both 128-bit lanes, for `_mm256_shuffle_epi8` lookups.
#[inline]
#[target_feature(enable = "avx2")]
fn table(t: &[i8; 16]) -> __m256i {
    let bytes = t.map(|x| x as u8);
    let v = ld128(&bytes);
    _mm256_set_m128i(v, v)
}

/// Byte `e` is 0xFF where bit `e` of `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2")]
fn bit_mask32(qh: u32) -> __m256i {
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0x0000_0000_0000_0000,
    );
    let rep = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
    let bit = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(rep, bit), _mm256_set1_epi64x(-1))
}

/// Q4_0 block: scale and the 32 quants `q - 8` in -8..=7.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn decode_q4_0(b: &[u8; Q4_0_BYTES], tab: &[f32; 65536]) -> (f32, __m256i) {
    let d = tab[u16::from_le_bytes([b[0], b[1]]) as usize];
    let q = _mm256_sub_epi8(nibbles(sub::<16, u8>(b, 2)), _mm256_set1_epi8(8));
    (d, q)
}

/// IQ4_NL block: scale and the 32 values from `KVALUES_IQ4NL` (|v| <= 127).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn decode_iq4_nl(b: &[u8; IQ4_NL_BYTES], tab: &[f32; 65536]) -> (f32, __m256i) {
    let d = tab[u16::from_le_bytes([b[0], b[1]]) as usize];
    let q = _mm256_shuffle_epi8(table(&KVALUES_IQ4NL), nibbles(sub::<16, u8>(b, 2)));
    (d, q)
}

/// MXFP4 block: half the E8M0 scale and the 32 doubled e2m1 values (|v| <= 12).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn decode_mxfp4(b: &[u8; MXFP4_BYTES], _tab: &[f32; 65536]) -> (f32, __m256i) {
    let q = _mm256_shuffle_epi8(table(&KVALUES_MXFP4), nibbles(sub::<16, u8>(b, 1)));
    (E8M0_HALF[b[0] as usize], q)
}

/// Q4_1 block: scale, min and the 32 unsigned quants 0..=15.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn decode_q4_1(b: &[u8; Q4_1_BYTES], tab: &[f32; 65536]) -> (f32, f32, __m256i) {
    let d = tab[u16::from_le_bytes([b[0], b[1]]) as usize];
    let m = tab[u16::from_le_bytes([b[2], b[3]]) as usize];
    (d, m, nibbles(sub::<16, u8>(b, 4)))
}

/// Q5_1 block: scale, min and the 32 unsigned quants 0..=31.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn decode_q5_1(b: &[u8; Q5_1_BYTES], tab: &[f32; 65536]) -> (f32, f32, __m256i) {
    let d = tab[u16::from_le_bytes([b[0], b[1]]) as usize];
    let m = tab[u16::from_le_bytes([b[2], b[3]]) as usize];
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let hi = _mm256_and_si256(bit_mask32(qh), _mm256_set1_epi8(0x10));
    (d, m, _mm256_or_si256(nibbles(sub::<16, u8>(b, 8)), hi))
}

/// Generates a kernel for a Q8_1-activation format with a per-block minimum (Q4_1, Q5_1):
/// per block and token `(dx dy) * lanes(q . y) + m * s` with `s` the Q8_1 block's stored
/// `f16(d * sum y)` (ggml's pairing). `$dot` is the u8 x i8 -> i32 lane step (maddubs +
/// madd, or VNNI): q <= 31 and |y| <= 127, so the maddubs pairs stay below 2^15.
macro_rules! q8_min_kernel {
    ($name:ident, $bytes:expr, $decode:ident, $features:literal, $dot:expr) => {
        /// Row of this format . N Q8_1 activation rows.
        #[target_feature(enable = $features)]
        pub(super) fn $name<const N: usize>(row: &[u8], ys: [&[BlockQ8_1]; N]) -> [f32; N] {
            let dot = $dot;
            let tab = f16_table();
            // Quant term in lanes, min term as one scalar chain per token.
            let mut acc = [_mm256_setzero_ps(); N];
            let mut accm = [0.0f32; N];
            let (blocks, _) = row.as_chunks::<{ $bytes }>();
            for (i, b) in blocks.iter().enumerate() {
                let (dx, mx, qx) = $decode(b, tab);
                for t in 0..N {
                    let yb = &ys[t][i];
                    let qy = ld256_i8(&yb.qs);
                    let dy = tab[yb.d as usize];
                    let s = _mm256_cvtepi32_ps(dot(qx, qy));
                    acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dx * dy), s, acc[t]);
                    accm[t] += mx * tab[yb.s as usize];
                }
            }
            let mut out = [0.0f32; N];
            for t in 0..N {
                out[t] = hsum8(acc[t]) + accm[t];
            }
            out
        }
    };
}

crate::q8_like_kernel!(
    dot_q4_0,
    Q4_0_BYTES,
    decode_q4_0,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);
crate::q8_like_kernel!(
    dot_iq4_nl,
    IQ4_NL_BYTES,
    decode_iq4_nl,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);
crate::q8_like_kernel!(
    dot_mxfp4,
    MXFP4_BYTES,
    decode_mxfp4,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);
q8_min_kernel!(
    dot_q4_1,
    Q4_1_BYTES,
    decode_q4_1,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);
q8_min_kernel!(
    dot_q5_1,
    Q5_1_BYTES,
    decode_q5_1,
    "avx2,fma,f16c",
    |a, s| { _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1)) }
);

// AVX-512 VNNI versions: `vpdpbusd` gives the same exact i32 lanes as maddubs + madd.
crate::q8_like_kernel!(
    dot_q4_0_vnni,
    Q4_0_BYTES,
    decode_q4_0,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
crate::q8_like_kernel!(
    dot_iq4_nl_vnni,
    IQ4_NL_BYTES,
    decode_iq4_nl,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
crate::q8_like_kernel!(
    dot_mxfp4_vnni,
    MXFP4_BYTES,
    decode_mxfp4,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
q8_min_kernel!(
    dot_q4_1_vnni,
    Q4_1_BYTES,
    decode_q4_1,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
q8_min_kernel!(
    dot_q5_1_vnni,
    Q5_1_BYTES,
    decode_q5_1,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);

// ---- Q8_K activations ----

/// `v >> n` on 16-bit lanes (n a loop index the compiler folds).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn srl16(v: __m256i, n: i32) -> __m256i {
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(n))
}

/// `sum_t` helper: the 8 i32 lanes `-(bsums[2l] + bsums[2l + 1])`, i.e. minus the sum of
/// the block's quants spread over lanes (TQ offsets).
#[inline]
#[target_feature(enable = "avx2")]
fn neg_bsums(yb: &BlockQ8K) -> __m256i {
    _mm256_madd_epi16(ld256_i16(&yb.bsums), _mm256_set1_epi16(-1))
}

/// Q2_K row . N Q8_K rows. Quants 0..=3, scales 0..=15: maddubs pairs <= 762, times the
/// scale in madd. Mins through `bsums`: `-(dy dmin) * sum_j m_j bsum_j`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q2k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = f16_table();
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut accm = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q2_K_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[80], b[81]]) as usize];
        let dmin = tab[u16::from_le_bytes([b[82], b[83]]) as usize];
        let sc8 = ld128(sub::<16, u8>(b, 0));
        let sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(sc8, m4));
        let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sc8), m4));
        let mut sumi = [_mm256_setzero_si256(); N];
        for t in 0..N {
            let yb = &ys[t][i];
            let prod = _mm256_madd_epi16(mins16, ld256_i16(&yb.bsums));
            accm[t] = _mm256_fmadd_ps(
                _mm256_set1_ps(-yb.d * dmin),
                _mm256_cvtepi32_ps(prod),
                accm[t],
            );
        }
        for h in 0..2 {
            let sch = if h == 0 {
                _mm256_permute2x128_si256::<0x00>(sc16, sc16)
            } else {
                _mm256_permute2x128_si256::<0x11>(sc16, sc16)
            };
            let q = ld256(sub::<32, u8>(b, 16 + 32 * h));
            for s in 0..4 {
                let qs = _mm256_and_si256(srl16(q, 2 * s as i32), m3);
                let scale = _mm256_shuffle_epi8(sch, ld256(&K6_SHUF[s]));
                for t in 0..N {
                    let q8 = ld256_i8(sub::<32, i8>(&ys[t][i].qs, 128 * h + 32 * s));
                    let p = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(qs, q8));
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
        out[t] = hsum8(acc[t]) + hsum8(accm[t]);
    }
    out
}

/// A Q3_K block's 16 scales as signed bytes (-32..=31): the packed 6-bit values of bytes
/// 96..108, minus their bias 32.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q3k_signed_scales(b: &[u8]) -> __m128i {
    let u = q3k_scales_biased(sub::<12, u8>(b, 96));
    let sc8 = _mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32);
    _mm_sub_epi8(sc8, _mm_set1_epi8(32))
}

/// Q3_K's 32 unsigned quants `q + 4` (0..=7) of elements `128 h + 32 k ..`: bits `2k` of
/// `q` (bytes `32 + 32 h ..` of the block) and bit `4h + k` of `hm` (bytes 0..32).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q3k_group(q: __m256i, hm: __m256i, h: usize, k: usize) -> __m256i {
    let lo = _mm256_and_si256(srl16(q, 2 * k as i32), _mm256_set1_epi8(3));
    let hb = _mm256_and_si256(srl16(hm, (4 * h + k) as i32), _mm256_set1_epi8(1));
    _mm256_or_si256(lo, _mm256_slli_epi16::<2>(hb))
}

/// Q5_K's quants (0..=31) of elements `64 j .. 64 j + 64` as two 32-element halves: the
/// nibbles of bytes `48 + 32 j ..` plus bits `2j` / `2j + 1` of `qh` (bytes 16..48).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn q5k_pair(b: &[u8], qh: __m256i, j: usize) -> [__m256i; 2] {
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let q4 = ld256(sub::<32, u8>(b, 48 + 32 * j));
    let hl = _mm256_and_si256(srl16(qh, 2 * j as i32), one);
    let hh = _mm256_and_si256(srl16(qh, 2 * j as i32 + 1), one);
    [
        _mm256_or_si256(_mm256_and_si256(q4, m4), _mm256_slli_epi16::<4>(hl)),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4),
            _mm256_slli_epi16::<4>(hh),
        ),
    ]
}

/// Q3_K row . N Q8_K rows. Uses the unsigned quants `q + 4` (0..=7) and folds the -4 in
/// through the bsums: `sum sc (q+4) y - 4 sum_j sc_j bsum_j` (all exact i32).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q3k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = f16_table();
    let mut acc = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q3_K_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[108], b[109]]) as usize];
        let sc16 = _mm256_cvtepi8_epi16(q3k_signed_scales(b));
        let mut sumi = [_mm256_setzero_si256(); N];
        for t in 0..N {
            let corr = _mm256_madd_epi16(sc16, ld256_i16(&ys[t][i].bsums));
            sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32::<2>(corr));
        }
        let hm = ld256(sub::<32, u8>(b, 0));
        for h in 0..2 {
            let sch = if h == 0 {
                _mm256_permute2x128_si256::<0x00>(sc16, sc16)
            } else {
                _mm256_permute2x128_si256::<0x11>(sc16, sc16)
            };
            let q = ld256(sub::<32, u8>(b, 32 + 32 * h));
            for s in 0..4 {
                let qs = q3k_group(q, hm, h, s);
                let scale = _mm256_shuffle_epi8(sch, ld256(&K6_SHUF[s]));
                for t in 0..N {
                    let q8 = ld256_i8(sub::<32, i8>(&ys[t][i].qs, 128 * h + 32 * s));
                    let p = _mm256_madd_epi16(scale, _mm256_maddubs_epi16(qs, q8));
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

/// Q5_K row . N Q8_K rows: Q4_K's scheme with the 5th bit from `qh` (quants 0..=31, maddubs
/// pairs <= 7874, scales and mins 0..=63).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_q5k<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = f16_table();
    let mut acc = [_mm256_setzero_ps(); N];
    let mut accm = [_mm_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<Q5_K_BYTES>();
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
        let qh = ld256(sub::<32, u8>(b, 16));
        for j in 0..4 {
            let scale_l = _mm256_shuffle_epi8(scales, ld256(&K4_SHUF[2 * j]));
            let scale_h = _mm256_shuffle_epi8(scales, ld256(&K4_SHUF[2 * j + 1]));
            let [ql, qhi] = q5k_pair(b, qh, j);
            for t in 0..N {
                let qs = &ys[t][i].qs;
                let q8l = ld256_i8(sub::<32, i8>(qs, 64 * j));
                let q8h = ld256_i8(sub::<32, i8>(qs, 64 * j + 32));
                let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(ql, q8l));
                let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(qhi, q8h));
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

/// IQ4_XS row . N Q8_K rows. Values |kv| <= 127 through the sign trick (`|kv| * (y *
/// sign kv)`, |y| <= 127 so pairs <= 32258), times the signed sub-block scale in madd.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_iq4xs<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = f16_table();
    let kv = table(&KVALUES_IQ4NL);
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<IQ4_XS_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[0], b[1]]) as usize];
        let (even, odd) = iq4xs_scales_biased(b);
        let ls = _mm_unpacklo_epi8(
            _mm_cvtsi32_si128(even as i32),
            _mm_cvtsi32_si128(odd as i32),
        );
        let sc = _mm_cvtepi8_epi16(_mm_sub_epi8(ls, _mm_set1_epi8(32)));
        let scales = _mm256_set_m128i(sc, sc);
        let mut sumi = [_mm256_setzero_si256(); N];
        for p in 0..4 {
            let raw = ld256(sub::<32, u8>(b, 8 + 32 * p));
            let lo = _mm256_and_si256(raw, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), m4);
            let k0 = _mm256_shuffle_epi8(kv, _mm256_permute2x128_si256::<0x20>(lo, hi));
            let k1 = _mm256_shuffle_epi8(kv, _mm256_permute2x128_si256::<0x31>(lo, hi));
            let (a0, a1) = (_mm256_sign_epi8(k0, k0), _mm256_sign_epi8(k1, k1));
            let s0 = _mm256_shuffle_epi8(scales, ld256(&K4_SHUF[2 * p]));
            let s1 = _mm256_shuffle_epi8(scales, ld256(&K4_SHUF[2 * p + 1]));
            for t in 0..N {
                let qs = &ys[t][i].qs;
                let y0 = _mm256_sign_epi8(ld256_i8(sub::<32, i8>(qs, 64 * p)), k0);
                let y1 = _mm256_sign_epi8(ld256_i8(sub::<32, i8>(qs, 64 * p + 32)), k1);
                let p0 = _mm256_madd_epi16(s0, _mm256_maddubs_epi16(a0, y0));
                let p1 = _mm256_madd_epi16(s1, _mm256_maddubs_epi16(a1, y1));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p0, p1));
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

/// TQ2_0 row . N Q8_K rows: unsigned `q + 1` (0..=3; 3 only in non-canonical blocks) then
/// minus the block's quant sum. i16 sums over the 8 chunks stay <= 8 * 762.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_tq2<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = f16_table();
    let m3 = _mm256_set1_epi8(3);
    let ones16 = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<TQ2_0_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[64], b[65]]) as usize];
        let mut s16 = [_mm256_setzero_si256(); N];
        for h in 0..2 {
            let q = ld256(sub::<32, u8>(b, 32 * h));
            for s in 0..4 {
                let qs = _mm256_and_si256(srl16(q, 2 * s as i32), m3);
                for t in 0..N {
                    let q8 = ld256_i8(sub::<32, i8>(&ys[t][i].qs, 128 * h + 32 * s));
                    s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(qs, q8));
                }
            }
        }
        for t in 0..N {
            let yb = &ys[t][i];
            let sumi = _mm256_add_epi32(_mm256_madd_epi16(s16[t], ones16), neg_bsums(yb));
            let dd = _mm256_set1_ps(yb.d * d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi), acc[t]);
        }
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum8(acc[t]);
    }
    out
}

/// Base-3 digit read-out of TQ1_0 bytes already multiplied by 3^k (mod 256), given as
/// `x = v ^ 0x80` (so signed compares order them as unsigned): `(v * 3) >> 8` is 0 for
/// v <= 85, 1 for 86..=170, 2 above. The bias survives the multiplications: if
/// `x = v + 128` then `3 x = 3 v + 384 = 3 v + 128 (mod 256)`, so `x` is xor'ed once per
/// source byte and then multiplied by 3 like `v`.
#[inline]
#[target_feature(enable = "avx2")]
fn trits(x: __m256i) -> __m256i {
    let g1 = _mm256_cmpgt_epi8(x, _mm256_set1_epi8((85u8 ^ 0x80) as i8));
    let g2 = _mm256_cmpgt_epi8(x, _mm256_set1_epi8((170u8 ^ 0x80) as i8));
    _mm256_sub_epi8(_mm256_sub_epi8(_mm256_setzero_si256(), g1), g2)
}

/// `3 v` mod 256 per byte.
#[inline]
#[target_feature(enable = "avx2")]
fn mul3(v: __m128i) -> __m128i {
    _mm_add_epi8(v, _mm_add_epi8(v, v))
}

/// `3 v` mod 256 per byte, 32 bytes.
#[inline]
#[target_feature(enable = "avx2")]
fn mul3_256(v: __m256i) -> __m256i {
    _mm256_add_epi8(v, _mm256_add_epi8(v, v))
}

/// TQ1_0 row . N Q8_K rows: digits 0..=2 (`t + 1`) dotted in i16 (<= 8 * 508) then minus
/// the block's quant sum.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn dot_tq1<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
    let tab = f16_table();
    let ones16 = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); N];
    let (blocks, _) = row.as_chunks::<TQ1_0_BYTES>();
    for (i, b) in blocks.iter().enumerate() {
        let d = tab[u16::from_le_bytes([b[52], b[53]]) as usize];
        // The 8 32-byte groups of (byte * 3^k) ^ 0x80 in element order.
        let mut v = [_mm256_setzero_si256(); 8];
        v[0] = _mm256_xor_si256(ld256(sub::<32, u8>(b, 0)), _mm256_set1_epi8(-128));
        for k in 1..5 {
            v[k] = mul3_256(v[k - 1]);
        }
        let w0 = _mm_xor_si128(ld128(sub::<16, u8>(b, 32)), _mm_set1_epi8(-128));
        let w1 = mul3(w0);
        let w2 = mul3(w1);
        let w3 = mul3(w2);
        let w4 = mul3(w3);
        let h0 = _mm_set1_epi32(
            i32::from_le_bytes([b[48], b[49], b[50], b[51]]) ^ 0x8080_8080u32 as i32,
        );
        let h1 = mul3(h0);
        let h2 = mul3(h1);
        let h3 = mul3(h2);
        let hv = _mm_blend_epi32::<0b1000>(
            _mm_blend_epi32::<0b0100>(_mm_blend_epi32::<0b0010>(h0, h1), h2),
            h3,
        );
        v[5] = _mm256_set_m128i(w1, w0);
        v[6] = _mm256_set_m128i(w3, w2);
        v[7] = _mm256_set_m128i(hv, w4);
        let mut s16 = [_mm256_setzero_si256(); N];
        for (k, vk) in v.iter().enumerate() {
            let q = trits(*vk);
            for t in 0..N {
                let q8 = ld256_i8(sub::<32, i8>(&ys[t][i].qs, 32 * k));
                s16[t] = _mm256_add_epi16(s16[t], _mm256_maddubs_epi16(q, q8));
            }
        }
        for t in 0..N {
            let yb = &ys[t][i];
            let sumi = _mm256_add_epi32(_mm256_madd_epi16(s16[t], ones16), neg_bsums(yb));
            let dd = _mm256_set1_ps(yb.d * d);
            acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi), acc[t]);
        }
    }
    let mut out = [0.0f32; N];
    for t in 0..N {
        out[t] = hsum8(acc[t]);
    }
    out
}
