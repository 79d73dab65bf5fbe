//! Small f32 operations of the forward pass: norms, RoPE, activations, softmax.
//!
//! Owns: the element-wise math between the matrix products. Each function is written
//! once, plainly, with a fixed evaluation order so results never depend on threading.

/// `out = x / sqrt(mean(x^2) + eps) * w` (RMSNorm with a weight vector).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    let mut sum = 0.0f64;
    for &v in x {
        sum += (v as f64) * (v as f64);
    }
    let scale = (1.0 / ((sum / x.len() as f64) + eps as f64).sqrt()) as f32;
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place RMSNorm of `x` with weight `w`.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let mut sum = 0.0f64;
    for &v in x.iter() {
        sum += (v as f64) * (v as f64);
    }
    let scale = (1.0 / ((sum / x.len() as f64) + eps as f64).sqrt()) as f32;
    for (v, &g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// Inverse frequencies of NEOX-style RoPE: `base^(-2i/d)` for i in 0..d/2, times `scale`.
pub fn rope_inv_freq(head_dim: usize, base: f32, scale: f32) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let f = 1.0 / (base as f64).powf((2 * i) as f64 / head_dim as f64);
            (f as f32) * scale
        })
        .collect()
}

/// Rotate one head in place, NEOX layout: element i pairs with element i + d/2.
pub fn rope_neox(head: &mut [f32], pos: usize, inv_freq: &[f32]) {
    let half = head.len() / 2;
    for (i, &f) in inv_freq.iter().enumerate() {
        let angle = pos as f32 * f;
        let (sin, cos) = (angle as f64).sin_cos();
        let (sin, cos) = (sin as f32, cos as f32);
        let a = head[i];
        let b = head[i + half];
        head[i] = a * cos - b * sin;
        head[i + half] = a * sin + b * cos;
    }
}

/// `cs[i] = (cos, sin)` of `pos * inv_freq[i]`: the rotation of every head at `pos`.
pub fn rope_cos_sin(pos: usize, inv_freq: &[f32], cs: &mut Vec<(f32, f32)>) {
    cs.clear();
    cs.extend(inv_freq.iter().map(|&f| {
        let angle = pos as f32 * f;
        let (sin, cos) = (angle as f64).sin_cos();
        (cos as f32, sin as f32)
    }));
}

/// [`rope_neox`] with the rotation precomputed by [`rope_cos_sin`] (same results).
pub fn rope_neox_cs(head: &mut [f32], cs: &[(f32, f32)]) {
    let half = head.len() / 2;
    let (lo, hi) = head.split_at_mut(half);
    for ((a, b), &(cos, sin)) in lo.iter_mut().zip(hi.iter_mut()).zip(cs) {
        let (x, y) = (*a, *b);
        *a = x * cos - y * sin;
        *b = x * sin + y * cos;
    }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

pub use sluice_kernels::act::{exp_approx, gelu_tanh};

/// SiLU: x * sigmoid(x).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_matches_the_tanh_form_in_f64() {
        let mut x = -12.0f32;
        while x <= 12.0 {
            let xd = x as f64;
            let u = (2.0f64 / std::f64::consts::PI).sqrt() * (xd + 0.044_715 * xd * xd * xd);
            // x / (1 + e^-2u) == 0.5 x (1 + tanh u); unlike tanh it does not round to
            // exactly -1 in f64 for x < -9, so it is the accurate reference there.
            let want = xd / (1.0 + (-2.0 * u).exp());
            if x > -4.0 {
                // Away from the cancellation in 1 + tanh u, the forms agree in f64.
                let tanh_form = 0.5 * xd * (1.0 + u.tanh());
                assert!((want - tanh_form).abs() <= 1e-9 * want.abs() + 1e-30);
            }
            let got = gelu_tanh(x) as f64;
            // f32 rounding of u is amplified by e^-2u for negative x: relative error
            // grows like |u| * 2^-24 there (the tanh form in f32 loses more to 1 + tanh).
            assert!(
                (got - want).abs() <= 1e-6 * (1.0 + u.abs()) * want.abs() + 1e-30,
                "x={x}: {got} vs {want}"
            );
            x += 0.001_3;
        }
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert_eq!(gelu_tanh(100.0), 100.0);
        assert!(gelu_tanh(-100.0).abs() < 1e-30);
    }

    #[test]
    fn exp_approx_is_within_3_ulp_of_f64_exp() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            let ulp = f32::EPSILON as f64 * want;
            assert!((got - want).abs() <= 3.0 * ulp, "x={x}: {got} vs {want}");
            x += 0.0173;
        }
    }

    #[test]
    fn rope_tables_equal_per_head_rope() {
        let inv = rope_inv_freq(16, 10_000.0, 1.0);
        let mut cs = Vec::new();
        for pos in [0usize, 1, 7, 1000] {
            let mut a: Vec<f32> = (0..16).map(|i| i as f32 * 0.37 - 2.0).collect();
            let mut b = a.clone();
            rope_neox(&mut a, pos, &inv);
            rope_cos_sin(pos, &inv, &mut cs);
            rope_neox_cs(&mut b, &cs);
            assert_eq!(a, b);
        }
    }

    #[test]
    fn top_k_breaks_ties_by_lower_index() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(top_k(&[5.0, 5.0, 5.0], 1), vec![0]);
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut x = [1.0f32, 2.0, 3.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[0] < x[1] && x[1] < x[2]);
        // e^1 / (e^1+e^2+e^3) computed by hand.
        assert!((x[0] - 0.090_030_57).abs() < 1e-6);
    }

    #[test]
    fn rope_at_position_zero_is_identity() {
        let inv = rope_inv_freq(8, 10_000.0, 1.0);
        let mut h = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = h;
        rope_neox(&mut h, 0, &inv);
        assert_eq!(h, orig);
    }

    #[test]
    fn rope_rotates_pairs_by_pos_times_freq() {
        let inv = rope_inv_freq(4, 100.0, 1.0);
        // inv = [1, 0.1]; pair (0,2) rotates by 3 rad at pos 3.
        let mut h = [1.0f32, 0.0, 0.0, 1.0];
        rope_neox(&mut h, 3, &inv);
        assert!((h[0] - 3.0f32.cos()).abs() < 1e-6);
        assert!((h[2] - 3.0f32.sin()).abs() < 1e-6);
        assert!((h[1] - -(0.3f32.sin())).abs() < 1e-6);
        assert!((h[3] - 0.3f32.cos()).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_of_constant_vector_is_weight() {
        let x = [2.0f32; 4];
        let w = [1.0f32, 2.0, 3.0, 4.0];
        let mut out = [0.0f32; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        for (o, g) in out.iter().zip(w) {
            assert!((o - g).abs() < 1e-6);
        }
    }
}
