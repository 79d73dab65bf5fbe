//! x86-64 fast paths, reached only through CPU-checked token types.
//!
//! Owns: [`Avx2`] and [`Avx512`], zero-sized proofs that the CPU has the tier's features
//! (their only constructors check with `is_x86_feature_detected!`), and the safe methods
//! on them that call the `#[target_feature]` kernels in `avx2.rs` / `avx512.rs`. Holding a
//! token is what makes calling those kernels sound.

/// Generates a Q8_0-activation dot kernel (Q8_0 / Q5_0 weights) for one weight format and
/// one way of doing the u8 x i8 -> i32 step (`$dot`: maddubs + madd, or VNNI `vpdpbusd`);
/// both ways give the same exact i32 lanes, so the float results are identical.
///
/// Sign trick: |qx| (as u8, <= 128) times qy * sign(qx) (|qy| <= 127: activations never
/// hold -128) is qx * qy exactly, in the u8 x i8 form the instructions want.
#[macro_export]
#[doc(hidden)]
macro_rules! q8_like_kernel {
    ($name:ident, $rows:ident, $bytes:expr, $decode:ident, $features:literal, $dot:expr) => {
        /// `out[r] = row r . ys` for the consecutive rows of `w` (`rb` bytes each): the
        /// same bits as `$name::<1>` on each row (same per-lane operations in the same
        /// order), but two rows run interleaved (two independent FMA chains), the
        /// activation block and its scale (F16C) are loaded once for both, and the weights are
        /// prefetched [`MATVEC_PREFETCH_ROWS`] rows ahead, one hint per row per block as
        /// the block is reached.
        #[target_feature(enable = $features)]
        pub(super) fn $rows(
            w: &[u8],
            rb: usize,
            ys: &[$crate::formats::BlockQ8_0],
            out: &mut [f32],
        ) {
            let dot = $dot;
            let tab = $crate::formats::f16_table();
            let nb = rb / $bytes;
            let ys = &ys[..nb];
            let pf = |r: usize, off: usize| {
                let p = w
                    .as_ptr()
                    .wrapping_add((r + super::MATVEC_PREFETCH_ROWS) * rb + off);
                // A hint: never faults, whatever the address.
                _mm_prefetch::<_MM_HINT_T0>(p.cast());
            };
            let burst = 2 * rb <= super::MATVEC_PREFETCH_BURST_BYTES;
            let mut pairs = out.chunks_exact_mut(2);
            let mut r = 0;
            for o in &mut pairs {
                let (b0, _) = w[r * rb..(r + 1) * rb].as_chunks::<{ $bytes }>();
                let (b1, _) = w[(r + 1) * rb..(r + 2) * rb].as_chunks::<{ $bytes }>();
                let mut a0 = _mm256_setzero_ps();
                let mut a1 = _mm256_setzero_ps();
                for (i, ((x0, x1), yb)) in b0.iter().zip(b1).zip(ys).enumerate() {
                    if !burst {
                        pf(r, i * $bytes);
                        pf(r + 1, i * $bytes);
                    }
                    let dy = super::avx2::f16_to_f32(yb.d);
                    let qy = ld256_i8(&yb.qs);
                    let (d0, q0) = $decode(x0, tab);
                    let (d1, q1) = $decode(x1, tab);
                    let s0 = dot(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(qy, q0));
                    let s1 = dot(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(qy, q1));
                    a0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * dy), _mm256_cvtepi32_ps(s0), a0);
                    a1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * dy), _mm256_cvtepi32_ps(s1), a1);
                }
                if burst {
                    for off in (0..2 * rb).step_by(64) {
                        pf(r, off);
                    }
                }
                o[0] = hsum8(a0);
                o[1] = hsum8(a1);
                r += 2;
            }
            for o in pairs.into_remainder() {
                *o = $name::<1>(&w[r * rb..(r + 1) * rb], [ys])[0];
            }
        }

        $crate::q8_like_kernel!($name, $bytes, $decode, $features, $dot);
    };
    ($name:ident, $bytes:expr, $decode:ident, $features:literal, $dot:expr) => {
        /// Row of this format . N Q8_0 activation rows.
        #[target_feature(enable = $features)]
        pub(super) fn $name<const N: usize>(
            row: &[u8],
            ys: [&[$crate::formats::BlockQ8_0]; N],
        ) -> [f32; N] {
            let dot = $dot;
            let tab = $crate::formats::f16_table();
            let mut acc = [_mm256_setzero_ps(); N];
            let (blocks, _) = row.as_chunks::<{ $bytes }>();
            for (i, b) in blocks.iter().enumerate() {
                let (dx, qx) = $decode(b, tab);
                let ax = _mm256_sign_epi8(qx, qx);
                for t in 0..N {
                    let yb = &ys[t][i];
                    let qy = ld256_i8(&yb.qs);
                    let s = dot(ax, _mm256_sign_epi8(qy, qx));
                    let dd = _mm256_set1_ps(dx * tab[yb.d as usize]);
                    acc[t] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(s), acc[t]);
                }
            }
            let mut out = [0.0f32; N];
            for t in 0..N {
                out[t] = hsum8(acc[t]);
            }
            out
        }
    };
}

/// How many rows ahead the single-token Q8_0 / Q5_0 row kernels prefetch their weights,
/// one hint per row per block as the block is reached (for pairs longer than
/// [`MATVEC_PREFETCH_BURST_BYTES`]). They used to issue the next pair's
/// 68 hints in one burst after each pair, and the demand loads queued behind them: 12-layer
/// 30B-shape Q8_0, `sluice bench -t 2 -p 0 -n 32`, tg32 12.6 -> 17.4 tok/s (medians, AMD
/// EPYC Zen 3, AVX2), 23.6 -> 24.1 with 2 threads and 61.4 -> 75.2 with 8 on an Intel Xeon
/// (AVX-512 VNNI).
#[cfg(target_arch = "x86_64")]
const MATVEC_PREFETCH_ROWS: usize = 4;

/// Row pairs of at most this many bytes are still prefetched in one burst after the pair
/// (at most 32 hints): per-block hints cost Gemma 3 270M's decode (640-column rows, a
/// 680-byte Q8_0 head row) ~10% (tg64 medians 66.5 burst vs 59.5 per block, 8 alternated
/// rounds, Zen 3), while the 30B shape's 4352-byte pairs keep the per-block gain.
#[cfg(target_arch = "x86_64")]
const MATVEC_PREFETCH_BURST_BYTES: usize = 2048;

/// How many rows ahead the single-token K-quant row kernels (and the one-row fallback of
/// [`Avx2::rows`] / [`Avx512::rows`]) prefetch their weights: a decode streams each
/// expert's rows from DRAM once, and the hardware prefetchers alone left the Q4_K kernel
/// waiting on the first line of each block (768x2048 matrices streamed from DRAM, 1
/// thread: 7.8 -> 12.9 GB/s for Q4_K, 8.5 -> 14.0 for Q6_K with 2 to 8 rows ahead).
#[cfg(target_arch = "x86_64")]
const KQ_PREFETCH_ROWS: usize = 4;

/// How the single-token Q4_K row kernels walk a matrix: two rows side by side with software
/// prefetch ([`KQ_PREFETCH_ROWS`] ahead), or one row after the other with no hints.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Q4kRowOrder {
    /// `rows_q4k`: the activation block loaded once for two rows, two FMA chains; the two
    /// rows are two interleaved streams the hardware prefetchers do not follow, so hints
    /// are issued a few rows ahead. Measured best on Intel Xeons (AVX-512).
    Pairs,
    /// Rows one after the other (`walk::rows_q4k_walk`, the ops of `dot_q4k::<1>` on each):
    /// one sequential stream through the matrix, which AMD Zen's hardware prefetchers follow
    /// on their own. 12-layer 30B-shape Q4_K, `sluice bench -t 2 -p 0 -n 64 -r 2`, AMD EPYC
    /// Zen 4, 5 alternated rounds (medians), then still through `dot_q4k::<1>` row by row:
    /// AVX2 tier 44.7 -> 49.5 tok/s, AVX-512 tier 42.4 -> 45.7 (llama.cpp's AVX2 build 49.5).
    Single,
}

/// The row order of this machine: `SLUICE_Q4K_ROWS=pairs|single` if set, else single on
/// AMD and pairs elsewhere. Both orders give the same bits (`rows_q4k` performs each row's
/// operations of `dot_q4k::<1>` in the same order).
#[cfg(target_arch = "x86_64")]
pub(crate) fn q4k_row_order() -> Q4kRowOrder {
    static ORDER: std::sync::OnceLock<Q4kRowOrder> = std::sync::OnceLock::new();
    *ORDER.get_or_init(|| match std::env::var("SLUICE_Q4K_ROWS").as_deref() {
        Ok("pairs") => Q4kRowOrder::Pairs,
        Ok("single") => Q4kRowOrder::Single,
        _ if cpu_vendor_is_amd() => Q4kRowOrder::Single,
        _ => Q4kRowOrder::Pairs,
    })
}

/// How the single-token Q8_0 row kernels walk a matrix: `rows_q8_0` (two rows side by
/// side, hinted [`MATVEC_PREFETCH_ROWS`] ahead) or the one-stream walk of `walk.rs`.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Q8RowOrder {
    /// `rows_q8_0`: two rows interleaved, software prefetch.
    Pairs,
    /// `walk::rows_q8_0_walk`: one row after the other in one function, no hints.
    Single,
}

/// The Q8_0 row order: `SLUICE_Q8_ROWS=pairs|single` if set, else single on AMD (as for
/// Q4_K) and pairs elsewhere (unmeasured on Intel with the walk). Both orders give the same
/// bits.
#[cfg(target_arch = "x86_64")]
pub(crate) fn q8_row_order() -> Q8RowOrder {
    static ORDER: std::sync::OnceLock<Q8RowOrder> = std::sync::OnceLock::new();
    *ORDER.get_or_init(|| match std::env::var("SLUICE_Q8_ROWS").as_deref() {
        Ok("pairs") => Q8RowOrder::Pairs,
        Ok("single") => Q8RowOrder::Single,
        _ if cpu_vendor_is_amd() => Q8RowOrder::Single,
        _ => Q8RowOrder::Pairs,
    })
}

/// Whether CPUID's vendor string is "AuthenticAMD".
#[cfg(target_arch = "x86_64")]
fn cpu_vendor_is_amd() -> bool {
    // CPUID leaf 0 exists on every x86-64 CPU and has no side effects.
    let r = core::arch::x86_64::__cpuid(0);
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&r.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&r.edx.to_le_bytes());
    v[8..].copy_from_slice(&r.ecx.to_le_bytes());
    &v == b"AuthenticAMD"
}

/// `out[r] = dot(row r)` one row after the other: the formats without a paired row kernel
/// or a walk. Weights are hinted [`KQ_PREFETCH_ROWS`] rows ahead, except dense rows (long
/// runs, one sequential stream the hardware prefetchers follow on their own).
#[cfg(target_arch = "x86_64")]
fn rows_one_by_one(
    ty: crate::GgmlType,
    w: &[u8],
    rb: usize,
    out: &mut [f32],
    mut dot: impl FnMut(&[u8], &mut f32),
) {
    use crate::GgmlType::{BF16, F16, F32};
    let hinted = !matches!(ty, F32 | F16 | BF16);
    for (i, o) in out.iter_mut().enumerate() {
        if hinted {
            prefetch_block(w, (i + KQ_PREFETCH_ROWS) * rb, rb);
        }
        dot(&w[i * rb..(i + 1) * rb], o);
    }
}

/// Prefetch hints for the `len` bytes at byte `off` of `w` (one per 64 bytes), which may
/// lie past the end of `w`: a hint never faults, whatever the address, and reads nothing.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_block(w: &[u8], off: usize, len: usize) {
    use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let p = w.as_ptr().wrapping_add(off);
    let mut o = 0;
    while o < len {
        // SAFETY: SSE is part of the x86-64 baseline, and a prefetch is a hint that never
        // faults and reads nothing the program sees, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o).cast()) };
        o += 64;
    }
}

#[cfg(target_arch = "x86_64")]
mod attn;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod kgemm;
#[cfg(target_arch = "x86_64")]
mod kquants;
#[cfg(target_arch = "x86_64")]
mod q8gemm;
#[cfg(target_arch = "x86_64")]
mod walk;
#[cfg(target_arch = "x86_64")]
pub(crate) use kgemm::{DecodedK, PackedQ8K, KTR};
#[cfg(target_arch = "x86_64")]
pub(crate) use q8gemm::{DecodedRows, PackedQ8, TR};

#[cfg(target_arch = "x86_64")]
pub use tokens::*;

#[cfg(target_arch = "x86_64")]
mod tokens {
    use crate::formats::{BlockQ8K, BlockQ8_0, BlockQ8_1};
    use crate::{ActData, GgmlType, QuantizedActs};

    /// Proof that the CPU has AVX2, FMA and F16C.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx2 {
        _private: (),
    }

    impl Avx2 {
        /// `Some` only when the CPU has AVX2 + FMA + F16C.
        pub fn new() -> Option<Avx2> {
            (is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c"))
            .then_some(Avx2 { _private: () })
        }
    }

    /// Proof that the CPU has the AVX2 tier plus AVX-512 F/BW/VL/VNNI.
    #[derive(Clone, Copy, Debug)]
    pub struct Avx512 {
        _private: (),
    }

    impl Avx512 {
        /// `Some` only when the CPU has the AVX2 tier and AVX-512 F, BW, VL and VNNI.
        pub fn new() -> Option<Avx512> {
            (Avx2::new().is_some()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni"))
            .then_some(Avx512 { _private: () })
        }

        /// The AVX2 token (AVX-512 implies it).
        pub fn avx2(self) -> Avx2 {
            Avx2 { _private: () }
        }
    }

    fn q8k(a: &QuantizedActs) -> &[BlockQ8K] {
        match &a.data {
            ActData::Q8K(v) => v,
            _ => panic!("activations not prepared for a K-quant"),
        }
    }
    fn q8_0(a: &QuantizedActs) -> &[BlockQ8_0] {
        match &a.data {
            ActData::Q8_0(v) => v,
            _ => panic!("activations not prepared for Q8_0/Q5_0"),
        }
    }
    fn q8_1(a: &QuantizedActs) -> &[BlockQ8_1] {
        match &a.data {
            ActData::Q8_1(v) => v,
            _ => panic!("activations not prepared for Q4_1/Q5_1"),
        }
    }
    fn dense(a: &QuantizedActs) -> &[f32] {
        match &a.data {
            ActData::F32(v) => v,
            _ => panic!("activations not prepared for a dense format"),
        }
    }

    /// Calls `$kernel::<N>(row, [acts..])` for tiles of up to `TILE` (8) tokens, writing `out`.
    macro_rules! tiled {
        ($acts:expr, $out:expr, $get:ident, $row:expr, $kernel:path) => {{
            for (a, o) in $acts.chunks(crate::TILE).zip($out.chunks_mut(crate::TILE)) {
                // SAFETY (every arm): the token held by the caller proves the CPU has the
                // kernel's target features; the kernel only touches memory through the
                // safe slices it is given.
                match a.len() {
                    1 => o.copy_from_slice(&unsafe { $kernel($row, [$get(a[0])]) }),
                    2 => o.copy_from_slice(&unsafe { $kernel($row, [$get(a[0]), $get(a[1])]) }),
                    3 => o.copy_from_slice(&unsafe {
                        $kernel($row, [$get(a[0]), $get(a[1]), $get(a[2])])
                    }),
                    4 => o.copy_from_slice(&unsafe {
                        $kernel($row, [$get(a[0]), $get(a[1]), $get(a[2]), $get(a[3])])
                    }),
                    5 => o.copy_from_slice(&unsafe {
                        $kernel(
                            $row,
                            [$get(a[0]), $get(a[1]), $get(a[2]), $get(a[3]), $get(a[4])],
                        )
                    }),
                    6 => o.copy_from_slice(&unsafe {
                        $kernel(
                            $row,
                            [
                                $get(a[0]),
                                $get(a[1]),
                                $get(a[2]),
                                $get(a[3]),
                                $get(a[4]),
                                $get(a[5]),
                            ],
                        )
                    }),
                    7 => o.copy_from_slice(&unsafe {
                        $kernel(
                            $row,
                            [
                                $get(a[0]),
                                $get(a[1]),
                                $get(a[2]),
                                $get(a[3]),
                                $get(a[4]),
                                $get(a[5]),
                                $get(a[6]),
                            ],
                        )
                    }),
                    _ => o.copy_from_slice(&unsafe {
                        $kernel(
                            $row,
                            [
                                $get(a[0]),
                                $get(a[1]),
                                $get(a[2]),
                                $get(a[3]),
                                $get(a[4]),
                                $get(a[5]),
                                $get(a[6]),
                                $get(a[7]),
                            ],
                        )
                    }),
                }
            }
        }};
    }

    impl Avx2 {
        /// `out[r] = row r of w . acts` for `out.len()` consecutive `rb`-byte rows (types
        /// checked by the caller); same bits as [`Avx2::dot_tile`] on each row alone.
        pub(crate) fn rows(
            self,
            ty: GgmlType,
            w: &[u8],
            rb: usize,
            acts: &QuantizedActs,
            out: &mut [f32],
        ) {
            // SAFETY (every arm): the token proves the CPU has the kernel's features; the
            // kernel only touches memory through the safe slices it is given.
            match ty {
                GgmlType::Q8_0 => match super::q8_row_order() {
                    super::Q8RowOrder::Pairs => unsafe {
                        super::avx2::rows_q8_0(w, rb, q8_0(acts), out)
                    },
                    super::Q8RowOrder::Single => unsafe {
                        super::walk::rows_q8_0_walk(w, rb, q8_0(acts), out)
                    },
                },
                GgmlType::Q5_0 => unsafe { super::avx2::rows_q5_0(w, rb, q8_0(acts), out) },
                GgmlType::Q4_K => match super::q4k_row_order() {
                    super::Q4kRowOrder::Pairs => unsafe {
                        super::avx2::rows_q4k(w, rb, q8k(acts), out)
                    },
                    super::Q4kRowOrder::Single => unsafe {
                        super::walk::rows_q4k_walk(w, rb, q8k(acts), out)
                    },
                },
                GgmlType::Q6_K => unsafe { super::avx2::rows_q6k(w, rb, q8k(acts), out) },
                _ => super::rows_one_by_one(ty, w, rb, out, |row, o| {
                    self.dot_tile(ty, row, &[acts], std::slice::from_mut(o))
                }),
            }
        }

        /// `out[t] = row . acts[t]` (types checked by the caller).
        pub(crate) fn dot_tile(
            self,
            ty: GgmlType,
            row: &[u8],
            acts: &[&QuantizedActs],
            out: &mut [f32],
        ) {
            use GgmlType::*;
            match ty {
                Q4_K => tiled!(acts, out, q8k, row, super::avx2::dot_q4k),
                Q6_K => tiled!(acts, out, q8k, row, super::avx2::dot_q6k),
                Q8_0 => tiled!(acts, out, q8_0, row, super::avx2::dot_q8_0),
                Q5_0 => tiled!(acts, out, q8_0, row, super::avx2::dot_q5_0),
                F32 => tiled!(acts, out, dense, row, super::avx2::dot_f32),
                F16 => tiled!(acts, out, dense, row, super::avx2::dot_f16),
                BF16 => tiled!(acts, out, dense, row, super::avx2::dot_bf16),
                // quants-k
                Q4_0 => tiled!(acts, out, q8_0, row, super::kquants::dot_q4_0),
                Q4_1 => tiled!(acts, out, q8_1, row, super::kquants::dot_q4_1),
                Q5_1 => tiled!(acts, out, q8_1, row, super::kquants::dot_q5_1),
                IQ4_NL => tiled!(acts, out, q8_0, row, super::kquants::dot_iq4_nl),
                MXFP4 => tiled!(acts, out, q8_0, row, super::kquants::dot_mxfp4),
                Q2_K => tiled!(acts, out, q8k, row, super::kquants::dot_q2k),
                Q3_K => tiled!(acts, out, q8k, row, super::kquants::dot_q3k),
                Q5_K => tiled!(acts, out, q8k, row, super::kquants::dot_q5k),
                IQ4_XS => tiled!(acts, out, q8k, row, super::kquants::dot_iq4xs),
                TQ1_0 => tiled!(acts, out, q8k, row, super::kquants::dot_tq1),
                TQ2_0 => tiled!(acts, out, q8k, row, super::kquants::dot_tq2),
                IQ2_XXS => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq2xxs),
                IQ2_XS => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq2xs),
                IQ2_S => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq2s),
                IQ3_XXS => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq3xxs),
                IQ3_S => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq3s),
                IQ1_S => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq1s),
                IQ1_M => tiled!(acts, out, q8k, row, crate::iq::avx2::dot_iq1m),
                _ => unreachable!("unsupported types are rejected before dispatch"),
            }
        }
    }

    impl Avx512 {
        /// [`Avx2::rows`] on this tier (same bits).
        pub(crate) fn rows(
            self,
            ty: GgmlType,
            w: &[u8],
            rb: usize,
            acts: &QuantizedActs,
            out: &mut [f32],
        ) {
            // SAFETY (every arm): the token proves the CPU has the kernel's features; the
            // kernel only touches memory through the safe slices it is given.
            match ty {
                GgmlType::Q8_0 => match super::q8_row_order() {
                    super::Q8RowOrder::Pairs => unsafe {
                        super::avx512::rows_q8_0(w, rb, q8_0(acts), out)
                    },
                    super::Q8RowOrder::Single => unsafe {
                        super::walk::rows_q8_0_walk_vnni(w, rb, q8_0(acts), out)
                    },
                },
                GgmlType::Q5_0 => unsafe { super::avx512::rows_q5_0(w, rb, q8_0(acts), out) },
                GgmlType::Q4_K => match super::q4k_row_order() {
                    super::Q4kRowOrder::Pairs => unsafe {
                        super::avx512::rows_q4k(w, rb, q8k(acts), out)
                    },
                    super::Q4kRowOrder::Single => unsafe {
                        super::walk::rows_q4k_walk(w, rb, q8k(acts), out)
                    },
                },
                GgmlType::Q6_K => unsafe { super::avx512::rows_q6k(w, rb, q8k(acts), out) },
                _ => super::rows_one_by_one(ty, w, rb, out, |row, o| {
                    self.dot_tile(ty, row, &[acts], std::slice::from_mut(o))
                }),
            }
        }

        /// `out[t] = row . acts[t]` (types checked by the caller).
        pub(crate) fn dot_tile(
            self,
            ty: GgmlType,
            row: &[u8],
            acts: &[&QuantizedActs],
            out: &mut [f32],
        ) {
            use GgmlType::*;
            match ty {
                Q8_0 => tiled!(acts, out, q8_0, row, super::avx512::dot_q8_0),
                Q5_0 => tiled!(acts, out, q8_0, row, super::avx512::dot_q5_0),
                // One token (matvec, decode): the AVX2 kernel is faster here; same bits.
                Q4_K if acts.len() >= 2 => tiled!(acts, out, q8k, row, super::avx512::dot_q4k),
                Q6_K => tiled!(acts, out, q8k, row, super::avx512::dot_q6k),
                // quants-k
                Q4_0 => tiled!(acts, out, q8_0, row, super::kquants::dot_q4_0_vnni),
                Q4_1 => tiled!(acts, out, q8_1, row, super::kquants::dot_q4_1_vnni),
                Q5_1 => tiled!(acts, out, q8_1, row, super::kquants::dot_q5_1_vnni),
                IQ4_NL => tiled!(acts, out, q8_0, row, super::kquants::dot_iq4_nl_vnni),
                MXFP4 => tiled!(acts, out, q8_0, row, super::kquants::dot_mxfp4_vnni),
                IQ2_XXS => tiled!(acts, out, q8k, row, crate::iq::avx2::dot512_iq2xxs),
                IQ2_XS => tiled!(acts, out, q8k, row, crate::iq::avx2::dot512_iq2xs),
                IQ1_S => tiled!(acts, out, q8k, row, crate::iq::avx2::dot512_iq1s),
                IQ1_M => tiled!(acts, out, q8k, row, crate::iq::avx2::dot512_iq1m),
                _ => self.avx2().dot_tile(ty, row, acts, out),
            }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::tokens::{Avx2, Avx512};
    use crate::{ActData, GgmlType, QuantizedActs};

    /// Activations of `nb` blocks of `block` values with a different scale in every block.
    fn varying_acts(ty: GgmlType, nb: usize, block: usize) -> QuantizedActs {
        let x: Vec<f32> = (0..nb * block)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03 * (1.0 + (i / block) as f32 * 0.37))
            .collect();
        QuantizedActs::new(ty, &x).unwrap()
    }

    /// The one-row kernel's result for each of `rows` rows of `rb` bytes: the reference the
    /// row orders must equal bit for bit.
    fn one_row_at_a_time(
        t: &Avx2,
        ty: GgmlType,
        w: &[u8],
        rb: usize,
        acts: &QuantizedActs,
        rows: usize,
    ) -> Vec<f32> {
        let mut out = vec![0f32; rows];
        for (r, o) in out.iter_mut().enumerate() {
            t.dot_tile(
                ty,
                &w[r * rb..(r + 1) * rb],
                &[acts],
                std::slice::from_mut(o),
            );
        }
        out
    }

    /// `rows` Q4_K rows of `nb` blocks: pseudo-random quants and packed scales, finite
    /// block scales different in every block (d ~0.1, dmin ~0.05).
    fn q4k_rows(rows: usize, nb: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut w: Vec<u8> = (0..rows * nb * 144)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect();
        for b in w.chunks_exact_mut(144) {
            // Random mantissa bits, fixed exponents: d and dmin differ from block to block.
            b[1] = 0x2E;
            b[3] = 0x2A;
        }
        w
    }

    /// Both Q8_0 row orders ([`super::Q8RowOrder`]: `rows_q8_0` pairs and the
    /// `rows_q8_0_walk` single-row walk, on each tier) give every row the bits of
    /// `dot_q8_0::<1>`, odd row counts and rows past the walk's stack-held scales (257
    /// blocks) included.
    #[test]
    fn q8_0_row_orders_give_the_same_bits() {
        for (rows, nb, seed) in [
            (1usize, 1usize, 1u64),
            (7, 24, 2),
            (8, 64, 3),
            (3, 256, 4),
            (2, 257, 5),
        ] {
            let mut s = seed;
            let mut w: Vec<u8> = (0..rows * nb * 34)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (s >> 56) as u8
                })
                .collect();
            for b in w.chunks_exact_mut(34) {
                // Random mantissa bits, a fixed finite exponent.
                b[1] = 0x2E;
            }
            let acts = varying_acts(GgmlType::Q8_0, nb, 32);
            let ActData::Q8_0(ys) = &acts.data else {
                panic!("Q8_0 activations are Q8_0")
            };
            let rb = nb * 34;
            let Some(t) = Avx2::new() else { return };
            let single = one_row_at_a_time(&t, GgmlType::Q8_0, &w, rb, &acts, rows);
            assert!(single.iter().all(|v| v.is_finite() && *v != 0.0));
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let mut pairs = vec![0f32; rows];
            // SAFETY: the token proves AVX2 + FMA + F16C.
            unsafe { super::avx2::rows_q8_0(&w, rb, ys, &mut pairs) };
            assert_eq!(bits(&pairs), bits(&single), "avx2 pairs, {rows} x {nb}");
            let mut walk = vec![0f32; rows];
            // SAFETY: as above.
            unsafe { super::walk::rows_q8_0_walk(&w, rb, ys, &mut walk) };
            assert_eq!(bits(&walk), bits(&single), "avx2 walk, {rows} x {nb}");
            if Avx512::new().is_some() {
                let mut walk = vec![0f32; rows];
                // SAFETY: the token proves the AVX-512 tier.
                unsafe { super::walk::rows_q8_0_walk_vnni(&w, rb, ys, &mut walk) };
                assert_eq!(bits(&walk), bits(&single), "vnni walk, {rows} x {nb}");
            }
        }
    }

    /// Both Q4_K row orders ([`super::Q4kRowOrder`]: `rows_q4k` pairs and the
    /// `rows_q4k_walk` single-row walk) give every row the bits of `dot_q4k::<1>`, on each
    /// tier this CPU has, odd row counts, 768-column rows and rows past the walk's
    /// stack-held activation terms (65 blocks) included.
    #[test]
    fn q4k_row_orders_give_the_same_bits() {
        for (rows, nb, seed) in [
            (1, 1, 1),
            (7, 3, 2),
            (8, 8, 3),
            (33, 2, 4),
            (5, 16, 5),
            (3, 64, 6),
            (2, 65, 7),
        ] {
            let w = q4k_rows(rows, nb, seed);
            let acts = varying_acts(GgmlType::Q4_K, nb, 256);
            let ActData::Q8K(ys) = &acts.data else {
                panic!("Q4_K activations are Q8_K")
            };
            let rb = nb * 144;
            let Some(t) = Avx2::new() else { return };
            let single = one_row_at_a_time(&t, GgmlType::Q4_K, &w, rb, &acts, rows);
            assert!(single.iter().all(|v| v.is_finite() && *v != 0.0));
            let mut pairs = vec![0f32; rows];
            // SAFETY: the token proves AVX2 + FMA + F16C.
            unsafe { super::avx2::rows_q4k(&w, rb, ys, &mut pairs) };
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&pairs),
                bits(&single),
                "avx2 pairs, {rows} rows of {nb} blocks"
            );
            let mut walk = vec![0f32; rows];
            // SAFETY: the token proves AVX2 + FMA + F16C.
            unsafe { super::walk::rows_q4k_walk(&w, rb, ys, &mut walk) };
            assert_eq!(
                bits(&walk),
                bits(&single),
                "single-row walk, {rows} rows of {nb} blocks"
            );
            if Avx512::new().is_some() {
                let mut pairs = vec![0f32; rows];
                // SAFETY: the token proves the AVX-512 tier.
                unsafe { super::avx512::rows_q4k(&w, rb, ys, &mut pairs) };
                assert_eq!(
                    bits(&pairs),
                    bits(&single),
                    "avx512 pairs, {rows} rows of {nb} blocks"
                );
            }
        }
    }
}
