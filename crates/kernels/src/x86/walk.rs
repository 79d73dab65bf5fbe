//! Single-token row walks: rows one after the other (one sequential stream, which Zen's
//! hardware prefetchers follow, no software hints), all in one function, for Q4_K
//! ([`super::Q4kRowOrder::Single`], AMD) and Q8_0 ([`super::Q8RowOrder::Single`]).
//!
//! Owns: [`rows_q4k_walk`] and the Q8_0 walks. Each row gets exactly the lane operations of
//! the one-row dot (`avx2::dot_q4k::<1>`, `dot_q8_0::<1>`) in the same order (same bits;
//! `q4k_row_orders_give_the_same_bits` / `q8_0_row_orders_give_the_same_bits` in
//! `x86/mod.rs`), with less work per block and per row than calling that kernel row by row:
//! - the activation's per-block terms (Q4_K: the pair sums of its `bsums`, `dy` and `-dy`;
//!   Q8_0: `dy`) are made once per call, not once per row;
//! - Q4_K's `d` and `dmin` are converted together by F16C (the same values as the f16
//!   table, without its loads) and multiplied by `[dy, -dy]` in one vector product (the
//!   products `dy d` and `-dy dmin` are what the kernel rounds, in either operand order);
//! - Q4_K's 12 packed bytes of 6-bit scales and mins are unpacked with vector shifts and
//!   masks (ggml's `utmp` arithmetic on the three u32 words, lane by lane) instead of scalar
//!   code and four inserts, and each sub-block's scale is broadcast to i16 lanes by one
//!   byte shuffle from the unpacked bytes;
//! - no per-row dispatch (the one-row fallback went through `dot_tile` and a call per row:
//!   a 768-column Q4_K down row is only 3 blocks).
//!
//! The integer lane values are the ones the one-row dots form (exact: Q4_K maddubs pairs
//! <= 2 * 15 * 127, times 6-bit scales in madd; Q8_0 through the sign trick), so only how
//! they are produced differs.

use core::arch::x86_64::*;

use super::avx2::{hsum4, hsum8, ld128, ld256, ld256_i16, sub};
use crate::formats::{BlockQ8K, BlockQ8_0, Q4_K_BYTES, Q8_0_BYTES};

/// Blocks per row the walk takes its activation terms for on the stack (64 blocks: 16384
/// columns); longer rows go through `dot_q4k::<1>` row by row (same bits).
const MAX_BLOCKS: usize = 64;

/// `SCALE_SHUF[k]`: byte shuffle broadcasting byte `k` of each 128-bit lane, zero-extended,
/// to every i16 lane (sub-block `k`'s scale from the unpacked scale bytes).
const fn scale_shuffles() -> [[u8; 32]; 8] {
    let mut m = [[0u8; 32]; 8];
    let mut k = 0;
    while k < 8 {
        let mut i = 0;
        while i < 16 {
            m[k][2 * i] = k as u8;
            m[k][2 * i + 1] = 0x80;
            i += 1;
        }
        k += 1;
    }
    m
}
const SCALE_SHUF: [[u8; 32]; 8] = scale_shuffles();

/// A Q4_K block's 8 scales (bytes 0..8) and 8 mins (bytes 8..16) from its first 16 bytes
/// `v` (u32 words: `d | dmin << 16`, then the packed words u0, u1, u2): ggml's
/// `utmp` unpacking, `[u0 & m1, (u2 & m2) | ((u0 >> 6) & m3) << 4, u1 & m1,
/// ((u2 >> 4) & m2) | ((u1 >> 6) & m3) << 4]`, done on the four lanes at once.
#[inline]
#[target_feature(enable = "avx2")]
fn scales_mins(v: __m128i) -> __m128i {
    // [u0, u2, u1, u2] and [u0, u0, u1, u1]
    let a = _mm_shuffle_epi32::<0b11_10_11_01>(v);
    let b = _mm_shuffle_epi32::<0b10_10_01_01>(v);
    let lo = _mm_and_si128(
        _mm_srlv_epi32(a, _mm_set_epi32(4, 0, 0, 0)),
        _mm_set_epi32(0x0f0f_0f0f, 0x3f3f_3f3f, 0x0f0f_0f0f, 0x3f3f_3f3f),
    );
    // ((u >> 6) & 0x03) << 4 == (u >> 2) & 0x30 per byte (lanes 1 and 3 only).
    let hi = _mm_and_si128(
        _mm_srli_epi32::<2>(b),
        _mm_set_epi32(0x3030_3030, 0, 0x3030_3030, 0),
    );
    _mm_or_si128(lo, hi)
}

/// `out[r] = row r . ys` for consecutive Q4_K rows of `w` (`rb` bytes each), one row after
/// the other; each row's result has the bits of `dot_q4k::<1>` on it.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn rows_q4k_walk(w: &[u8], rb: usize, ys: &[BlockQ8K], out: &mut [f32]) {
    let nb = rb / Q4_K_BYTES;
    if nb > MAX_BLOCKS {
        for (r, o) in out.iter_mut().enumerate() {
            *o = super::avx2::dot_q4k::<1>(&w[r * rb..(r + 1) * rb], [ys])[0];
        }
        return;
    }
    let ys = &ys[..nb];
    // Per activation block: the 8 pair sums of its bsums (i16) and [dy, -dy, 0, 0].
    let mut q8s = [_mm_setzero_si128(); MAX_BLOCKS];
    let mut dys = [_mm_setzero_ps(); MAX_BLOCKS];
    for (i, yb) in ys.iter().enumerate() {
        let bs = ld256_i16(&yb.bsums);
        q8s[i] = _mm_hadd_epi16(
            _mm256_castsi256_si128(bs),
            _mm256_extracti128_si256::<1>(bs),
        );
        dys[i] = _mm_set_ps(0.0, 0.0, -yb.d, yb.d);
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let shuf: [__m256i; 8] = core::array::from_fn(|k| ld256(&SCALE_SHUF[k]));
    for (r, o) in out.iter_mut().enumerate() {
        let (blocks, _) = w[r * rb..(r + 1) * rb].as_chunks::<Q4_K_BYTES>();
        let mut acc = _mm256_setzero_ps();
        let mut accm = _mm_setzero_ps();
        for (i, (b, yb)) in blocks.iter().zip(ys).enumerate() {
            let head = ld128(sub::<16, u8>(b, 0));
            // lanes: dy d, -dy dmin (F16C: the f16 table's values)
            let f = _mm_mul_ps(_mm_cvtph_ps(head), dys[i]);
            let sm = scales_mins(head);
            let mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));
            let prod = _mm_madd_epi16(mins, q8s[i]);
            let dm = _mm_shuffle_ps::<0b01_01_01_01>(f, f);
            accm = _mm_fmadd_ps(dm, _mm_cvtepi32_ps(prod), accm);
            let sc = _mm256_set_m128i(sm, sm);
            let mut sumi = _mm256_setzero_si256();
            for j in 0..4 {
                let scale_l = _mm256_shuffle_epi8(sc, shuf[2 * j]);
                let scale_h = _mm256_shuffle_epi8(sc, shuf[2 * j + 1]);
                let q4 = ld256(sub::<32, u8>(b, 16 + 32 * j));
                let q4l = _mm256_and_si256(q4, m4);
                let q4h = _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4);
                let q8l = super::avx2::ld256_i8(sub::<32, i8>(&yb.qs, 64 * j));
                let q8h = super::avx2::ld256_i8(sub::<32, i8>(&yb.qs, 64 * j + 32));
                let pl = _mm256_madd_epi16(scale_l, _mm256_maddubs_epi16(q4l, q8l));
                let ph = _mm256_madd_epi16(scale_h, _mm256_maddubs_epi16(q4h, q8h));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            let dd = _mm256_broadcastss_ps(f);
            acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(sumi), acc);
        }
        *o = hsum8(acc) + hsum4(accm);
    }
}

/// Blocks per row the Q8_0 walk keeps its activation scales for on the stack (256 blocks:
/// 8192 columns); longer rows go through the tier's `dot_q8_0::<1>` row by row (same bits).
const MAX_Q8_BLOCKS: usize = 256;

/// Generates a Q8_0 single-row walk for one way of doing the u8 x i8 -> i32 step (`$dot`:
/// maddubs + madd, or VNNI; the same exact i32 lanes). `$tier`: the module of that tier's
/// one-row `dot_q8_0`.
macro_rules! q8_0_walk {
    ($name:ident, $tier:ident, $features:literal, $dot:expr) => {
        /// `out[r] = row r . ys` for consecutive Q8_0 rows of `w` (`rb` bytes each), one
        /// row after the other; each row's result has the bits of `dot_q8_0::<1>` on it.
        #[target_feature(enable = $features)]
        pub(super) fn $name(w: &[u8], rb: usize, ys: &[BlockQ8_0], out: &mut [f32]) {
            let dot = $dot;
            let nb = rb / Q8_0_BYTES;
            if nb > MAX_Q8_BLOCKS {
                for (r, o) in out.iter_mut().enumerate() {
                    *o = super::$tier::dot_q8_0::<1>(&w[r * rb..(r + 1) * rb], [ys])[0];
                }
                return;
            }
            let ys = &ys[..nb];
            let mut dys = [0.0f32; MAX_Q8_BLOCKS];
            for (d, yb) in dys.iter_mut().zip(ys) {
                *d = super::avx2::f16_to_f32(yb.d);
            }
            for (r, o) in out.iter_mut().enumerate() {
                let (blocks, _) = w[r * rb..(r + 1) * rb].as_chunks::<Q8_0_BYTES>();
                let mut acc = _mm256_setzero_ps();
                for ((b, yb), dy) in blocks.iter().zip(ys).zip(&dys) {
                    // dx in every lane by F16C from a broadcast (a full register write: a
                    // scalar insert merged into whatever register the compiler picked, once
                    // the accumulator, and chained the blocks), then `dx dy` in every lane.
                    let h = i16::from_le_bytes([b[0], b[1]]);
                    let dd = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16(h)), _mm256_set1_ps(*dy));
                    let qx = ld256(sub::<32, u8>(b, 2));
                    let qy = super::avx2::ld256_i8(&yb.qs);
                    let s = dot(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx));
                    acc = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc);
                }
                *o = hsum8(acc);
            }
        }
    };
}

q8_0_walk!(rows_q8_0_walk, avx2, "avx2,fma,f16c", |a, s| {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, s), _mm256_set1_epi16(1))
});
q8_0_walk!(
    rows_q8_0_walk_vnni,
    avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    |a, s| _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, s)
);
