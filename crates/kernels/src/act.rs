//! Element-wise activations of the feed-forward blocks.
//!
//! Owns: [`gelu_tanh`] and [`exp_approx`] (plain f32 arithmetic, no libm: deterministic
//! and vectorizable) and [`geglu`], the GeGLU combination over whole rows, compiled once
//! per ISA tier and picked at run time. Every tier runs the same scalar code (wider
//! registers only: no reassociation, no fused multiply-add), so every tier gives the same
//! bits.

use crate::{isa, Backend, Isa, KernelError};

/// GELU, tanh approximation (what Gemma's `gelu_pytorch_tanh` and ggml's `gelu` compute).
///
/// Evaluated as `x / (1 + exp(-2u))` with `u = sqrt(2/pi) (x + 0.044715 x^3)`, which equals
/// `0.5 x (1 + tanh(u))`, using [`exp_approx`] (plain f32 arithmetic: it vectorizes and
/// never calls libm). Agrees with the exact value (computed in f64) within
/// `1e-6 * (1 + |u|)` relative plus 1e-30 absolute, see the test.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
    x / (1.0 + exp_approx(-2.0 * u))
}

/// `e^x` in plain f32 arithmetic (range reduction by ln 2, degree-6 Taylor polynomial on
/// |r| <= ln2/2, scale by 2^n through the exponent bits): within 3 ulp of the exact value
/// for x in [-87, 88]; inputs are clamped to that range (so +inf -> e^88, -inf -> e^-87,
/// NaN stays NaN through the polynomial). Deterministic: same bits on every call.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 rounded to 17 bits: n * LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6; // ln 2 - LN2_HI
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: round to nearest integer
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + MAGIC) - MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n for n in -126..=127 through the exponent field.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
}

/// `g[i] = gelu_tanh(g[i]) * u[i]` for every element, on the tier [`isa()`] chose.
pub fn geglu(g: &mut [f32], u: &[f32]) -> Result<(), KernelError> {
    geglu_with(isa(), g, u)
}

/// [`geglu`] on an explicit tier (tests, benches).
pub fn geglu_with(isa: Isa, g: &mut [f32], u: &[f32]) -> Result<(), KernelError> {
    let be = Backend::new(isa)?;
    crate::shape("geglu", crate::GgmlType::F32, "up length", g.len(), u.len())?;
    match be {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2; slices only.
        Backend::Avx2(_) => unsafe { x86::geglu_avx2(g, u) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the CPU has AVX2 and AVX-512 F/BW/VL; slices only.
        Backend::Avx512(_) => unsafe { x86::geglu_avx512(g, u) },
        _ => geglu_loop(g, u),
    }
    Ok(())
}

#[inline(always)]
fn geglu_loop(g: &mut [f32], u: &[f32]) {
    for (g, &u) in g.iter_mut().zip(u) {
        *g = gelu_tanh(*g) * u;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx2")]
    pub(super) fn geglu_avx2(g: &mut [f32], u: &[f32]) {
        super::geglu_loop(g, u)
    }

    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl")]
    pub(super) fn geglu_avx512(g: &mut [f32], u: &[f32]) {
        super::geglu_loop(g, u)
    }
}
