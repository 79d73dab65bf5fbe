//! AVX2 / AVX-512 forms of [`crate::attn`]'s loops (query . key scores, probability-weighted
//! value sums).
//!
//! Owns: the register tiles. Scores: up to 4 heads x `K` keys of 8-lane accumulators, each
//! key loaded once for every head of the group; each accumulator is exactly the scalar
//! [`crate::attn::dot`]'s eight lane sums (product rounded, then added: `mul` + `add`,
//! never FMA), combined in its order. Weighted sums: up to 4 heads x `C` 8-float output
//! pieces held in registers across all cache rows, each value piece loaded once for every
//! head; per output element the scalar form's sequence of rounded products and adds.
//! The same code is compiled for both tiers; the AVX-512 one (32 vector registers)
//! uses wider tiles.

use core::arch::x86_64::*;

use crate::attn::Span;

#[inline]
#[target_feature(enable = "avx")]
fn ld(p: &[f32; 8]) -> __m256 {
    // SAFETY: `p` is 8 readable f32s; loadu has no alignment requirement.
    unsafe { _mm256_loadu_ps(p.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx")]
fn st(p: &mut [f32; 8], v: __m256) {
    // SAFETY: `p` is 8 writable f32s; storeu has no alignment requirement.
    unsafe { _mm256_storeu_ps(p.as_mut_ptr(), v) }
}

/// The scalar dot's combination of its eight lane sums.
#[inline]
#[target_feature(enable = "avx")]
fn combine(acc: __m256) -> f32 {
    let mut a = [0.0f32; 8];
    st(&mut a, acc);
    (a[0] + a[4]) + (a[1] + a[5]) + (a[2] + a[6]) + (a[3] + a[7])
}

/// Generates one tier's tiles and drivers. `$kt`: keys per score tile, `$ct`: 8-float
/// output pieces per weighted-sum tile (4 heads x these are the accumulators).
macro_rules! tier {
    ($m:ident, $features:literal, $kt:literal, $ct:literal) => {
        mod $m {
            use super::*;

            /// `out[h][k] = dot(qs[h], ks[k])` over the first `d8` (a multiple of 8)
            /// elements through the lane sums, plus the tail up to `dim` in order.
            #[inline]
            #[target_feature(enable = $features)]
            fn score_tile<const H: usize, const K: usize>(
                qs: [&[f32]; H],
                ks: [&[f32]; K],
                dim: usize,
                scale: f32,
                out: &mut [&mut [f32]; H],
                j0: usize,
            ) {
                let d8 = dim / 8 * 8;
                let qc: [&[[f32; 8]]; H] = qs.map(|q| q[..d8].as_chunks::<8>().0);
                let kc: [&[[f32; 8]]; K] = ks.map(|k| k[..d8].as_chunks::<8>().0);
                let mut acc = [[_mm256_setzero_ps(); K]; H];
                for i in 0..d8 / 8 {
                    let kv: [__m256; K] = core::array::from_fn(|k| ld(&kc[k][i]));
                    for h in 0..H {
                        let qv = ld(&qc[h][i]);
                        for k in 0..K {
                            acc[h][k] = _mm256_add_ps(acc[h][k], _mm256_mul_ps(qv, kv[k]));
                        }
                    }
                }
                for h in 0..H {
                    for k in 0..K {
                        let mut s = combine(acc[h][k]);
                        for e in d8..dim {
                            s += qs[h][e] * ks[k][e];
                        }
                        out[h][j0 + k] = s * scale;
                    }
                }
            }

            /// Every key of `sp` against `H` heads.
            #[inline]
            #[target_feature(enable = $features)]
            fn score_heads<const H: usize>(
                q: &[f32],
                dim: usize,
                keys: &[f32],
                sp: Span,
                scale: f32,
                out: &mut [f32],
            ) {
                let qs: [&[f32]; H] = core::array::from_fn(|h| &q[h * dim..(h + 1) * dim]);
                let mut os = out.chunks_exact_mut(sp.n);
                let mut os: [&mut [f32]; H] =
                    core::array::from_fn(|_| os.next().expect("H rows of out"));
                let key = |j: usize| &keys[j * sp.stride..j * sp.stride + dim];
                let mut j = 0;
                while j + $kt <= sp.n {
                    let ks: [&[f32]; $kt] = core::array::from_fn(|k| key(j + k));
                    score_tile::<H, $kt>(qs, ks, dim, scale, &mut os, j);
                    j += $kt;
                }
                while j < sp.n {
                    score_tile::<H, 1>(qs, [key(j)], dim, scale, &mut os, j);
                    j += 1;
                }
            }

            #[target_feature(enable = $features)]
            pub(super) fn scores(
                q: &[f32],
                dim: usize,
                keys: &[f32],
                sp: Span,
                scale: f32,
                out: &mut [f32],
            ) {
                if dim == 0 {
                    out.fill(0.0 * scale);
                    return;
                }
                for (qg, og) in q.chunks(4 * dim).zip(out.chunks_mut(4 * sp.n)) {
                    match qg.len() / dim {
                        1 => score_heads::<1>(qg, dim, keys, sp, scale, og),
                        2 => score_heads::<2>(qg, dim, keys, sp, scale, og),
                        3 => score_heads::<3>(qg, dim, keys, sp, scale, og),
                        _ => score_heads::<4>(qg, dim, keys, sp, scale, og),
                    }
                }
            }

            /// `C` output pieces (8 floats each, from `c0`) of `H` heads over every row.
            #[inline]
            #[target_feature(enable = $features)]
            fn sum_tile<const H: usize, const C: usize>(
                p: &[f32],
                values: &[f32],
                sp: Span,
                c0: usize,
                out: &mut [&mut [f32]; H],
            ) {
                let mut acc: [[__m256; C]; H] = core::array::from_fn(|h| {
                    core::array::from_fn(|c| ld(out[h][c0 + 8 * c..][..8].try_into().unwrap()))
                });
                let ps: [&[f32]; H] = core::array::from_fn(|h| &p[h * sp.n..(h + 1) * sp.n]);
                for j in 0..sp.n {
                    let v = &values[j * sp.stride + c0..];
                    let vv: [__m256; C] = core::array::from_fn(|c| {
                        ld(v[8 * c..8 * c + 8].try_into().expect("8 values"))
                    });
                    for h in 0..H {
                        let pj = _mm256_set1_ps(ps[h][j]);
                        for c in 0..C {
                            acc[h][c] = _mm256_add_ps(acc[h][c], _mm256_mul_ps(pj, vv[c]));
                        }
                    }
                }
                for h in 0..H {
                    for c in 0..C {
                        st(
                            (&mut out[h][c0 + 8 * c..c0 + 8 * c + 8])
                                .try_into()
                                .unwrap(),
                            acc[h][c],
                        );
                    }
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn sum_heads<const H: usize>(
                p: &[f32],
                values: &[f32],
                sp: Span,
                dim_v: usize,
                out: &mut [f32],
            ) {
                let mut os = out.chunks_exact_mut(dim_v);
                let mut os: [&mut [f32]; H] =
                    core::array::from_fn(|_| os.next().expect("H rows of out"));
                let d8 = dim_v / 8 * 8;
                let mut c0 = 0;
                while c0 + 8 * $ct <= d8 {
                    sum_tile::<H, $ct>(p, values, sp, c0, &mut os);
                    c0 += 8 * $ct;
                }
                while c0 < d8 {
                    sum_tile::<H, 1>(p, values, sp, c0, &mut os);
                    c0 += 8;
                }
                for (h, o) in os.iter_mut().enumerate() {
                    for (j, &pj) in p[h * sp.n..(h + 1) * sp.n].iter().enumerate() {
                        let v = &values[j * sp.stride..j * sp.stride + dim_v];
                        for e in d8..dim_v {
                            o[e] += pj * v[e];
                        }
                    }
                }
            }

            #[target_feature(enable = $features)]
            pub(super) fn weighted_sum(
                p: &[f32],
                values: &[f32],
                sp: Span,
                dim_v: usize,
                out: &mut [f32],
            ) {
                if dim_v == 0 {
                    return;
                }
                for (pg, og) in p.chunks(4 * sp.n.max(1)).zip(out.chunks_mut(4 * dim_v)) {
                    match og.len() / dim_v {
                        1 => sum_heads::<1>(pg, values, sp, dim_v, og),
                        2 => sum_heads::<2>(pg, values, sp, dim_v, og),
                        3 => sum_heads::<3>(pg, values, sp, dim_v, og),
                        _ => sum_heads::<4>(pg, values, sp, dim_v, og),
                    }
                }
            }
        }
    };
}

tier!(t256, "avx2", 2, 2);
tier!(t512, "avx2,avx512f,avx512vl", 4, 4);

impl super::Avx2 {
    /// [`crate::attn::scores`] (shapes checked by the caller).
    pub(crate) fn attn_scores(
        self,
        q: &[f32],
        dim: usize,
        keys: &[f32],
        sp: Span,
        scale: f32,
        out: &mut [f32],
    ) {
        // SAFETY: the token proves the CPU has AVX2; the kernel reads and writes only
        // through the slices it is given.
        unsafe { t256::scores(q, dim, keys, sp, scale, out) }
    }

    /// [`crate::attn::weighted_sum`] (shapes checked by the caller).
    pub(crate) fn attn_weighted_sum(
        self,
        p: &[f32],
        values: &[f32],
        sp: Span,
        dim_v: usize,
        out: &mut [f32],
    ) {
        // SAFETY: as above.
        unsafe { t256::weighted_sum(p, values, sp, dim_v, out) }
    }
}

impl super::Avx512 {
    /// [`crate::attn::scores`] (shapes checked by the caller).
    pub(crate) fn attn_scores(
        self,
        q: &[f32],
        dim: usize,
        keys: &[f32],
        sp: Span,
        scale: f32,
        out: &mut [f32],
    ) {
        // SAFETY: the token proves the CPU has AVX2 and AVX-512 F/VL; the kernel reads and
        // writes only through the slices it is given.
        unsafe { t512::scores(q, dim, keys, sp, scale, out) }
    }

    /// [`crate::attn::weighted_sum`] (shapes checked by the caller).
    pub(crate) fn attn_weighted_sum(
        self,
        p: &[f32],
        values: &[f32],
        sp: Span,
        dim_v: usize,
        out: &mut [f32],
    ) {
        // SAFETY: as above.
        unsafe { t512::weighted_sum(p, values, sp, dim_v, out) }
    }
}
