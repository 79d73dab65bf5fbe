//! AVX2 kernels of the IQ grid formats: dot of one weight row with N Q8_K rows at once.
//!
//! Each 32-element sub-block is decoded once into three vectors: unsigned magnitudes
//! (grid values, or |8 g + delta| for IQ1), +-1 signs (IQ1: the signed weights themselves;
//! `vpsignb` only looks at the sign) and i16 sub-block multipliers `ls` (low lane: the
//! first 16 elements, high lane: the last 16). Per token: `vpsignb` moves the signs onto
//! the activations, `vpmaddubsw` (no saturation: 2 * 62 * 127 < 2^15) and `vpmaddwd` with
//! `ls` give exact i32 lanes. At the end of a block the lanes are summed to the exact
//! integer `isum` of [`super::reference::block_isum`], and the float operations are the
//! reference's, so results equal the reference bit for bit, for any tile size N.
//! Sub-blocks are decoded in pairs. Signs are computed in SIMD: explicit sign bytes
//! (IQ2_S, IQ3_S) are spread over their 8 elements and bit-tested; `ksigns` indices
//! (IQ2_XXS, IQ2_XS, IQ3_XXS) first get their parity bit from a nibble-parity `vpshufb`.
//! Grid rows are scalar loads combined into vectors: AVX2 gathers were ~4x slower, and
//! building the indices in SIMD and reloading them through memory ~8% slower, on the
//! development Xeon.
//!
//! The `dot512_*` kernels are the same code compiled with AVX-512 F/BW/VL enabled (EVEX
//! encodings, 32 registers) for the AVX-512 tier, kept for the formats where that measured
//! faster on the development Xeon (IQ2_XXS +22%, IQ1_S/IQ1_M +5..8%, IQ2_XS +2%); the tier
//! runs the AVX2 build for the others. Callers of `dot512_*` hold `Avx512`.
//! Every other function here is a `#[target_feature]` fn: callers must hold the `Avx2` token.

use core::arch::x86_64::*;

use super::grids::*;
use super::iq1m_d_bits;
use super::{
    IQ1_M_BYTES, IQ1_S_BYTES, IQ2_S_BYTES, IQ2_XS_BYTES, IQ2_XXS_BYTES, IQ3_S_BYTES, IQ3_XXS_BYTES,
};
use crate::formats::BlockQ8K;

/// Magnitudes, signs, multipliers of one 32-element sub-block.
type Sub = (__m256i, __m256i, __m256i);

#[inline(always)]
fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

#[inline(always)]
fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

#[inline(always)]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The 32 activation quants of sub-block `ib`.
#[inline]
#[target_feature(enable = "avx2")]
fn ld_y(qs: &[i8; 256], ib: usize) -> __m256i {
    let p: &[i8; 32] = qs[32 * ib..32 * ib + 32].try_into().expect("in bounds");
    // SAFETY: `p` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// Exact sum of the 8 i32 lanes (the true sum fits in i32 for every IQ block).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b0100_1110>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b1011_0001>(s));
    _mm_cvtsi128_si32(s)
}

/// Four u64 rows as one vector, `a` lowest.
#[inline]
#[target_feature(enable = "avx2")]
fn rows4(a: u64, b: u64, c: u64, d: u64) -> __m256i {
    _mm256_set_epi64x(d as i64, c as i64, b as i64, a as i64)
}

/// Multipliers `2 s + 1`: `lo` for the first 16 elements, `hi` for the last 16.
#[inline]
#[target_feature(enable = "avx2")]
fn mults(lo: u32, hi: u32) -> __m256i {
    _mm256_set_m128i(
        _mm_set1_epi16((2 * hi + 1) as i16),
        _mm_set1_epi16((2 * lo + 1) as i16),
    )
}

/// +-1 bytes from 4 explicit sign bytes `s` (byte `l` holds the signs of elements
/// `8 l .. 8 l + 8`): spread each byte over its 8 lanes, test one bit per lane.
#[inline]
#[target_feature(enable = "avx2")]
fn signs_pm1(s: u32) -> __m256i {
    spread_signs(_mm256_set1_epi32(s as i32), rep8(0, 1, 2, 3))
}

/// IQ1 weights `8 g + delta` from grid rows `g` (i8 -1/0/1) and per-8 deltas `dl` (+-1 bytes).
#[inline]
#[target_feature(enable = "avx2")]
fn iq1_weights(g: __m256i, dl: __m256i) -> (__m256i, __m256i) {
    let w = _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), g), dl);
    (_mm256_abs_epi8(w), w)
}

/// Generates `$name::<N>(row, ys)`: IQ row . N Q8_K rows, with `$d(block)` the block's f16
/// scale bits and `$sub(block, ib)` the decode of sub-blocks `ib` and `ib + 1`.
macro_rules! iq_kernel {
    ($name:ident, $bytes:expr, $d:ident, $sub:ident, $mul:expr) => {
        iq_kernel!($name, $bytes, $d, $sub, $mul, "avx2,fma,f16c");
    };
    ($name:ident, $bytes:expr, $d:ident, $sub:ident, $mul:expr, $features:literal) => {
        /// IQ row . N Q8_K rows (see the module docs).
        #[target_feature(enable = $features)]
        pub(crate) fn $name<const N: usize>(row: &[u8], ys: [&[BlockQ8K]; N]) -> [f32; N] {
            let tab = crate::formats::f16_table();
            let mut out = [0.0f32; N];
            let (blocks, _) = row.as_chunks::<{ $bytes }>();
            for (i, b) in blocks.iter().enumerate() {
                let d = tab[$d(b) as usize];
                let mut acc = [_mm256_setzero_si256(); N];
                for ib in (0..8).step_by(2) {
                    let ((mag0, sgn0, sc0), (mag1, sgn1, sc1)) = $sub(b, ib);
                    for t in 0..N {
                        let y0 = _mm256_sign_epi8(ld_y(&ys[t][i].qs, ib), sgn0);
                        let y1 = _mm256_sign_epi8(ld_y(&ys[t][i].qs, ib + 1), sgn1);
                        let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(mag0, y0), sc0);
                        let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(mag1, y1), sc1);
                        acc[t] = _mm256_add_epi32(acc[t], _mm256_add_epi32(p0, p1));
                    }
                }
                for t in 0..N {
                    let isum = hsum_i32(acc[t]);
                    out[t] += (d * ys[t][i].d) * isum as f32 * $mul;
                }
            }
            out
        }
    };
}

#[inline(always)]
fn d_at0(b: &[u8]) -> u16 {
    u16_at(b, 0)
}

#[inline(always)]
fn d_iq1m(b: &[u8]) -> u16 {
    iq1m_d_bits(&b[48..56])
}

#[inline]
#[target_feature(enable = "avx2")]
fn sub_iq2s(b: &[u8; IQ2_S_BYTES], ib: usize) -> Sub {
    let qs = u32_at(b, 2 + 4 * ib) as usize;
    let qh = b[66 + ib] as usize;
    let g = |l: usize| IQ2S_GRID[((qs >> (8 * l)) & 0xFF) | (((qh >> (2 * l)) & 3) << 8)];
    let sc = b[74 + ib] as u32;
    (
        rows4(g(0), g(1), g(2), g(3)),
        signs_pm1(u32_at(b, 34 + 4 * ib)),
        mults(sc & 0x0F, sc >> 4),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
fn sub_iq3s(b: &[u8; IQ3_S_BYTES], ib: usize) -> Sub {
    let p = 2 + 8 * ib;
    let qh = b[66 + ib] as usize;
    let g = |k: usize| IQ3S_GRID[b[p + k] as usize | (((qh >> k) & 1) << 8)] as i32;
    let ls = ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F) as u32;
    (
        _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0)),
        signs_pm1(u32_at(b, 74 + 4 * ib)),
        mults(ls, ls),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
fn sub_iq1s(b: &[u8; IQ1_S_BYTES], ib: usize) -> Sub {
    let qs = u32_at(b, 2 + 4 * ib) as usize;
    let qh = u16_at(b, 34 + 2 * ib) as usize;
    let g = |l: usize| IQ1S_GRID[((qs >> (8 * l)) & 0xFF) | (((qh >> (3 * l)) & 7) << 8)];
    let delta = if qh & 0x8000 != 0 { -1 } else { 1 };
    let ls = ((qh >> 12) & 7) as u32;
    let (mag, w) = iq1_weights(rows4(g(0), g(1), g(2), g(3)), _mm256_set1_epi8(delta));
    (mag, w, mults(ls, ls))
}

#[inline]
#[target_feature(enable = "avx2")]
fn sub_iq1m(b: &[u8; IQ1_M_BYTES], ib: usize) -> Sub {
    // 8-element group l of this sub-block: index bits and delta sign in nibble l of qh.
    let qs = u32_at(b, 4 * ib) as usize;
    let qh = u16_at(b, 32 + 2 * ib) as usize;
    let g = |l: usize| IQ1S_GRID[((qs >> (8 * l)) & 0xFF) | (((qh >> (4 * l)) & 7) << 8)];
    // Delta bytes 1 - 2 * bit, bit = bit 3 of nibble l, spread over qword l.
    let bits = _mm256_and_si256(
        _mm256_srlv_epi64(
            _mm256_set1_epi64x(qh as i64),
            _mm256_setr_epi64x(3, 7, 11, 15),
        ),
        _mm256_set1_epi64x(1),
    );
    let bits = _mm256_shuffle_epi8(
        bits,
        _mm256_setr_epi64x(0, 0x0808_0808_0808_0808, 0, 0x0808_0808_0808_0808),
    );
    let dl = _mm256_sub_epi8(_mm256_set1_epi8(1), _mm256_add_epi8(bits, bits));
    let w = u16_at(b, 48 + 2 * (ib / 2)) as u32;
    let sh = 6 * (ib % 2);
    let (mag, wq) = iq1_weights(rows4(g(0), g(1), g(2), g(3)), dl);
    (mag, wq, mults((w >> sh) & 7, (w >> (sh + 3)) & 7))
}

/// `$pair(block, ib)`: sub-blocks `ib` and `ib + 1` of a format decoded one at a time.
macro_rules! pair_of {
    ($pair:ident, $sub:ident, $bytes:expr) => {
        #[inline]
        #[target_feature(enable = "avx2")]
        fn $pair(b: &[u8; $bytes], ib: usize) -> (Sub, Sub) {
            ($sub(b, ib), $sub(b, ib + 1))
        }
    };
}
pair_of!(pair_iq2s, sub_iq2s, IQ2_S_BYTES);
pair_of!(pair_iq3s, sub_iq3s, IQ3_S_BYTES);
pair_of!(pair_iq1s, sub_iq1s, IQ1_S_BYTES);
pair_of!(pair_iq1m, sub_iq1m, IQ1_M_BYTES);

/// Adds the `ksigns` parity bit (bit 7) to 7-bit sign fields: every byte of `f` is a field
/// (or 0). parity(7 bits) = parity(low nibble ^ high 3 bits), looked up per byte.
#[inline]
#[target_feature(enable = "avx2")]
fn with_parity(f: __m256i) -> __m256i {
    let nib = _mm256_and_si256(
        _mm256_xor_si256(f, _mm256_srli_epi16::<4>(f)),
        _mm256_set1_epi8(0x0F),
    );
    let parity_tab = _mm256_setr_epi8(
        0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0, 0, -128, -128, 0,
        -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0,
    );
    _mm256_or_si256(f, _mm256_shuffle_epi8(parity_tab, nib))
}

/// +-1 bytes from sign bytes: element `e` gets bit `e % 8` of the byte (of its own 128-bit
/// lane of `full`) that `idx` names for it (`idx` is a `vpshufb` control).
#[inline]
#[target_feature(enable = "avx2")]
fn spread_signs(full: __m256i, idx: __m256i) -> __m256i {
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let s = _mm256_and_si256(_mm256_shuffle_epi8(full, idx), bit);
    _mm256_or_si256(_mm256_cmpeq_epi8(s, bit), _mm256_set1_epi8(1))
}

/// `vpshufb` control repeating byte `a` 8 times, then `b`, `c`, `d` (lane 1: `c`, `d`).
#[inline]
#[target_feature(enable = "avx2")]
fn rep8(a: u8, b: u8, c: u8, d: u8) -> __m256i {
    let r = |x: u8| (x as u64 * 0x0101_0101_0101_0101) as i64;
    _mm256_setr_epi64x(r(a), r(b), r(c), r(d))
}

/// The +-1 signs of two sub-blocks from their `ksigns` words `a0`, `a1`, given as
/// `v = [a0, a0, a1, a1]` in both 128-bit lanes: each 7-bit field goes to the low byte of
/// its own dword (lane 0: fields 0, 1; lane 1: fields 2, 3), gets its parity bit, and is
/// spread over its 8 elements.
#[inline]
#[target_feature(enable = "avx2")]
fn ksigns_pair(v: __m256i) -> (__m256i, __m256i) {
    let f = _mm256_and_si256(
        _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 7, 0, 7, 14, 21, 14, 21)),
        _mm256_set1_epi32(127),
    );
    let full = with_parity(f);
    (
        spread_signs(full, rep8(0, 4, 0, 4)),
        spread_signs(full, rep8(8, 12, 8, 12)),
    )
}

/// 16 bytes of `b` from `at` as a vector.
#[inline]
#[target_feature(enable = "avx2")]
fn ld128_at(b: &[u8], at: usize) -> __m128i {
    let p: &[u8; 16] = b[at..at + 16].try_into().expect("in bounds");
    // SAFETY: `p` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn pair_iq2xxs(b: &[u8; IQ2_XXS_BYTES], ib: usize) -> (Sub, Sub) {
    let p = 2 + 8 * ib;
    // dwords [idx0, aux0, idx1, aux1] -> [aux0, aux0, aux1, aux1] in both lanes.
    let raw = _mm_shuffle_epi32::<0b1111_0101>(ld128_at(b, p));
    let (s0, s1) = ksigns_pair(_mm256_set_m128i(raw, raw));
    let q0 = u64_at(b, p);
    let q1 = u64_at(b, p + 8);
    let g = |q: u64, l: usize| IQ2XXS_GRID[((q >> (8 * l)) & 0xFF) as usize];
    let (l0, l1) = ((q0 >> 60) as u32, (q1 >> 60) as u32);
    (
        (
            rows4(g(q0, 0), g(q0, 1), g(q0, 2), g(q0, 3)),
            s0,
            mults(l0, l0),
        ),
        (
            rows4(g(q1, 0), g(q1, 1), g(q1, 2), g(q1, 3)),
            s1,
            mults(l1, l1),
        ),
    )
}

/// The 8 IQ3_XXS grid rows (4 bytes each) indexed by `b[p..p + 8]`.
#[inline]
#[target_feature(enable = "avx2")]
fn iq3xxs_rows(b: &[u8], p: usize) -> __m256i {
    let g = |k: usize| IQ3XXS_GRID[b[p + k] as usize] as i32;
    _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0))
}

#[inline]
#[target_feature(enable = "avx2")]
fn pair_iq2xs(b: &[u8; IQ2_XS_BYTES], ib: usize) -> (Sub, Sub) {
    let p = 2 + 8 * ib;
    // 8 u16 = 9-bit grid index | 7-bit ksigns index << 9; the fields in the low bytes.
    let v = ld128_at(b, p);
    let full = with_parity(_mm256_srli_epi16::<9>(_mm256_set_m128i(v, v)));
    let (q0, q1) = (u64_at(b, p), u64_at(b, p + 8));
    let g = |q: u64, l: usize| IQ2XS_GRID[((q >> (16 * l)) & 511) as usize];
    let (sc0, sc1) = (b[66 + ib] as u32, b[67 + ib] as u32);
    (
        (
            rows4(g(q0, 0), g(q0, 1), g(q0, 2), g(q0, 3)),
            spread_signs(full, rep8(0, 2, 4, 6)),
            mults(sc0 & 0x0F, sc0 >> 4),
        ),
        (
            rows4(g(q1, 0), g(q1, 1), g(q1, 2), g(q1, 3)),
            spread_signs(full, rep8(8, 10, 12, 14)),
            mults(sc1 & 0x0F, sc1 >> 4),
        ),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
fn pair_iq3xxs(b: &[u8; IQ3_XXS_BYTES], ib: usize) -> (Sub, Sub) {
    let a = u64_at(b, 66 + 4 * ib);
    // [aux0, aux1, ..] -> [aux0, aux0, aux1, aux1] in both lanes.
    let raw = _mm_shuffle_epi32::<0b0101_0000>(_mm_cvtsi64_si128(a as i64));
    let (s0, s1) = ksigns_pair(_mm256_set_m128i(raw, raw));
    let p = 2 + 8 * ib;
    let (l0, l1) = ((a >> 28) as u32 & 0xF, (a >> 60) as u32);
    (
        (iq3xxs_rows(b, p), s0, mults(l0, l0)),
        (iq3xxs_rows(b, p + 8), s1, mults(l1, l1)),
    )
}

iq_kernel!(dot_iq2xxs, IQ2_XXS_BYTES, d_at0, pair_iq2xxs, 0.125);
iq_kernel!(dot_iq2xs, IQ2_XS_BYTES, d_at0, pair_iq2xs, 0.125);
iq_kernel!(dot_iq2s, IQ2_S_BYTES, d_at0, pair_iq2s, 0.125);
iq_kernel!(dot_iq3xxs, IQ3_XXS_BYTES, d_at0, pair_iq3xxs, 0.25);
iq_kernel!(dot_iq3s, IQ3_S_BYTES, d_at0, pair_iq3s, 1.0);
iq_kernel!(dot_iq1s, IQ1_S_BYTES, d_at0, pair_iq1s, 0.125);
iq_kernel!(dot_iq1m, IQ1_M_BYTES, d_iq1m, pair_iq1m, 0.125);

// The same kernels compiled for the AVX-512 tier (EVEX encodings, 32 vector registers).
iq_kernel!(
    dot512_iq2xxs,
    IQ2_XXS_BYTES,
    d_at0,
    pair_iq2xxs,
    0.125,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl"
);
iq_kernel!(
    dot512_iq2xs,
    IQ2_XS_BYTES,
    d_at0,
    pair_iq2xs,
    0.125,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl"
);
iq_kernel!(
    dot512_iq1s,
    IQ1_S_BYTES,
    d_at0,
    pair_iq1s,
    0.125,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl"
);
iq_kernel!(
    dot512_iq1m,
    IQ1_M_BYTES,
    d_iq1m,
    pair_iq1m,
    0.125,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl"
);
