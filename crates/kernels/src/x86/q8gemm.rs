//! Register-blocked matmul for Q8_0-activation weights: the 32-element block formats on the
//! AVX-512 tier (VNNI), Q5_0 and Q4_0 on the AVX2 tier (`maddubs`, see [`tile_avx2`]).
//!
//! Owns: [`PackedQ8`] (one token's Q8_0 activations with per-block f32 scales and offset
//! corrections), the decode of a few weight rows into unsigned bytes once per matmul, and
//! the up to 8 rows (four 512-bit row pairs) x 4 tokens tile kernel. Bit-identical to the single-row kernels: for each
//! (row, token, block) the exact i32 lane partials are the same integers (computed as
//! `sum (u - off) * qy = sum u * qy - off * sum qy` with the weight quants shifted to
//! unsigned `u = q + off`), converted to f32, multiplied by `dx * dy` rounded to f32 and
//! FMA'd into that pair's 8-lane accumulator in block order, then summed with the same
//! `hsum8` at the end.

use core::arch::x86_64::*;

use super::avx2::{decode_q5_0, decode_q8_0, hsum8, ld256, ld256_i8};
use crate::formats::{
    BlockQ8_0, IQ4_NL_BYTES, MXFP4_BYTES, Q4_0_BYTES, Q5_0_BYTES, Q8_0_BYTES, QK8_0,
};
use crate::{GgmlType, RowsOut};

/// One activation block for the tile kernel: quants, the offset correction
/// `-off * (qs[4l] + .. + qs[4l + 3])` of each i32 lane l, and the f32 scale.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(32))]
struct PackedBlock {
    qs: [i8; QK8_0],
    corr: [i32; 8],
    d: f32,
}

/// One token's Q8_0 activations prepared for the tile kernel.
#[derive(Clone, Debug)]
pub(crate) struct PackedQ8 {
    blocks: Vec<PackedBlock>,
}

/// The unsigned shift of the weight quants: Q5_0 `q + 16` (0..=31), Q4_0 `q + 8` (0..=15),
/// Q8_0 / IQ4_NL / MXFP4 `q + 128`.
fn offset(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q5_0 => 16,
        GgmlType::Q4_0 => 8,
        _ => 128,
    }
}

impl PackedQ8 {
    /// Pack Q8_0 blocks (from `quantize_row_q8_0`) for weights of type `ty`.
    pub(crate) fn new(ty: GgmlType, blocks: &[BlockQ8_0]) -> PackedQ8 {
        let tab = crate::formats::f16_table();
        let off = offset(ty);
        PackedQ8 {
            blocks: blocks
                .iter()
                .map(|b| {
                    let mut corr = [0i32; 8];
                    for (l, cl) in corr.iter_mut().enumerate() {
                        let s: i32 = b.qs[4 * l..4 * l + 4].iter().map(|&q| q as i32).sum();
                        *cl = -off * s;
                    }
                    PackedBlock {
                        qs: b.qs,
                        corr,
                        d: tab[b.d as usize],
                    }
                })
                .collect(),
        }
    }
}

/// One decoded weight block: unsigned quants `u = q + off` and the f32 scale.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct DecodedBlock {
    u: [u8; QK8_0],
    d: f32,
}

/// A few weight rows decoded for the tile kernel, `[row][block]`.
pub(crate) struct DecodedRows {
    blocks: Vec<DecodedBlock>,
    nb: usize,
}

impl DecodedRows {
    pub(crate) fn new(nb: usize, max_rows: usize) -> DecodedRows {
        DecodedRows {
            blocks: vec![
                DecodedBlock {
                    u: [0; QK8_0],
                    d: 0.0
                };
                nb * max_rows
            ],
            nb,
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn st256(p: &mut [u8; QK8_0], v: __m256i) {
    // SAFETY: `p` is 32 writable bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(p.as_mut_ptr().cast(), v) }
}

/// Decode `rows` (whole rows of `ty`, `nb` blocks each) into `dst` rows 0.. .
#[target_feature(enable = "avx2,fma,f16c")]
fn decode_rows(ty: GgmlType, rows: &[u8], dst: &mut DecodedRows) {
    let tab = crate::formats::f16_table();
    // quants-k formats (x86/kquants.rs decoders).
    macro_rules! shifted {
        ($bytes:expr, $decode:path) => {{
            let (blocks, _) = rows.as_chunks::<{ $bytes }>();
            let k = _mm256_set1_epi8(offset(ty) as u8 as i8);
            for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
                let (d, q) = $decode(b, tab);
                o.d = d;
                st256(&mut o.u, _mm256_add_epi8(q, k));
            }
            return;
        }};
    }
    match ty {
        GgmlType::Q4_0 => shifted!(Q4_0_BYTES, super::kquants::decode_q4_0),
        GgmlType::IQ4_NL => shifted!(IQ4_NL_BYTES, super::kquants::decode_iq4_nl),
        GgmlType::MXFP4 => shifted!(MXFP4_BYTES, super::kquants::decode_mxfp4),
        _ => {}
    }
    if ty == GgmlType::Q5_0 {
        let (blocks, _) = rows.as_chunks::<Q5_0_BYTES>();
        let k = _mm256_set1_epi8(16);
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            let (d, q) = decode_q5_0(b, tab);
            o.d = d;
            st256(&mut o.u, _mm256_add_epi8(q, k));
        }
    } else {
        let (blocks, _) = rows.as_chunks::<Q8_0_BYTES>();
        let k = _mm256_set1_epi8(0x80u8 as i8);
        for (b, o) in blocks.iter().zip(dst.blocks.iter_mut()) {
            let (d, q) = decode_q8_0(b, tab);
            o.d = d;
            st256(&mut o.u, _mm256_xor_si256(q, k));
        }
    }
}

/// `out[p][k][t] = row rs[p][k] . token t` for P pairs of decoded rows (a pair may name
/// one row twice). Each pair shares 512-bit registers (first row in the low half, second
/// in the high half): one `vpdpbusd` gives both rows' i32 lanes, and the float steps are
/// lane-wise the single-row kernel's.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn tile<const P: usize, const N: usize>(
    w: &DecodedRows,
    rs: [[usize; 2]; P],
    ys: [&PackedQ8; N],
) -> [[[f32; N]; 2]; P] {
    let nb = w.nb;
    // Plain loops and indexing (no array `map` / `from_fn` closures: those stay calls
    // here, and a tile is short: one call per 8 rows x 4 tokens).
    for pr in &rs {
        for &r in pr {
            assert!((r + 1) * nb <= w.blocks.len(), "decoded row in range");
        }
    }
    for y in &ys {
        assert!(y.blocks.len() >= nb, "activation blocks in range");
    }
    let mut acc = [[_mm512_setzero_ps(); N]; P];
    for i in 0..nb {
        let mut qy = [_mm512_setzero_si512(); N];
        let mut cy = [_mm512_setzero_si512(); N];
        let mut dy = [_mm512_setzero_ps(); N];
        for t in 0..N {
            let yb = &ys[t].blocks[i];
            qy[t] = _mm512_broadcast_i64x4(ld256_i8(&yb.qs));
            cy[t] = _mm512_broadcast_i64x4(ld256_corr(&yb.corr));
            dy[t] = _mm512_set1_ps(yb.d);
        }
        for (p, accp) in acc.iter_mut().enumerate() {
            let (w0, w1) = (&w.blocks[rs[p][0] * nb + i], &w.blocks[rs[p][1] * nb + i]);
            let u = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(&w0.u)), ld256(&w1.u));
            let dx = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(w0.d))),
                _mm256_castps_pd(_mm256_set1_ps(w1.d)),
            ));
            for t in 0..N {
                let s = _mm512_dpbusd_epi32(cy[t], u, qy[t]);
                // dx * dy rounded to f32, as the single-row kernel's scalar product.
                let dd = _mm512_mul_ps(dx, dy[t]);
                accp[t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), accp[t]);
            }
        }
    }
    let mut out = [[[0.0f32; N]; 2]; P];
    for p in 0..P {
        for t in 0..N {
            let a = acc[p][t];
            out[p][0][t] = hsum8(_mm512_castps512_ps256(a));
            out[p][1][t] = hsum8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(a),
            )));
        }
    }
    out
}

#[inline]
#[target_feature(enable = "avx2")]
fn ld256_corr(p: &[i32; 8]) -> __m256i {
    // SAFETY: `p` is 32 readable bytes; loadu has no alignment requirement.
    unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
}

/// The row groups of a packed-Q8 matmul: the `nrows` rows of `w` (whole rows of `ty`, `rb`
/// bytes each) decoded [`TR`] at a time into `scratch`, then `tiles(group, rows in the
/// group, scratch)` runs the tier's tiles over them.
fn decoded_groups(
    _tok: super::Avx2,
    ty: GgmlType,
    w: &[u8],
    rb: usize,
    nrows: usize,
    scratch: &mut DecodedRows,
    mut tiles: impl FnMut(usize, usize, &DecodedRows),
) {
    for g in 0..nrows.div_ceil(TR) {
        let nr = (nrows - g * TR).min(TR);
        let rows = &w[g * TR * rb..(g * TR + nr) * rb];
        // SAFETY: the token proves the CPU has AVX2/FMA/F16C; slices only.
        unsafe { decode_rows(ty, rows, scratch) };
        tiles(g, nr, scratch);
    }
}

/// Tokens per tile of the kernel.
pub(crate) const TN: usize = 4;
/// Weight rows per tile of the kernel.
pub(crate) const TR: usize = 8;

impl super::Avx512 {
    /// `W[r] . token t` for the rows in `w` (whole rows of `ty`, `rb` bytes each,
    /// `out.rows()` of them), put into `out`; `scratch` holds at least `TR` decoded rows.
    pub(crate) fn matmul_q8_rows(
        self,
        ty: GgmlType,
        w: &[u8],
        rb: usize,
        acts: &[PackedQ8],
        scratch: &mut DecodedRows,
        out: &mut impl RowsOut,
    ) {
        let nrows = out.rows();
        decoded_groups(self.avx2(), ty, w, rb, nrows, scratch, |g, nr, scratch| {
            for (tc, a) in acts.chunks(TN).enumerate() {
                let t0 = tc * TN;
                // Row k of the group, or its last row past the end (computed, not stored).
                let rk = |k: usize| k.min(nr - 1);
                macro_rules! run {
                    ($p:literal, $($t:literal),*) => {{
                        let rs: [[usize; 2]; $p] = core::array::from_fn(|p| [rk(2 * p), rk(2 * p + 1)]);
                        // SAFETY: the token proves the CPU has the kernel's features; the
                        // kernel reads only through the slices it is given.
                        let o = unsafe { tile::<$p, { [$($t),*].len() }>(scratch, rs, [$(&a[$t]),*]) };
                        for (r, orow) in o.iter().flatten().take(nr).enumerate() {
                            out.put(g * TR + r, t0, orow);
                        }
                    }};
                }
                macro_rules! by_tokens {
                    ($p:literal) => {
                        match a.len() {
                            1 => run!($p, 0),
                            2 => run!($p, 0, 1),
                            3 => run!($p, 0, 1, 2),
                            _ => run!($p, 0, 1, 2, 3),
                        }
                    };
                }
                match nr {
                    1 | 2 => by_tokens!(1),
                    3 | 4 => by_tokens!(2),
                    5 | 6 => by_tokens!(3),
                    _ => by_tokens!(4),
                }
            }
        });
    }
}

/// `out[k][t] = row rs[k] . token t` on the AVX2 tier, for Q5_0 / Q4_0 weights only: each
/// (row, token, block) i32 lane is `madd(maddubs(u, qy), 1) + corr`, the exact integer of
/// the single-row kernel (`u` is at most 31, so a `maddubs` pair sum is at most
/// 2 * 31 * 128 < 2^15 and never saturates; Q8_0's shifted 0..=255 would). Then the float
/// steps of the single-row kernel: `dx * dy` rounded to f32, FMA into an 8-lane
/// accumulator in block order, `hsum8`. The weight rows are decoded once per matmul
/// instead of once per token tile.
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_avx2<const R: usize, const N: usize>(
    w: &DecodedRows,
    rs: [usize; R],
    ys: [&PackedQ8; N],
) -> [[f32; N]; R] {
    let nb = w.nb;
    for &r in &rs {
        assert!((r + 1) * nb <= w.blocks.len(), "decoded row in range");
    }
    for y in &ys {
        assert!(y.blocks.len() >= nb, "activation blocks in range");
    }
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    for i in 0..nb {
        for (k, acck) in acc.iter_mut().enumerate() {
            let wb = &w.blocks[rs[k] * nb + i];
            let u = ld256(&wb.u);
            for (t, a) in acck.iter_mut().enumerate() {
                let yb = &ys[t].blocks[i];
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, ld256_i8(&yb.qs)), ones);
                let s = _mm256_add_epi32(p, ld256_corr(&yb.corr));
                let dd = _mm256_set1_ps(wb.d * yb.d);
                *a = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), *a);
            }
        }
    }
    let mut out = [[0.0f32; N]; R];
    for k in 0..R {
        for t in 0..N {
            out[k][t] = hsum8(acc[k][t]);
        }
    }
    out
}

/// Rows and tokens per tile of the AVX2 kernel.
const TR_AVX2: usize = 4;
const TN_AVX2: usize = 2;

impl super::Avx2 {
    /// [`super::Avx512::matmul_q8_rows`] on the AVX2 tier, for Q5_0 / Q4_0 weights only
    /// (the batch preparation picks this form for those): the same bits as the single-row
    /// kernels.
    pub(crate) fn matmul_q8_rows(
        self,
        ty: GgmlType,
        w: &[u8],
        rb: usize,
        acts: &[PackedQ8],
        scratch: &mut DecodedRows,
        out: &mut impl RowsOut,
    ) {
        assert!(
            matches!(ty, GgmlType::Q5_0 | GgmlType::Q4_0),
            "AVX2 packed matmul is exact only for Q5_0 / Q4_0"
        );
        let nrows = out.rows();
        decoded_groups(self, ty, w, rb, nrows, scratch, |g, nr, scratch| {
            for k0 in (0..nr).step_by(TR_AVX2) {
                let kn = (nr - k0).min(TR_AVX2);
                // Row k0 + k of the group, or its last row past the end (computed, not stored).
                let rs: [usize; TR_AVX2] = core::array::from_fn(|k| (k0 + k).min(nr - 1));
                for (tc, a) in acts.chunks(TN_AVX2).enumerate() {
                    let t0 = tc * TN_AVX2;
                    macro_rules! run {
                        ($($t:literal),*) => {{
                            // SAFETY: the token proves the CPU has the kernel's features;
                            // the kernel reads only through the slices it is given.
                            let o = unsafe {
                                tile_avx2::<TR_AVX2, { [$($t),*].len() }>(scratch, rs, [$(&a[$t]),*])
                            };
                            for (k, orow) in o.iter().take(kn).enumerate() {
                                out.put(g * TR + k0 + k, t0, orow);
                            }
                        }};
                    }
                    match a.len() {
                        1 => run!(0),
                        _ => run!(0, 1),
                    }
                }
            }
        });
    }
}
