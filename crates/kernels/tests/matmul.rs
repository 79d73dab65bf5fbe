//! matmul == matvec per token, bit for bit, on every tier; matvec (whose single-token row
//! kernels run two rows interleaved) == the one-row dot on each row, bit for bit; matvec with 1 vs 2 rayon
//! threads bit for bit; shape errors are typed errors, not panics.

mod common;

use common::*;
use proptest::prelude::*;
use sluice_kernels::{
    matmul_with, matvec_with, vec_dot_with, GgmlType, Isa, KernelError, QuantizedActs,
};

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

fn matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut SplitMix) -> Vec<u8> {
    (0..rows)
        .flat_map(|_| random_row(ty, cols, rng, false))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    #[test]
    fn matmul_equals_matvec((ti, nb, seed) in case(), rows in 1usize..24, n in 1usize..11) {
        let ty = TYPES[ti];
        let cols = cols_for(ty, nb, seed);
        let mut rng = SplitMix(seed);
        let w = matrix(ty, rows, cols, &mut rng);
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 120, ..ProptestConfig::default() })]

    /// The multi-row matvec kernels (two rows interleaved, a single-row remainder) give
    /// every row the bits of the one-row dot, on every tier, for odd and even row counts.
    #[test]
    fn matvec_rows_equal_single_row_dots((ti, nb, seed) in case(), rows in 1usize..24) {
        let ty = TYPES[ti];
        let cols = cols_for(ty, nb, seed);
        let mut rng = SplitMix(seed);
        let w = matrix(ty, rows, cols, &mut rng);
        let x = random_x(ty, cols, &mut rng, false);
        let acts = QuantizedActs::new(ty, &x).unwrap();
        let rb = w.len() / rows;
        for isa in Isa::available() {
            let mut y = vec![0.0f32; rows];
            matvec_with(isa, ty, &w, rows, cols, &x, &mut y).unwrap();
            for r in 0..rows {
                let d = vec_dot_with(isa, ty, &w[r * rb..(r + 1) * rb], &acts).unwrap();
                prop_assert_eq!(y[r].to_bits(), d.to_bits(), "{:?} {} r={}", isa, ty, r);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// The register-blocked K-quant tiles (Q2_K-Q6_K; rows x tokens, AVX2: 2 x 4,
    /// AVX-512: 4 x 4, every partial tile) give each (row, token) the bits of the single-row
    /// matvec kernel on the same tier (the AVX2 tier forced on AVX-512 machines); with unit
    /// block scales, small sub-block scales and integer activations (exact sums) also the
    /// scalar reference's bits.
    #[test]
    fn k_quant_tiles_equal_matvec(
        which in 0usize..5,
        nb in 1usize..=5,
        rows in 1usize..=13,
        n in 2usize..=11,
        exact in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let ty = [
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q3_K,
            GgmlType::Q2_K,
        ][which];
        let q6 = ty == GgmlType::Q6_K;
        let cols = 256 * nb;
        let mut rng = SplitMix(seed);
        let mut w: Vec<u8> = (0..rows).flat_map(|_| random_row(ty, cols, &mut rng, exact)).collect();
        if exact {
            // Small sub-block scales (and mins): every partial sum stays below 2^24, so any
            // summation order gives the exact value.
            let (bs, sc) = match ty {
                GgmlType::Q6_K => (210, 192..208),
                GgmlType::Q5_K => (176, 4..16),
                // Q3_K: low nibbles of the 16 biased scales; their high 2 bits are set below.
                GgmlType::Q3_K => (110, 96..104),
                // Q2_K: scale (low nibble) and min (high nibble) of each 16 elements.
                GgmlType::Q2_K => (84, 0..16),
                _ => (144, 4..16),
            };
            for b in w.chunks_exact_mut(bs) {
                if ty == GgmlType::Q2_K {
                    for v in &mut b[sc.clone()] {
                        *v = (rng.int(0, 3) | (rng.int(0, 3) << 4)) as u8;
                    }
                    continue;
                }
                if ty == GgmlType::Q3_K {
                    // High bits 0b10 for every scale: biased 32 + nibble, i.e. 0..=3 after - 32.
                    b[104..108].fill(0xAA);
                    for v in &mut b[sc.clone()] {
                        *v = (rng.int(0, 3) | (rng.int(0, 3) << 4)) as u8;
                    }
                    continue;
                }
                for v in &mut b[sc.clone()] {
                    *v = if q6 { (rng.int(-2, 2) as i8) as u8 } else { rng.int(0, 3) as u8 };
                }
            }
        }
        let mut x: Vec<f32> = (0..n).flat_map(|_| random_x(ty, cols, &mut rng, exact)).collect();
        // Some blocks at full scale: the activations' quants reach +-127.
        if !exact && seed % 3 == 0 {
            for v in x.iter_mut().step_by(7) {
                *v = if seed % 2 == 0 { 1e3 } else { -1e3 };
            }
        }
        let mut reference = vec![0.0f32; n * rows];
        matmul_with(Isa::Scalar, ty, &w, rows, cols, &x, n, &mut reference).unwrap();
        for isa in Isa::available() {
            let mut ym = vec![0.0f32; n * rows];
            matmul_with(isa, ty, &w, rows, cols, &x, n, &mut ym).unwrap();
            for t in 0..n {
                let mut yv = vec![0.0f32; rows];
                matvec_with(isa, ty, &w, rows, cols, &x[t * cols..(t + 1) * cols], &mut yv).unwrap();
                for r in 0..rows {
                    let m = ym[t * rows + r];
                    prop_assert_eq!(m.to_bits(), yv[r].to_bits(), "{:?} {} t={} r={}", isa, ty, t, r);
                    if exact {
                        prop_assert_eq!(m.to_bits(), reference[t * rows + r].to_bits(), "{:?} {} exact t={} r={}", isa, ty, t, r);
                    }
                }
            }
        }
    }
}

/// The formats with two-row single-token kernels, every tier, every row count up to 9
/// (pairs and an odd last row) and 1-4 blocks per row: each row of `matvec` has the bits
/// of the one-row dot (a fixed sweep, so every run covers each kernel, on top of the
/// proptest above).
#[test]
fn two_row_kernels_equal_one_row_dots() {
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
    ] {
        for nb in 1..=4 {
            for rows in 1..=9 {
                let mut rng = SplitMix(1000 * ty.id() as u64 + 10 * nb as u64 + rows as u64);
                let cols = cols_for(ty, nb, 0);
                let w = matrix(ty, rows, cols, &mut rng);
                let x = random_x(ty, cols, &mut rng, false);
                let acts = QuantizedActs::new(ty, &x).unwrap();
                let rb = w.len() / rows;
                for isa in Isa::available() {
                    let mut y = vec![f32::NAN; rows];
                    matvec_with(isa, ty, &w, rows, cols, &x, &mut y).unwrap();
                    for r in 0..rows {
                        let d = vec_dot_with(isa, ty, &w[r * rb..(r + 1) * rb], &acts).unwrap();
                        assert_eq!(
                            y[r].to_bits(),
                            d.to_bits(),
                            "{isa:?} {ty} nb={nb} rows={rows} r={r}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn threads_do_not_change_results() {
    let (p1, p2) = (pool(1), pool(2));
    for ty in TYPES {
        let mut rng = SplitMix(ty.id() as u64 + 7);
        let cols = 512;
        let rows = 700;
        let w = matrix(ty, rows, cols, &mut rng);
        let x = random_x(ty, cols, &mut rng, false);
        let n = 5;
        let xs: Vec<f32> = (0..n)
            .flat_map(|_| random_x(ty, cols, &mut rng, false))
            .collect();
        for isa in Isa::available() {
            let mut y1 = vec![0.0f32; rows];
            let mut y2 = vec![1.0f32; rows];
            p1.install(|| matvec_with(isa, ty, &w, rows, cols, &x, &mut y1))
                .unwrap();
            p2.install(|| matvec_with(isa, ty, &w, rows, cols, &x, &mut y2))
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
fn shape_errors_are_errors() {
    let w = vec![0u8; 144 * 2];
    let x = vec![0.0f32; 256];
    let mut y = vec![0.0f32; 2];
    assert!(matvec_with(Isa::Scalar, GgmlType::Q4_K, &w, 2, 256, &x, &mut y).is_ok());
    assert!(matches!(
        matvec_with(Isa::Scalar, GgmlType::Q4_K, &w, 3, 256, &x, &mut y),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        matvec_with(Isa::Scalar, GgmlType::Q4_K, &w, 2, 255, &x[..255], &mut y),
        Err(KernelError::Shape { .. })
    ));
    assert!(matches!(
        matvec_with(Isa::Scalar, GgmlType::Q8_K, &w, 2, 256, &x, &mut y),
        Err(KernelError::Unsupported { .. })
    ));
    let mut y2 = vec![0.0f32; 4];
    assert!(matmul_with(Isa::Scalar, GgmlType::Q4_K, &w, 2, 256, &x, 2, &mut y2).is_err());
}
