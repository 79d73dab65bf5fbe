//! Every ISA tier available on this CPU against the scalar reference, and every quantized
//! dot against a plain f32 dot of the dequantized row (the oracle for the quantization).
//!
//! Bounds (u = f32::EPSILON):
//! * exact mode (unit block scales, integer activations whose Q8 quantization is lossless,
//!   total magnitude T < 2^24): fast == reference bit for bit. This checks the integer
//!   block sums exactly: any integer difference would change the result.
//! * general: |fast - ref| <= (2 * n_terms + 16) * u * T, where T = sum over blocks of
//!   |block scale| * sum_i |q_i * y_i| (+ the same for Q4_K's min term), and n_terms the
//!   number of blocks (dense: elements). This is the worst-case f32 summation bound for two
//!   different summation orders of the same exact terms.
//! * quantization error: |dot(row, Q8(x)) - sum_i w_i x_i| <= sum_b sum_i |w_i| * e_b +
//!   (2 * cols + 16) * u * sum_i |w_i| (|x_i| + e_b), where e_b bounds |x - dequant(Q8(x))| in
//!   activation block b: Q8_0: d/2 + 127 |d - f16(d)| + amax u (d = amax / 127);
//!   Q8_K: amax / 254 + 4 amax u.

#![allow(clippy::needless_range_loop)] // index loops read like the formulas

mod common;

use common::*;
use proptest::prelude::*;
use sluice_kernels::formats::{f16_to_f32, quantize_row_q8_0, quantize_row_q8_k};
use sluice_kernels::{dequantize_row, matmul_with, vec_dot_with, GgmlType, Isa, QuantizedActs};

/// T of the module docs: the sum of absolute values of the exact terms.
fn abs_terms(ty: GgmlType, row: &[u8], x: &[f32]) -> f64 {
    let cols = x.len();
    let mut w = vec![0.0f32; cols];
    dequantize_row(ty, row, &mut w).unwrap();
    let acts = QuantizedActs::new(ty, x).unwrap();
    let mut t = 0.0f64;
    if let Some(ys) = acts.f32_values() {
        return w
            .iter()
            .zip(ys)
            .map(|(a, b)| (*a as f64 * *b as f64).abs())
            .sum();
    }
    if let Some(ys) = acts.q8_0_blocks() {
        for (b, yb) in ys.iter().enumerate() {
            let dy = f16_to_f32(yb.d) as f64;
            let m = min_term(ty, row, b);
            for i in 0..32 {
                t += (w[32 * b + i] as f64 * dy * yb.qs[i] as f64).abs();
                t += 2.0 * (m * dy * yb.qs[i] as f64).abs();
            }
        }
        return t;
    }
    if let Some(ys) = acts.q8_1_blocks() {
        // Quant terms bounded through |w| + 2 |m|, plus the min term m * s.
        for (b, yb) in ys.iter().enumerate() {
            let dy = f16_to_f32(yb.d) as f64;
            let m = min_term(ty, row, b);
            for i in 0..32 {
                t += (w[32 * b + i] as f64 * dy * yb.qs[i] as f64).abs();
                t += 2.0 * (m * dy * yb.qs[i] as f64).abs();
            }
            t += (m * f16_to_f32(yb.s) as f64).abs();
        }
        return t;
    }
    let ys = acts.q8_k_blocks().unwrap();
    // Formats with a min (w = d*sc*q - dmin*m): bound both parts by |w| + 2 |dmin*m|.
    for (b, yb) in ys.iter().enumerate() {
        let m = min_term(ty, row, b);
        for i in 0..256 {
            t += (w[256 * b + i] as f64 * yb.d as f64 * yb.qs[i] as f64).abs();
            t += 2.0 * (m * yb.d as f64 * yb.qs[i] as f64).abs();
        }
    }
    t
}

fn n_terms(ty: GgmlType, cols: usize) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => cols,
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q2_K => 2 * cols / 256,
        GgmlType::Q4_1 | GgmlType::Q5_1 => 2 * cols / 32,
        _ => cols / ty.block_size() as usize,
    }
}

fn check_tiers(ty: GgmlType, row: &[u8], x: &[f32], exact: bool) -> Result<(), TestCaseError> {
    let acts = QuantizedActs::new(ty, x).unwrap();
    let reference = vec_dot_with(Isa::Scalar, ty, row, &acts).unwrap();
    let t = abs_terms(ty, row, x);
    for isa in Isa::available() {
        let fast = vec_dot_with(isa, ty, row, &acts).unwrap();
        if exact && t < (1u64 << 24) as f64 {
            prop_assert_eq!(
                fast.to_bits(),
                reference.to_bits(),
                "{:?} {} exact: fast {} ref {}",
                isa,
                ty,
                fast,
                reference
            );
        } else {
            let bound = (2 * n_terms(ty, x.len()) + 16) as f64 * f32::EPSILON as f64 * t;
            let err = (fast as f64 - reference as f64).abs();
            prop_assert!(
                err <= bound,
                "{:?} {}: fast {} ref {} err {} > bound {}",
                isa,
                ty,
                fast,
                reference,
                err,
                bound
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn fast_dot_matches_reference((ti, nb, seed) in case()) {
        let ty = TYPES[ti];
        let cols = cols_for(ty, nb, seed);
        let mut rng = SplitMix(seed);
        let row = random_row(ty, cols, &mut rng, false);
        let x = random_x(ty, cols, &mut rng, false);
        check_tiers(ty, &row, &x, false)?;
    }

    #[test]
    fn fast_dot_integer_parts_exact((ti, nb, seed) in case()) {
        let ty = TYPES[ti];
        let nb = if ty.block_size() == 256 { 1 + nb % 2 } else { nb };
        let cols = cols_for(ty, nb, seed);
        let mut rng = SplitMix(seed);
        let row = random_row(ty, cols, &mut rng, true);
        let x = random_x(ty, cols, &mut rng, true);
        check_tiers(ty, &row, &x, true)?;
    }

    #[test]
    fn quantized_dot_within_quantization_error((ti, nb, seed) in case()) {
        let ty = TYPES[ti];
        let cols = cols_for(ty, nb, seed);
        let mut rng = SplitMix(seed);
        let row = random_row(ty, cols, &mut rng, false);
        let x = random_x(ty, cols, &mut rng, false);
        let mut w = vec![0.0f32; cols];
        dequantize_row(ty, &row, &mut w).unwrap();
        let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let ablock = act_block(ty);
        let u = f32::EPSILON as f64;
        let mut qerr = 0.0f64;
        let mut ferr = 0.0f64;
        for (wb, xb) in w.chunks(ablock).zip(x.chunks(ablock)) {
            let amax = xb.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            let e = match ablock {
                32 => {
                    let d = amax / 127.0;
                    let dh = half::f16::from_f64(d).to_f64();
                    d / 2.0 + 127.0 * (d - dh).abs() + amax * u
                }
                256 => amax / 254.0 + 4.0 * amax * u,
                _ => 0.0,
            };
            for (a, b) in wb.iter().zip(xb) {
                qerr += (*a as f64).abs() * e;
                ferr += (*a as f64).abs() * ((*b as f64).abs() + e);
            }
        }
        let bound = qerr + (2 * cols + 16) as f64 * u * ferr;
        let acts = QuantizedActs::new(ty, &x).unwrap();
        for isa in Isa::available() {
            let got = vec_dot_with(isa, ty, &row, &acts).unwrap() as f64;
            prop_assert!((got - exact).abs() <= bound, "{:?} {}: got {} f32 dot {} bound {}", isa, ty, got, exact, bound);
        }
    }

    #[test]
    fn q8_quantizers_follow_ggml(nb in 1usize..8, seed in any::<u64>()) {
        // Integer outputs checked against a direct transcription of ggml's rules in f64-free
        // f32 arithmetic (x86 quantize_row_q8_0 and quantize_row_q8_K_ref).
        let mut rng = SplitMix(seed);
        let x: Vec<f32> = (0..nb * 256).map(|_| rng.unit() * rng.scale(1e-3, 1e3).abs()).collect();
        for (b, blk) in quantize_row_q8_0(&x).iter().enumerate() {
            let xb = &x[32 * b..32 * b + 32];
            let amax = xb.iter().fold(0.0f32, |m, v| if v.abs() > m { v.abs() } else { m });
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            prop_assert_eq!(blk.d, half::f16::from_f32(amax / 127.0).to_bits());
            for i in 0..32 {
                let r = xb[i] * id;
                // round half to even
                let fl = r.floor();
                let want = if r - fl > 0.5 || (r - fl == 0.5 && (fl as i32) % 2 != 0) { fl + 1.0 } else { fl };
                prop_assert_eq!(blk.qs[i] as f32, want);
            }
        }
        for (b, blk) in quantize_row_q8_k(&x).iter().enumerate() {
            let xb = &x[256 * b..256 * b + 256];
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in xb { if v.abs() > amax { amax = v.abs(); max = v; } }
            let iscale = -127.0 / max;
            prop_assert_eq!(blk.d, 1.0 / iscale);
            for i in 0..256 {
                // ggml's nearest_int: add 1.5 * 2^23 and read the mantissa.
                let val = iscale * xb[i] + 12582912.0f32;
                let want = ((val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000).min(127);
                prop_assert_eq!(blk.qs[i] as i32, want);
            }
            for j in 0..16 {
                let s: i32 = blk.qs[16 * j..16 * j + 16].iter().map(|&q| q as i32).sum();
                prop_assert_eq!(blk.bsums[j] as i32, s);
            }
        }
    }
}

#[test]
fn every_tier_on_this_cpu_is_tested() {
    let tiers = Isa::available();
    eprintln!("tiers tested: {tiers:?}");
    assert_eq!(tiers[0], Isa::Scalar);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        assert!(tiers.contains(&Isa::Avx2));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    /// The AVX-512 Q4_K / Q6_K kernels (512-bit `vpdpbusd` + `vpdpwssd` scale) keep the AVX2
    /// kernels' i32 lanes and float steps: equal bit for bit, any scales and activations,
    /// through matmul (tiles of 1..=8 tokens; Q4_K takes the AVX-512 kernel from 2 tokens).
    #[test]
    fn avx512_k_quants_equal_avx2_bit_for_bit(
        q6 in any::<bool>(),
        nb in 1usize..=4,
        rows in 1usize..=3,
        n in 1usize..=10,
        seed in any::<u64>(),
    ) {
        let ty = if q6 { GgmlType::Q6_K } else { GgmlType::Q4_K };
        let tiers = Isa::available();
        if !(tiers.contains(&Isa::Avx2) && tiers.contains(&Isa::Avx512)) {
            return Ok(());
        }
        let cols = 256 * nb;
        let mut rng = SplitMix(seed);
        let w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng, false)).collect();
        let mut x: Vec<f32> = (0..n).flat_map(|_| random_x(ty, cols, &mut rng, false)).collect();
        // Some blocks at full scale: the activations' quants reach +-127.
        if seed % 3 == 0 {
            for v in x.iter_mut().step_by(7) {
                *v = if seed % 2 == 0 { 1e3 } else { -1e3 };
            }
        }
        let mut a = vec![0.0f32; n * rows];
        let mut b = vec![0.0f32; n * rows];
        matmul_with(Isa::Avx2, ty, &w, rows, cols, &x, n, &mut a).unwrap();
        matmul_with(Isa::Avx512, ty, &w, rows, cols, &x, n, &mut b).unwrap();
        for (i, (a, b)) in a.iter().zip(&b).enumerate() {
            prop_assert_eq!(a.to_bits(), b.to_bits(), "{} [{}]: avx2 {} avx512 {}", ty, i, a, b);
        }
    }
}
