//! The IQ grid formats (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M), in the style of
//! `fast_vs_ref.rs` and `matmul.rs`:
//! * every ISA tier on this CPU equals the scalar reference bit for bit, for any scales and
//!   activations (the kernels compute the same exact per-block integer and apply the same
//!   float operations, see `src/iq/mod.rs`);
//! * the integer part of the dot agrees exactly with the dequantizer (which the fixture test
//!   checks against the `gguf` package): with unit block scales and lossless integer
//!   activations, the integer weights are recovered from the dequantized row and the
//!   expected result is rebuilt from exact i64 block sums;
//! * the dot is within the quantization-error bound of the f32 dot of the dequantized row;
//! * matmul == matvec per token on every tier; thread count never changes results.

#![allow(clippy::needless_range_loop)] // index loops read like the formulas

mod common;
mod iq_common;

use common::{random_x, SplitMix};
use iq_common::iq_row;
use proptest::prelude::*;
use sluice_kernels::iq::{dot_mul, IQ_TYPES};
use sluice_kernels::{
    dequantize_row, matmul_with, matvec_with, vec_dot_with, GgmlType, Isa, QuantizedActs,
};

fn iq_case() -> impl Strategy<Value = (usize, usize, u64)> {
    (0..IQ_TYPES.len(), 1usize..=8, any::<u64>())
}

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn fast_equals_reference_bit_for_bit((ti, nb, seed) in iq_case()) {
        let ty = IQ_TYPES[ti];
        let cols = 256 * nb;
        let mut rng = SplitMix(seed);
        let row = iq_row(ty, cols, &mut rng, false);
        let x = random_x(ty, cols, &mut rng, false);
        let acts = QuantizedActs::new(ty, &x).unwrap();
        let reference = vec_dot_with(Isa::Scalar, ty, &row, &acts).unwrap();
        for isa in Isa::available() {
            let fast = vec_dot_with(isa, ty, &row, &acts).unwrap();
            prop_assert_eq!(fast.to_bits(), reference.to_bits(), "{:?} {}: fast {} ref {}", isa, ty, fast, reference);
        }
    }

    #[test]
    fn integer_parts_match_the_dequantizer((ti, nb, seed) in iq_case()) {
        let ty = IQ_TYPES[ti];
        let nb = 1 + nb % 3;
        let cols = 256 * nb;
        let mut rng = SplitMix(seed);
        let row = iq_row(ty, cols, &mut rng, true);
        let x = random_x(ty, cols, &mut rng, true);
        let mut w = vec![0.0f32; cols];
        dequantize_row(ty, &row, &mut w).unwrap();
        let mul = dot_mul(ty);
        // Unit scales: w = ls * q * mul exactly, so w / mul is the integer weight; the
        // activations are lossless (Q8_K d == +-1, quants == +-x).
        let acts = QuantizedActs::new(ty, &x).unwrap();
        let ys = acts.q8_k_blocks().unwrap();
        let mut want = 0.0f32;
        for b in 0..nb {
            prop_assert!(ys[b].d.abs() == 1.0);
            let mut isum = 0i64;
            for i in 0..256 {
                let wi = w[256 * b + i] / mul;
                prop_assert_eq!(wi, wi.trunc());
                prop_assert_eq!(ys[b].qs[i] as f32 * ys[b].d, x[256 * b + i]);
                isum += wi as i64 * ys[b].qs[i] as i64;
            }
            want += (1.0f32 * ys[b].d) * isum as i32 as f32 * mul;
        }
        for isa in Isa::available() {
            let got = vec_dot_with(isa, ty, &row, &acts).unwrap();
            prop_assert_eq!(got.to_bits(), want.to_bits(), "{:?} {}: got {} want {}", isa, ty, got, want);
        }
    }

    #[test]
    fn dot_within_quantization_error((ti, nb, seed) in iq_case()) {
        let ty = IQ_TYPES[ti];
        let cols = 256 * nb;
        let mut rng = SplitMix(seed);
        let row = iq_row(ty, cols, &mut rng, false);
        let x = random_x(ty, cols, &mut rng, false);
        let mut w = vec![0.0f32; cols];
        dequantize_row(ty, &row, &mut w).unwrap();
        let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let u = f32::EPSILON as f64;
        let (mut qerr, mut ferr) = (0.0f64, 0.0f64);
        for (wb, xb) in w.chunks(256).zip(x.chunks(256)) {
            let amax = xb.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64));
            let e = amax / 254.0 + 4.0 * amax * u;
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
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 60, ..ProptestConfig::default() })]

    #[test]
    fn matmul_equals_matvec((ti, nb, seed) in iq_case(), rows in 1usize..20, n in 1usize..11) {
        let ty = IQ_TYPES[ti];
        let cols = 256 * (1 + nb % 3);
        let mut rng = SplitMix(seed);
        let w: Vec<u8> = (0..rows).flat_map(|_| iq_row(ty, cols, &mut rng, false)).collect();
        let x: Vec<f32> = (0..n).flat_map(|_| random_x(ty, cols, &mut rng, false)).collect();
        for isa in Isa::available() {
            let mut ym = vec![0.0f32; n * rows];
            matmul_with(isa, ty, &w, rows, cols, &x, n, &mut ym).unwrap();
            for t in 0..n {
                let mut yv = vec![0.0f32; rows];
                matvec_with(isa, ty, &w, rows, cols, &x[t * cols..(t + 1) * cols], &mut yv).unwrap();
                for r in 0..rows {
                    prop_assert_eq!(ym[t * rows + r].to_bits(), yv[r].to_bits(), "{:?} {} t={} r={}", isa, ty, t, r);
                }
            }
        }
    }
}

#[test]
fn threads_do_not_change_results() {
    let (p1, p2) = (pool(1), pool(2));
    for ty in IQ_TYPES {
        let mut rng = SplitMix(ty.id() as u64 + 11);
        let (rows, cols, n) = (300, 512, 5);
        let w: Vec<u8> = (0..rows)
            .flat_map(|_| iq_row(ty, cols, &mut rng, false))
            .collect();
        let xs: Vec<f32> = (0..n)
            .flat_map(|_| random_x(ty, cols, &mut rng, false))
            .collect();
        for isa in Isa::available() {
            let mut y1 = vec![0.0f32; rows];
            let mut y2 = vec![1.0f32; rows];
            p1.install(|| matvec_with(isa, ty, &w, rows, cols, &xs[..cols], &mut y1))
                .unwrap();
            p2.install(|| matvec_with(isa, ty, &w, rows, cols, &xs[..cols], &mut y2))
                .unwrap();
            assert!(
                y1.iter().zip(&y2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?} {ty} matvec"
            );
            let mut m1 = vec![0.0f32; rows * n];
            let mut m2 = vec![1.0f32; rows * n];
            p1.install(|| matmul_with(isa, ty, &w, rows, cols, &xs, n, &mut m1))
                .unwrap();
            p2.install(|| matmul_with(isa, ty, &w, rows, cols, &xs, n, &mut m2))
                .unwrap();
            assert!(
                m1.iter().zip(&m2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{isa:?} {ty} matmul"
            );
        }
    }
}

#[test]
fn iq_shapes_and_activation_types_are_checked() {
    for ty in IQ_TYPES {
        assert!(sluice_kernels::is_supported(ty));
        let bs = ty.type_size() as usize;
        let mut out = vec![0.0f32; 256];
        assert!(dequantize_row(ty, &vec![0u8; bs - 1], &mut out).is_err());
        assert!(dequantize_row(ty, &vec![0u8; bs], &mut out[..255]).is_err());
        // Activations prepared for another Q8_K weight type are accepted (same Q8_K data);
        // Q8_0-prepared ones are not.
        let x = vec![0.5f32; 256];
        let row = vec![0u8; bs];
        let k = QuantizedActs::new(GgmlType::Q4_K, &x).unwrap();
        assert!(vec_dot_with(Isa::Scalar, ty, &row, &k).is_ok());
        let q8 = QuantizedActs::new(GgmlType::Q8_0, &x).unwrap();
        assert!(vec_dot_with(Isa::Scalar, ty, &row, &q8).is_err());
    }
}
