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

/// GELU, tanh approximation (what Gemma's `gelu_pytorch_tanh` and ggml's `gelu` compute).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

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
