//! Register-blocked matmul for Q2_K / Q3_K / Q4_K / Q5_K / Q6_K weights (Q8_K activations),
//! AVX2 and AVX-512.
//!
//! Owns: [`PackedQ8K`] (one token's Q8_K activations with the pair sums of their block sums
//! precomputed), the decode of a few weight rows once per matmul into unsigned quants in
//! element order plus their scales ([`DecodedK`]), and the 2 rows x 4 tokens tile kernels
//! of both tiers. Q5_K decodes to quants 0..=31 and runs Q4_K's tiles; Q3_K decodes to
//! `q + 4` (0..=7) and runs Q6_K's with the offset 4 instead of 32; Q2_K runs Q6_K's
//! 16-element scales without an offset plus its own 16 mins. Bit-identical to the
//! single-row kernels of the same tier (`avx2::dot_q4k` / `dot_q6k`, `avx512::dot_q4k` /
//! `dot_q6k`, which are equal to each other; `kquants::dot_q5k` / `dot_q3k` / `dot_q2k`, the Q4_K / Q6_K schemes): for each
//! (row, token, block) the i32 lanes are the same exact integers (integer sums are exact,
//! so their order does not matter), then converted to f32, multiplied by the same f32
//! products (`dy * d`, `-dy * dmin`) and FMA'd into that pair's accumulators in block
//! order, summed with the same `hsum8` / `hsum4` at the end. Each weight block is decoded
//! once per matmul instead of once per token tile, and each activation load serves 2 rows.

use core::arch::x86_64::*;

use super::avx2::{hsum4, hsum8, k4_block_head, ld256, ld256_i16, ld256_i8, q6k_half};
use super::avx2::{sub, K4_SHUF, K6_SHUF};
use super::avx512::{ld512_i8, Q4_SC_IDX, Q6_SC_IDX};
use super::kquants::{q3k_group, q3k_signed_scales, q5k_pair, srl16};
use super::q8gemm::st256;
use crate::formats::{BlockQ8K, Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K};
use crate::{GgmlType, RowsOut};

/// One activation block for the tile kernels.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct PackedKBlock {
    qs: [i8; QK_K],
    /// Sums of each 16 consecutive quants (Q6_K's offset correction).
    bsums: [i16; 16],
    /// `bsums[2k] + bsums[2k + 1]`: sums of each 32 quants (Q4_K's mins).
    q8s: [i16; 8],
    d: f32,
}

/// One token's Q8_K activations prepared for the tile kernels.
#[derive(Clone, Debug)]
pub(crate) struct PackedQ8K {
    blocks: Vec<PackedKBlock>,
}

impl PackedQ8K {
    /// Pack Q8_K blocks (from `quantize_row_q8_k`).
    pub(crate) fn new(blocks: &[BlockQ8K]) -> PackedQ8K {
        PackedQ8K {
            blocks: blocks
                .iter()
                .map(|b| PackedKBlock {
                    qs: b.qs,
                    bsums: b.bsums,
                    // As `_mm_hadd_epi16` of the two halves (wrapping; |sum| <= 32 * 128).
                    q8s: core::array::from_fn(|k| b.bsums[2 * k].wrapping_add(b.bsums[2 * k + 1])),
                    d: b.d,
                })
                .collect(),
        }
    }
}

/// One decoded weight block: the 256 unsigned quants in element order and the scales in
/// the forms the kernels use.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct KBlock {
    u: [u8; QK_K],
    /// Per-group scales as i32 lanes for `vpdpwssd` (Q4_K: 8 scales 0..=63 in lanes 0..7;
    /// Q6_K: 16 signed scales with the high i16 of each lane zero).
    sc32: [i32; 16],
    /// Per-group scales as i16 (Q4_K: the 8 scales twice, one copy per 128-bit lane;
    /// Q6_K: the 16 scales).
    sc16: [i16; 16],
    /// Q4_K mins as i16.
    mins: [i16; 8],
    /// Q2_K's 16 mins (one per 16 elements) as i16.
    mins16: [i16; 16],
    d: f32,
    dmin: f32,
    /// The AVX2 tile's scale vector of each 32-element group (Q4_K: that group's scale in
    /// all 16 lanes; Q6_K: the first 16 elements' scale in the low 8 lanes, the next 16's in
    /// the high 8), filled only for the AVX2 tier: loaded instead of shuffled in the tile.
    scg: [[i16; 16]; 8],
}

const ZERO_BLOCK: KBlock = KBlock {
    u: [0; QK_K],
    sc32: [0; 16],
    sc16: [0; 16],
    mins: [0; 8],
    mins16: [0; 16],
    d: 0.0,
    dmin: 0.0,
    scg: [[0; 16]; 8],
};

/// A few weight rows decoded for the tile kernels, `[row][block]`.
pub(crate) struct DecodedK {
    blocks: Vec<KBlock>,
    nb: usize,
}

impl DecodedK {
    pub(crate) fn new(nb: usize, max_rows: usize) -> DecodedK {
        DecodedK {
            blocks: vec![ZERO_BLOCK; nb * max_rows],
            nb,
        }
    }

    /// Blocks per row this scratch was made for.
    pub(crate) fn nb(&self) -> usize {
        self.nb
    }
}

/// A Q4_K / Q5_K block's header (d, dmin, scales and mins) into `o`; returns the 8 scales
/// and 8 mins as bytes (low / high 64 bits).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_head_into(b: &[u8], tab: &[f32; 65536], o: &mut KBlock) -> __m128i {
    let (d, dmin, v) = k4_block_head(b, tab);
    (o.d, o.dmin) = (d, dmin);
    let sc16 = _mm_cvtepu8_epi16(v);
    st_i32x8(&mut o.sc32, 0, _mm256_cvtepu8_epi32(v));
    st_i32x8(&mut o.sc32, 8, _mm256_setzero_si256());
    st_i16x8(&mut o.sc16, 0, sc16);
    st_i16x8(&mut o.sc16, 8, sc16);
    st_i16x8(&mut o.mins, 0, _mm_cvtepu8_epi16(_mm_srli_si128::<8>(v)));
    v
}

/// The AVX2 tile's per-group scale vectors of a Q4_K / Q5_K block (`v` from
/// [`k4_head_into`]): group g's scale in all 16 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn k4_group_scales(v: __m128i, o: &mut KBlock) {
    let sc16 = _mm_cvtepu8_epi16(v);
    let sc = _mm256_set_m128i(sc16, sc16);
    for (g, dst) in o.scg.iter_mut().enumerate() {
        st_i16x16(dst, _mm256_shuffle_epi8(sc, ld256(&K4_SHUF[g])));
    }
}

/// A Q6_K / Q3_K / Q2_K block's 16 scales (`sc8`, one byte each) into `o`: as i16, as i32
/// lanes whose high i16 is zero (for `vpdpwssd`), and (`AVX2_SCALES`) the AVX2 tile's
/// per-group vectors (the first 16 elements' scale in the low lane, the next 16's in the
/// high lane). No mins.
#[inline]
#[target_feature(enable = "avx2")]
fn signed16_scales<const AVX2_SCALES: bool>(sc8: __m128i, o: &mut KBlock) {
    o.dmin = 0.0;
    o.mins = [0; 8];
    let low16 = _mm256_set1_epi32(0xFFFF);
    st_i16x16(&mut o.sc16, _mm256_cvtepi8_epi16(sc8));
    st_i32x8(
        &mut o.sc32,
        0,
        _mm256_and_si256(_mm256_cvtepi8_epi32(sc8), low16),
    );
    st_i32x8(
        &mut o.sc32,
        8,
        _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc8)), low16),
    );
    if AVX2_SCALES {
        let sc = _mm256_cvtepi8_epi16(sc8);
        let lanes = [
            _mm256_permute2x128_si256::<0x00>(sc, sc),
            _mm256_permute2x128_si256::<0x11>(sc, sc),
        ];
        for (g, dst) in o.scg.iter_mut().enumerate() {
            st_i16x16(
                dst,
                _mm256_shuffle_epi8(lanes[g / 4], ld256(&K6_SHUF[g % 4])),
            );
        }
    }
}

/// Decode `rows` (whole rows of `ty`, Q2_K to Q6_K) into `dst` rows 0.. ; `AVX2_SCALES`:
/// also the AVX2 tile's per-group scale vectors ([`KBlock::scg`]).
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_rows<const AVX2_SCALES: bool>(ty: GgmlType, rows: &[u8], dst: &mut DecodedK) {
    let tab = crate::formats::f16_table();
    if ty == GgmlType::Q5_K {
        // Q4_K's header and scales; quants 0..=31 (as `kquants::dot_q5k`).
        let (blocks, _) = rows.as_chunks::<Q5_K_BYTES>();
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            let v = k4_head_into(b, tab, o);
            if AVX2_SCALES {
                k4_group_scales(v, o);
            }
            let qh = ld256(sub::<32, u8>(b, 16));
            for j in 0..4 {
                let [ql, qhi] = q5k_pair(b, qh, j);
                let (lo, hi) = o.u[64 * j..64 * j + 64].split_at_mut(32);
                st256(lo.try_into().expect("32"), ql);
                st256(hi.try_into().expect("32"), qhi);
            }
        }
    } else if ty == GgmlType::Q4_K {
        let m4 = _mm256_set1_epi8(0x0F);
        let (blocks, _) = rows.as_chunks::<Q4_K_BYTES>();
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            let v = k4_head_into(b, tab, o);
            if AVX2_SCALES {
                k4_group_scales(v, o);
            }
            for j in 0..4 {
                let q4 = ld256(sub::<32, u8>(b, 16 + 32 * j));
                let (lo, hi) = o.u[64 * j..64 * j + 64].split_at_mut(32);
                st256(lo.try_into().expect("32"), _mm256_and_si256(q4, m4));
                st256(
                    hi.try_into().expect("32"),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(q4), m4),
                );
            }
        }
    } else if ty == GgmlType::Q2_K {
        // 16 unsigned scales (low nibbles) and mins (high nibbles), one per 16 elements;
        // quants 0..=3, as `kquants::dot_q2k`.
        let m3 = _mm256_set1_epi8(3);
        let m4 = _mm_set1_epi8(0x0F);
        let (blocks, _) = rows.as_chunks::<Q2_K_BYTES>();
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            let sc8 = ld128_u8(sub::<16, u8>(b, 0));
            signed16_scales::<AVX2_SCALES>(_mm_and_si128(sc8, m4), o);
            o.d = tab[u16::from_le_bytes([b[80], b[81]]) as usize];
            o.dmin = tab[u16::from_le_bytes([b[82], b[83]]) as usize];
            let mins = _mm_and_si128(_mm_srli_epi16::<4>(sc8), m4);
            st_i16x16(&mut o.mins16, _mm256_cvtepu8_epi16(mins));
            for h in 0..2 {
                let q = ld256(sub::<32, u8>(b, 16 + 32 * h));
                for k in 0..4 {
                    let off = 128 * h + 32 * k;
                    st256(
                        (&mut o.u[off..off + 32]).try_into().expect("32"),
                        _mm256_and_si256(srl16(q, 2 * k as i32), m3),
                    );
                }
            }
        }
    } else if ty == GgmlType::Q3_K {
        // 16 signed scales and unsigned quants `q + 4` (0..=7), as `kquants::dot_q3k`; the
        // tile subtracts `4 * sum sc * bsum` (shift 2).
        let (blocks, _) = rows.as_chunks::<Q3_K_BYTES>();
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            o.d = tab[u16::from_le_bytes([b[108], b[109]]) as usize];
            signed16_scales::<AVX2_SCALES>(q3k_signed_scales(b), o);
            let hm = ld256(sub::<32, u8>(b, 0));
            for h in 0..2 {
                let q = ld256(sub::<32, u8>(b, 32 + 32 * h));
                for k in 0..4 {
                    let off = 128 * h + 32 * k;
                    st256(
                        (&mut o.u[off..off + 32]).try_into().expect("32"),
                        q3k_group(q, hm, h, k),
                    );
                }
            }
        }
    } else {
        let (blocks, _) = rows.as_chunks::<Q6_K_BYTES>();
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            o.d = tab[u16::from_le_bytes([b[208], b[209]]) as usize];
            signed16_scales::<AVX2_SCALES>(ld128_u8(sub::<16, u8>(b, 192)), o);
            for h in 0..2 {
                let q = q6k_half(b, h);
                for (k, qk) in q.iter().enumerate() {
                    let off = 128 * h + 32 * k;
                    st256((&mut o.u[off..off + 32]).try_into().expect("32"), *qk);
                }
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn ld128_u8(p: &[u8; 16]) -> __m128i {
    // SAFETY: `p` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

/// Store 8 i32 lanes at `dst[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2")]
fn st_i32x8(dst: &mut [i32; 16], at: usize, v: __m256i) {
    let d: &mut [i32; 8] = (&mut dst[at..at + 8]).try_into().expect("8 lanes");
    // SAFETY: `d` is 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(d.as_mut_ptr().cast(), v) }
}

/// Store 8 i16 lanes at `dst[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2")]
fn st_i16x8<const L: usize>(dst: &mut [i16; L], at: usize, v: __m128i) {
    let d: &mut [i16; 8] = (&mut dst[at..at + 8]).try_into().expect("8 lanes");
    // SAFETY: `d` is 16 writable bytes; storeu has no alignment requirement.
    unsafe { _mm_storeu_si128(d.as_mut_ptr().cast(), v) }
}

/// Store 16 i16 lanes into `dst`.
#[inline]
#[target_feature(enable = "avx2")]
fn st_i16x16(dst: &mut [i16; 16], v: __m256i) {
    // SAFETY: `dst` is 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(dst.as_mut_ptr().cast(), v) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn ld512_u8(p: &[u8; 64]) -> __m512i {
    // SAFETY: `p` is 64 readable bytes; loadu has no alignment requirement.
    unsafe { _mm512_loadu_si512(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx512f")]
fn ld512_i32(p: &[i32; 16]) -> __m512i {
    // SAFETY: `p` is 64 readable bytes; loadu has no alignment requirement.
    unsafe { _mm512_loadu_si512(p.as_ptr().cast()) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn ld128_i16(p: &[i16; 8]) -> __m128i {
    // SAFETY: `p` is 16 readable bytes; loadu has no alignment requirement.
    unsafe { _mm_loadu_si128(p.as_ptr().cast()) }
}

/// `acc += dpwssd(dpbusd(0, u, q), scale)`: one group's scaled integer step.
///
/// Written as inline asm because with the intrinsics LLVM rewrites the `vpdpwssd` chain
/// into `vpmaddwd` + `vpaddd` and hoists every group's `vpdpbusd` of a block ahead of the
/// scaling: 32 live products for 32 registers, spilled to the stack each block (the tile
/// ran at about a third of the VNNI port's rate). The asm keeps one temporary per step and
/// the fused accumulate; the integers are the same exact sums either way.
macro_rules! vnni_scaled_step {
    ($acc:expr, $u:expr, $q:expr, $scale:expr) => {
        // SAFETY: register-only AVX-512 VNNI instructions (no memory, no stack); the
        // enclosing function enables `avx512f,avx512vnni`, which the caller guarantees.
        unsafe {
            let _scratch: __m512i;
            core::arch::asm!(
                "vpxord {t}, {t}, {t}",
                "vpdpbusd {t}, {u}, {q}",
                "vpdpwssd {acc}, {t}, {s}",
                acc = inout(zmm_reg) $acc,
                t = out(zmm_reg) _scratch,
                u = in(zmm_reg) $u,
                q = in(zmm_reg) $q,
                s = in(zmm_reg) $scale,
                options(pure, nomem, nostack, preserves_flags),
            )
        }
    };
}

/// The tiles' kinds (their `K` parameter). Q4_K / Q5_K: one scale and one min per 32
/// elements.
const K_Q4: u32 = 0;
/// Q2_K: one unsigned scale and one min per 16 elements.
const K_Q2: u32 = 1;
/// Q3_K: one signed scale per 16 elements, quants stored `+ 4`: the offset `1 << K_Q3`
/// comes back off through the block sums.
const K_Q3: u32 = 2;
/// Q6_K: as Q3_K with quants stored `+ 32` (`1 << K_Q6`).
const K_Q6: u32 = 5;

/// AVX-512 tile: `out[k][t] = row rs[k] . token t` for a pair of rows of kind `K` (`rs[1]
/// == rs[0]` when one row is left). The two rows' 8-lane float steps share 512-bit
/// registers (row 0 in the low half, row 1 in the high half): the
/// lanes get the same values as the single-row kernels' (same i32, same f32 products,
/// one FMA per lane per block).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn tile512<const K: u32, const N: usize>(
    w: &DecodedK,
    rs: [usize; 2],
    ys: [&PackedQ8K; N],
) -> [[f32; N]; 2] {
    let nb = w.nb;
    // Plain slicing (no array `map` / `from_fn` closures: those stay calls here).
    let rows: [&[KBlock]; 2] = [&w.blocks[rs[0] * nb..][..nb], &w.blocks[rs[1] * nb..][..nb]];
    let mut ysl: [&[PackedKBlock]; N] = [&[]; N];
    for t in 0..N {
        ysl[t] = &ys[t].blocks[..nb];
    }
    let ys = ysl;
    let idx = if K == K_Q4 { &Q4_SC_IDX } else { &Q6_SC_IDX };
    let mut acc = [_mm512_setzero_ps(); N];
    let mut accm = [_mm256_setzero_ps(); N];
    // Q2_K's mins term, 8 lanes per row.
    let mut accm2 = [_mm512_setzero_ps(); N];
    for i in 0..nb {
        let kb = [&rows[0][i], &rows[1][i]];
        let mut sumi = [[_mm512_setzero_si512(); N]; 2];
        for (g, ix) in idx.iter().enumerate() {
            // SAFETY: `ix` is 16 readable i32; loadu has no alignment requirement.
            let ix = unsafe { _mm512_loadu_si512(ix.as_ptr().cast()) };
            let q8: [__m512i; N] =
                core::array::from_fn(|t| ld512_i8(sub::<64, i8>(&ys[t][i].qs, 64 * g)));
            for (k, sr) in sumi.iter_mut().enumerate() {
                let u = ld512_u8(sub::<64, u8>(&kb[k].u, 64 * g));
                let scale = _mm512_permutexvar_epi32(ix, ld512_i32(&kb[k].sc32));
                for t in 0..N {
                    vnni_scaled_step!(sr[t], u, q8[t], scale);
                }
            }
        }
        // [d0; 8] ++ [d1; 8], and the same for dmin ([4] ++ [4]) and the i16 scales / mins.
        let dv = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(kb[0].d))),
            _mm256_castps_pd(_mm256_set1_ps(kb[1].d)),
        ));
        let dminv = _mm256_set_m128(_mm_set1_ps(kb[1].dmin), _mm_set1_ps(kb[0].dmin));
        let minsv = _mm256_set_m128i(ld128_i16(&kb[1].mins), ld128_i16(&kb[0].mins));
        let sc16v = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(ld256_i16(&kb[0].sc16)),
            ld256_i16(&kb[1].sc16),
        );
        // Q2_K: the two rows' 16 mins and [dmin0; 8] ++ [dmin1; 8].
        let m16v = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(ld256_i16(&kb[0].mins16)),
            ld256_i16(&kb[1].mins16),
        );
        let dminv2 = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
            _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(kb[0].dmin))),
            _mm256_castps_pd(_mm256_set1_ps(kb[1].dmin)),
        ));
        for t in 0..N {
            let yb = &ys[t][i];
            // The two rows' `fold`s: low 256 bits + high 256 bits of each.
            let lo = _mm512_shuffle_i64x2::<0x44>(sumi[0][t], sumi[1][t]);
            let hi = _mm512_shuffle_i64x2::<0xEE>(sumi[0][t], sumi[1][t]);
            let mut s = _mm512_add_epi32(lo, hi);
            if K == K_Q2 {
                let bs = _mm512_broadcast_i64x4(ld256_i16(&yb.bsums));
                let prod = _mm512_madd_epi16(m16v, bs);
                let mm = _mm512_mul_ps(_mm512_set1_ps(-yb.d), dminv2);
                accm2[t] = _mm512_fmadd_ps(mm, _mm512_cvtepi32_ps(prod), accm2[t]);
            } else if K != K_Q4 {
                let bs = _mm512_broadcast_i64x4(ld256_i16(&yb.bsums));
                let c = _mm512_madd_epi16(sc16v, bs);
                s = _mm512_sub_epi32(s, _mm512_slli_epi32::<K>(c));
            } else {
                let q8s = _mm256_broadcastsi128_si256(ld128_i16(&yb.q8s));
                let prod = _mm256_madd_epi16(minsv, q8s);
                let mm = _mm256_mul_ps(_mm256_set1_ps(-yb.d), dminv);
                accm[t] = _mm256_fmadd_ps(mm, _mm256_cvtepi32_ps(prod), accm[t]);
            }
            let dd = _mm512_mul_ps(_mm512_set1_ps(yb.d), dv);
            acc[t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), acc[t]);
        }
    }
    let mut out = [[0.0f32; N]; 2];
    for t in 0..N {
        let a0 = _mm512_castps512_ps256(acc[t]);
        let a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[t])));
        if K == K_Q2 {
            let m0 = _mm512_castps512_ps256(accm2[t]);
            let m1 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(accm2[t])));
            out[0][t] = hsum8(a0) + hsum8(m0);
            out[1][t] = hsum8(a1) + hsum8(m1);
        } else if K != K_Q4 {
            out[0][t] = hsum8(a0);
            out[1][t] = hsum8(a1);
        } else {
            out[0][t] = hsum8(a0) + hsum4(_mm256_castps256_ps128(accm[t]));
            out[1][t] = hsum8(a1) + hsum4(_mm256_extractf128_ps::<1>(accm[t]));
        }
    }
    out
}

/// `acc += madd(maddubs(u, q), scale)`: [`vnni_scaled_step`] for the AVX2 tier, in asm
/// for the same reason (with the intrinsics LLVM reassociates the adds across the unrolled
/// groups and spills; the AVX2 tier has only 16 registers). The scale vectors come ready
/// from `decode_rows` (`KBlock::scg`), so no shuffle competes for registers in the loop.
/// Exact integers either way.
macro_rules! maddubs_scaled_step {
    ($acc:expr, $u:expr, $q:expr, $scale:expr) => {
        // SAFETY: register-only AVX2 instructions (no memory, no stack); the enclosing
        // function enables `avx2`, which the caller guarantees.
        unsafe {
            let _scratch: __m256i;
            core::arch::asm!(
                "vpmaddubsw {t}, {u}, {q}",
                "vpmaddwd {t}, {t}, {s}",
                "vpaddd {acc}, {acc}, {t}",
                acc = inout(ymm_reg) $acc,
                t = out(ymm_reg) _scratch,
                u = in(ymm_reg) $u,
                q = in(ymm_reg) $q,
                s = in(ymm_reg) $scale,
                options(pure, nomem, nostack, preserves_flags),
            )
        }
    };
}

/// AVX2 tile: as [`tile512`] with `vpmaddubsw` + `vpmaddwd` (the AVX2 kernels' steps).
#[target_feature(enable = "avx2,fma,f16c")]
fn tile256<const K: u32, const R: usize, const N: usize>(
    w: &DecodedK,
    r0: usize,
    ys: [&PackedQ8K; N],
) -> [[f32; N]; R] {
    let nb = w.nb;
    let rows: [&[KBlock]; R] = core::array::from_fn(|r| &w.blocks[(r0 + r) * nb..][..nb]);
    let ys: [&[PackedKBlock]; N] = core::array::from_fn(|t| &ys[t].blocks[..nb]);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut accm = [[_mm_setzero_ps(); N]; R];
    // Q2_K's mins term (8 lanes).
    let mut accm2 = [[_mm256_setzero_ps(); N]; R];
    for i in 0..nb {
        let mut sumi = [[_mm256_setzero_si256(); N]; R];
        // Eight 32-element groups; group g's scale vector was laid out by `decode_rows`
        // (Q4_K one scale per group, Q6_K one per 16 elements).
        for g in 0..8 {
            let q8: [__m256i; N] =
                core::array::from_fn(|t| ld256_i8(sub::<32, i8>(&ys[t][i].qs, 32 * g)));
            for (r, sr) in sumi.iter_mut().enumerate() {
                let kb = &rows[r][i];
                let u = ld256(sub::<32, u8>(&kb.u, 32 * g));
                let scale = ld256_i16(&kb.scg[g]);
                for t in 0..N {
                    maddubs_scaled_step!(sr[t], u, q8[t], scale);
                }
            }
        }
        for r in 0..R {
            let kb = &rows[r][i];
            for t in 0..N {
                let yb = &ys[t][i];
                let mut s = sumi[r][t];
                if K == K_Q2 {
                    let prod = _mm256_madd_epi16(ld256_i16(&kb.mins16), ld256_i16(&yb.bsums));
                    accm2[r][t] = _mm256_fmadd_ps(
                        _mm256_set1_ps(-yb.d * kb.dmin),
                        _mm256_cvtepi32_ps(prod),
                        accm2[r][t],
                    );
                } else if K != K_Q4 {
                    let c = _mm256_madd_epi16(ld256_i16(&kb.sc16), ld256_i16(&yb.bsums));
                    s = _mm256_sub_epi32(s, _mm256_sll_epi32(c, _mm_cvtsi32_si128(K as i32)));
                } else {
                    let prod = _mm_madd_epi16(ld128_i16(&kb.mins), ld128_i16(&yb.q8s));
                    accm[r][t] = _mm_fmadd_ps(
                        _mm_set1_ps(-yb.d * kb.dmin),
                        _mm_cvtepi32_ps(prod),
                        accm[r][t],
                    );
                }
                let dd = _mm256_set1_ps(yb.d * kb.d);
                acc[r][t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc[r][t]);
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for r in 0..R {
        for t in 0..N {
            out[r][t] = match K {
                K_Q2 => hsum8(acc[r][t]) + hsum8(accm2[r][t]),
                K_Q4 => hsum8(acc[r][t]) + hsum4(accm[r][t]),
                _ => hsum8(acc[r][t]),
            };
        }
    }
    out
}

/// Tokens per tile.
pub(crate) const KTN: usize = 4;
/// Weight rows decoded at a time (tiles take 2 of them).
pub(crate) const KTR: usize = 4;

/// `W[r] . token t` for the rows in `w` (whole rows of `ty`, Q2_K to Q6_K, `rb` bytes each,
/// `out.rows()` of them), put into `out`; `scratch` holds at least `KTR` decoded rows.
/// `wide`: the AVX-512 tiles (up to 4 rows), else the AVX2 ones (up to 2 rows).
///
/// # Safety
/// The CPU must have the AVX2 tier, and the AVX-512 one when `wide`.
unsafe fn matmul_k_rows(
    wide: bool,
    ty: GgmlType,
    w: &[u8],
    rb: usize,
    acts: &[PackedQ8K],
    scratch: &mut DecodedK,
    out: &mut impl RowsOut,
) {
    let kind = match ty {
        GgmlType::Q6_K => K_Q6,
        GgmlType::Q3_K => K_Q3,
        GgmlType::Q2_K => K_Q2,
        _ => K_Q4,
    };
    let rmax = 2;
    let nrows = out.rows();
    for g in 0..nrows.div_ceil(KTR) {
        let nr = (nrows - g * KTR).min(KTR);
        let rows = &w[g * KTR * rb..(g * KTR + nr) * rb];
        // SAFETY: the caller guarantees AVX2/FMA/F16C; slices only.
        unsafe {
            if wide {
                decode_rows::<false>(ty, rows, scratch)
            } else {
                decode_rows::<true>(ty, rows, scratch)
            }
        };
        // The next rows' bytes come from DRAM (an expert's matrix is read once per
        // matmul): start loading them now, while this group's tiles compute.
        let next = &w[((g + 1) * KTR * rb).min(w.len())..((g + 2) * KTR * rb).min(w.len())];
        for line in next.chunks(64) {
            // SAFETY: prefetch is a hint and never faults; the pointer is in bounds.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
        }
        let scratch = &*scratch;
        let mut r0 = 0;
        while r0 < nr {
            let rr = (nr - r0).min(rmax);
            for (tc, a) in acts.chunks(KTN).enumerate() {
                let t0 = tc * KTN;
                macro_rules! run {
                    (tile512, $q:ident, $r:literal, $($t:literal),*) => {{
                        let rs = [r0, if rr == 2 { r0 + 1 } else { r0 }];
                        // SAFETY: the caller guarantees the tile's features; the tile reads
                        // only through the slices it is given.
                        let o = unsafe {
                            tile512::<$q, { [$($t),*].len() }>(scratch, rs, [$(&a[$t]),*])
                        };
                        for (r, orow) in o.iter().take(rr).enumerate() {
                            out.put(g * KTR + r0 + r, t0, orow);
                        }
                    }};
                    ($tile:ident, $q:ident, $r:literal, $($t:literal),*) => {{
                        // SAFETY: the caller guarantees the tile's features; the tile reads
                        // only through the slices it is given.
                        let o = unsafe {
                            $tile::<$q, $r, { [$($t),*].len() }>(scratch, r0, [$(&a[$t]),*])
                        };
                        for (r, orow) in o.iter().enumerate() {
                            out.put(g * KTR + r0 + r, t0, orow);
                        }
                    }};
                }
                macro_rules! by_tokens {
                    ($tile:ident, $q:ident, $r:literal) => {
                        match a.len() {
                            1 => run!($tile, $q, $r, 0),
                            2 => run!($tile, $q, $r, 0, 1),
                            3 => run!($tile, $q, $r, 0, 1, 2),
                            _ => run!($tile, $q, $r, 0, 1, 2, 3),
                        }
                    };
                }
                match (wide, kind, rr) {
                    (true, K_Q6, _) => by_tokens!(tile512, K_Q6, 2),
                    (true, K_Q3, _) => by_tokens!(tile512, K_Q3, 2),
                    (true, K_Q2, _) => by_tokens!(tile512, K_Q2, 2),
                    (true, _, _) => by_tokens!(tile512, K_Q4, 2),
                    (false, K_Q6, 1) => by_tokens!(tile256, K_Q6, 1),
                    (false, K_Q6, _) => by_tokens!(tile256, K_Q6, 2),
                    (false, K_Q3, 1) => by_tokens!(tile256, K_Q3, 1),
                    (false, K_Q3, _) => by_tokens!(tile256, K_Q3, 2),
                    (false, K_Q2, 1) => by_tokens!(tile256, K_Q2, 1),
                    (false, K_Q2, _) => by_tokens!(tile256, K_Q2, 2),
                    (false, _, 1) => by_tokens!(tile256, K_Q4, 1),
                    (false, _, _) => by_tokens!(tile256, K_Q4, 2),
                }
            }
            r0 += rr;
        }
    }
}

impl super::Avx2 {
    /// Q2_K to Q6_K rows x tokens on the AVX2 tier (see [`matmul_k_rows`]).
    pub(crate) fn matmul_k_rows(
        self,
        ty: GgmlType,
        w: &[u8],
        rb: usize,
        acts: &[PackedQ8K],
        scratch: &mut DecodedK,
        out: &mut impl RowsOut,
    ) {
        // SAFETY: the token proves the AVX2 tier.
        unsafe { matmul_k_rows(false, ty, w, rb, acts, scratch, out) }
    }
}

impl super::Avx512 {
    /// Q2_K to Q6_K rows x tokens on the AVX-512 tier (see [`matmul_k_rows`]).
    pub(crate) fn matmul_k_rows(
        self,
        ty: GgmlType,
        w: &[u8],
        rb: usize,
        acts: &[PackedQ8K],
        scratch: &mut DecodedK,
        out: &mut impl RowsOut,
    ) {
        // SAFETY: the token proves the AVX-512 tier (and AVX2 with it).
        unsafe { matmul_k_rows(true, ty, w, rb, acts, scratch, out) }
    }
}
