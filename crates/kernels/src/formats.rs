//! Block layouts (ggml's, byte for byte) and activation quantization.
//!
//! Owns: the byte geometry of every supported weight block, f16/bf16 scalar conversion,
//! the activation blocks [`BlockQ8_0`] / [`BlockQ8K`] and the quantizers that fill them
//! (`quantize_row_q8_0`, `quantize_row_q8_k`), which follow llama.cpp's x86 build so that
//! the integers fed to the dot products are the ones llama.cpp uses.

use half::f16;

mod kquants;
pub use kquants::*;

/// Elements per block of Q8_0 / Q5_0.
pub const QK8_0: usize = 32;
/// Elements per super-block of the K-quants.
pub const QK_K: usize = 256;

/// Q8_0: `{ f16 d; i8 qs[32] }`.
pub const Q8_0_BYTES: usize = 34;
/// Q5_0: `{ f16 d; u8 qh[4]; u8 qs[16] }` (qh is a little-endian u32 of high bits).
pub const Q5_0_BYTES: usize = 22;
/// Q4_K: `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`.
pub const Q4_K_BYTES: usize = 144;
/// Q6_K: `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`.
pub const Q6_K_BYTES: usize = 210;

/// f16 bits -> f32 (exact).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// All 65536 f16 values as f32 (256 KiB, built once from [`f16_to_f32`]). The SIMD kernels
/// read block scales from here: a plain load has no false dependency, unlike a one-lane
/// F16C conversion, which LLVM lowers to a register-merging `vpinsrw`.
pub fn f16_table() -> &'static [f32; 65536] {
    static TABLE: std::sync::OnceLock<Box<[f32; 65536]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let v: Vec<f32> = (0..=u16::MAX).map(f16_to_f32).collect();
        v.into_boxed_slice().try_into().expect("65536 entries")
    })
}

/// f32 -> f16 bits, round to nearest even (ggml's `GGML_FP32_TO_FP16`).
#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    f16::from_f32(v).to_bits()
}

/// bf16 bits -> f32 (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Little-endian u16 at `b[i..i + 2]`.
#[inline]
pub fn le_u16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// Scale `j` (0..8) and min `j` of a Q4_K block's 12 packed 6-bit scale bytes
/// (ggml's `get_scale_min_k4`).
#[inline]
pub fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// All 8 scales then all 8 mins of a Q4_K block, unpacked to bytes.
#[inline]
pub fn q4k_unpack_scales(q: &[u8]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for j in 0..8 {
        let (s, m) = q4k_scale_min(j, q);
        out[j] = s;
        out[8 + j] = m;
    }
    out
}

/// One Q8_0 activation block: `d` is f16 bits, values `d * qs[i]`, |qs| <= 127.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale, f16 bits.
    pub d: u16,
    /// Quants in -127..=127.
    pub qs: [i8; QK8_0],
}

/// One Q8_K activation super-block: values `d * qs[i]`, |qs| <= 127, and
/// `bsums[j]` = sum of `qs[16 j .. 16 j + 16]`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8K {
    /// Scale (f32, as in ggml).
    pub d: f32,
    /// Quants in -127..=127.
    pub qs: [i8; QK_K],
    /// Sums of each 16 consecutive quants.
    pub bsums: [i16; QK_K / 16],
}

/// Round to nearest, ties to even, for |x| < 2^22 (all the quantizers need: their inputs
/// are scaled into [-128, 128]). Adding and subtracting 1.5 * 2^23 leaves no fraction bits,
/// so the FPU's default round-to-nearest-even does the rounding; unlike
/// `f32::round_ties_even` this never becomes a `rintf` call on baseline x86-64.
/// NaN stays NaN (and casts to 0, as before); a zero result may lose its sign.
#[inline(always)]
pub fn round_half_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x.round_ties_even()
    }
}

/// `(round_half_even(x) as i32).clamp(-128, 127) as i8` for `|x| < 2^22` or NaN (NaN
/// gives 0, as the saturating float cast does), in integer steps that vectorize (the
/// float-to-int cast does not): `x + 1.5 * 2^23` (the add of [`round_half_even`]) lands
/// in the binade where the step is 1, so its bits minus the constant's bits are the
/// rounded integer.
#[inline(always)]
fn round_small_to_i8(x: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let y = x + MAGIC;
    #[allow(clippy::eq_op)] // false only for NaN
    let r = if y == y {
        y.to_bits() as i32 - MAGIC.to_bits() as i32
    } else {
        0
    };
    r.clamp(-128, 127) as i8
}

/// Largest `|v|` of `x` (0 for an empty slice; NaN ignored, as `f32::max` does), in eight
/// lanes: max is exact in any order, so this equals the sequential fold.
#[inline(always)]
fn abs_max(x: &[f32]) -> f32 {
    let mut m = [0.0f32; 8];
    let c = x.chunks_exact(8);
    let rest = c.remainder();
    for b in c {
        for l in 0..8 {
            m[l] = m[l].max(b[l].abs());
        }
    }
    let mut r = m.iter().fold(0.0f32, |a, &b| a.max(b));
    for v in rest {
        r = r.max(v.abs());
    }
    r
}

/// Quantize `x` (a multiple of 32 long) to Q8_0 the way llama.cpp's x86 `quantize_row_q8_0`
/// does: `d = amax / 127` stored as f16, `q = round_half_even(x * (127 / amax))`.
pub fn quantize_row_q8_0(x: &[f32]) -> Vec<BlockQ8_0> {
    debug_assert_eq!(x.len() % QK8_0, 0);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), the only feature it enables.
        return unsafe { quantize_row_q8_0_avx2(x) };
    }
    quantize_row_q8_0_body(x)
}

/// [`quantize_row_q8_0`] compiled for AVX2 (same operations per element, same bits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_row_q8_0_avx2(x: &[f32]) -> Vec<BlockQ8_0> {
    quantize_row_q8_0_body(x)
}

/// The body of [`quantize_row_q8_0`], inlined into each compiled form.
#[inline(always)]
fn quantize_row_q8_0_body(x: &[f32]) -> Vec<BlockQ8_0> {
    let mut out = Vec::with_capacity(x.len() / QK8_0);
    for xb in x.chunks_exact(QK8_0) {
        let amax = abs_max(xb);
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut qs = [0i8; QK8_0];
        if amax.is_finite() {
            // |v * id| <= 127 (+ rounding): round_half_even's short form holds for
            // every element, so the loop has no branch and vectorizes.
            for (q, &v) in qs.iter_mut().zip(xb) {
                *q = round_small_to_i8(v * id);
            }
        } else {
            for (q, &v) in qs.iter_mut().zip(xb) {
                *q = round_half_even(v * id) as i8;
            }
        }
        out.push(BlockQ8_0 {
            d: f32_to_f16(d),
            qs,
        });
    }
    out
}

/// One Q8_1 activation block (paired with Q4_1 / Q5_1 weights, as ggml pairs them): the
/// Q8_0 quants and scale plus `s = f16(d * sum qs)` with `d` the unrounded f32 scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct BlockQ8_1 {
    /// Scale, f16 bits.
    pub d: u16,
    /// `d * sum(qs)` rounded to f16 (bits), `d` before its own rounding.
    pub s: u16,
    /// Quants in -127..=127.
    pub qs: [i8; QK8_0],
}

/// Quantize `x` (a multiple of 32 long) to Q8_1 like ggml's x86 `quantize_row_q8_1`: the
/// quants and scale of [`quantize_row_q8_0`] plus the block sum `s = f16(d * sum q)`.
pub fn quantize_row_q8_1(x: &[f32]) -> Vec<BlockQ8_1> {
    debug_assert_eq!(x.len() % QK8_0, 0);
    x.chunks_exact(QK8_0)
        .zip(quantize_row_q8_0(x))
        .map(|(xb, b)| {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
            BlockQ8_1 {
                d: b.d,
                s: f32_to_f16(d * sum as f32),
                qs: b.qs,
            }
        })
        .collect()
}

/// Quantize `x` (a multiple of 256 long) to Q8_K exactly like ggml's
/// `quantize_row_q8_K_ref`: the element of largest magnitude `max` (first one wins) gives
/// `iscale = -127 / max`, `q = min(127, nearest_int(iscale * x))`, `d = 1 / iscale`.
pub fn quantize_row_q8_k(x: &[f32]) -> Vec<BlockQ8K> {
    debug_assert_eq!(x.len() % QK_K, 0);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above), the only feature it enables.
        return unsafe { quantize_row_q8_k_avx2(x) };
    }
    quantize_row_q8_k_body(x)
}

/// [`quantize_row_q8_k`] compiled for AVX2: the same IEEE operations on each element
/// (multiply, the add/subtract rounding, compare) in wider vectors, so the same bits; a
/// prefill quantizes every expert's gathered input with it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_row_q8_k_avx2(x: &[f32]) -> Vec<BlockQ8K> {
    quantize_row_q8_k_body(x)
}

/// The body of [`quantize_row_q8_k`], inlined into each compiled form (plain loops, no
/// closures, so all of it takes the enclosing function's target features).
#[inline(always)]
fn quantize_row_q8_k_body(x: &[f32]) -> Vec<BlockQ8K> {
    let mut out = Vec::with_capacity(x.len() / QK_K);
    for xb in x.chunks_exact(QK_K) {
        // The first element of largest magnitude (NaN never wins a comparison).
        let amax = abs_max(xb);
        let mut max = 0.0f32;
        if amax != 0.0 {
            for &v in xb {
                if v.abs() == amax {
                    max = v;
                    break;
                }
            }
        }
        let mut b = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        if amax == 0.0 {
            out.push(b);
            continue;
        }
        let iscale = -127.0 / max;
        if amax.is_finite() {
            // |iscale * v| <= 127 (+ rounding): branch-free rounding, vectorizes.
            for (q, &v) in b.qs.iter_mut().zip(xb) {
                *q = round_small_to_i8(iscale * v);
            }
        } else {
            for (q, &v) in b.qs.iter_mut().zip(xb) {
                let r = round_half_even(iscale * v) as i32;
                *q = r.clamp(-128, 127) as i8;
            }
        }
        for (s, qs) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            let mut acc = 0i16;
            for &q in qs {
                acc += q as i16;
            }
            *s = acc;
        }
        b.d = 1.0 / iscale;
        out.push(b);
    }
    out
}

/// [`quantize_row_q8_0`]'s loops for callers compiled with a vector tier's features
/// (batch preparation): inlined there, the same operations, the same bits.
#[inline(always)]
pub(crate) fn quantize_row_q8_0_inline(x: &[f32]) -> Vec<BlockQ8_0> {
    debug_assert_eq!(x.len() % QK8_0, 0);
    quantize_row_q8_0_body(x)
}

/// [`quantize_row_q8_k`]'s loops for callers compiled with a vector tier's features
/// (batch preparation): inlined there, the same operations, the same bits.
#[inline(always)]
pub(crate) fn quantize_row_q8_k_inline(x: &[f32]) -> Vec<BlockQ8K> {
    debug_assert_eq!(x.len() % QK_K, 0);
    quantize_row_q8_k_body(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The element-wise forms the vectorizable quantizers replaced (kept as the oracle).
    fn q8_0_scalar(x: &[f32]) -> Vec<(u16, [i8; QK8_0])> {
        x.chunks_exact(QK8_0)
            .map(|xb| {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                let mut qs = [0i8; QK8_0];
                for (q, v) in qs.iter_mut().zip(xb) {
                    *q = round_half_even(v * id) as i8;
                }
                (f32_to_f16(amax / 127.0), qs)
            })
            .collect()
    }

    fn q8_k_scalar(x: &[f32]) -> Vec<(u32, Vec<i8>)> {
        x.chunks_exact(QK_K)
            .map(|xb| {
                let (mut amax, mut max) = (0.0f32, 0.0f32);
                for &v in xb {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = v;
                    }
                }
                if amax == 0.0 {
                    return (0, vec![0; QK_K]);
                }
                let iscale = -127.0 / max;
                let qs = xb
                    .iter()
                    .map(|v| (round_half_even(iscale * v) as i32).clamp(-128, 127) as i8)
                    .collect();
                ((1.0 / iscale).to_bits(), qs)
            })
            .collect()
    }

    #[test]
    fn round_small_to_i8_equals_the_float_form() {
        let mut s = 0x2545_f491u32;
        let mut xs = vec![
            0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 127.5, -128.5, 0.0, -0.0,
        ];
        xs.extend([300.0, -300.0, 1e6, -1e6, f32::NAN, 0.49999997, -0.49999997]);
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            xs.push((s as f32 / u32::MAX as f32 - 0.5) * 400.0);
        }
        for x in xs {
            let want = (round_half_even(x) as i32).clamp(-128, 127) as i8;
            assert_eq!(round_small_to_i8(x), want, "{x}");
        }
    }

    #[test]
    fn quantizers_equal_the_element_wise_forms() {
        let mut s = 0x9e37_79b9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        for case in 0..400 {
            let mut x: Vec<f32> = (0..QK_K * 2)
                .map(|_| (next() as i32 as f32) * f32::powi(2.0, case % 40 - 50))
                .collect();
            match case % 5 {
                0 => x[17] = f32::NAN,
                1 => x[300] = f32::INFINITY,
                2 => x[..QK_K].iter_mut().for_each(|v| *v = 0.0),
                3 => {
                    // Ties for the largest magnitude: the first one must win.
                    x[40] = -1e3;
                    x[41] = 1e3;
                }
                _ => {}
            }
            let q0: Vec<_> = quantize_row_q8_0(&x).iter().map(|b| (b.d, b.qs)).collect();
            assert_eq!(q0, q8_0_scalar(&x), "case {case}");
            // The portable form too (the public functions take the AVX2 one where the
            // CPU has it).
            let p0: Vec<_> = quantize_row_q8_0_body(&x)
                .iter()
                .map(|b| (b.d, b.qs))
                .collect();
            assert_eq!(p0, q0, "case {case}");
            let portable = quantize_row_q8_k_body(&x);
            let blocks = quantize_row_q8_k(&x);
            assert_eq!(portable, blocks, "case {case}");
            let qk: Vec<_> = blocks
                .iter()
                .map(|b| (b.d.to_bits(), b.qs.to_vec()))
                .collect();
            assert_eq!(qk, q8_k_scalar(&x), "case {case}");
            for b in &blocks {
                for (j, &bs) in b.bsums.iter().enumerate() {
                    let want: i16 = b.qs[16 * j..16 * j + 16].iter().map(|&q| q as i16).sum();
                    assert_eq!(bs, want);
                }
            }
        }
    }

    #[test]
    fn round_half_even_equals_std_on_ties_and_random_values() {
        for x in [
            0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.5, 0.0, -0.0, 0.49999997,
        ] {
            // Values agree; the sign of a zero result may not (-0.5 gives +0), which the
            // integer casts of the quantizers cannot see.
            assert_eq!(round_half_even(x), x.round_ties_even(), "{x}");
        }
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = (s as f32 / u32::MAX as f32 - 0.5) * 300.0;
            assert_eq!(round_half_even(x), x.round_ties_even(), "{x}");
        }
        assert!(round_half_even(f32::NAN).is_nan());
        assert_eq!(round_half_even(1e9), 1e9);
    }
}
