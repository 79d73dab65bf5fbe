//! Extra checks for the quants-k formats (Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K,
//! Q5_K, IQ4_XS, TQ1_0, TQ2_0) on every ISA tier this CPU has:
//! * integer parts exact: unit block scales and small integer activations (one -127 per
//!   activation block so its Q8 scale is exactly 1) keep every partial sum an integer below
//!   2^24, so every tier must equal the scalar reference bit for bit, whatever the order;
//! * extreme quants: all-max / all-min bytes (saturating maddubs / sign-trick edge cases);
//! * `dequantize_row` vs the reference quant decoders through a one-hot activation.

mod common;

use common::*;
use proptest::prelude::*;
use sluice_kernels::{dequantize_row, vec_dot_with, GgmlType, Isa, QuantizedActs};

const KQ: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_XS,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
];

/// Small integer activations with one -127 per activation block.
fn small_x(ty: GgmlType, cols: usize, rng: &mut SplitMix, amp: i32) -> Vec<f32> {
    let ab = act_block(ty);
    let mut x: Vec<f32> = (0..cols).map(|_| rng.int(-amp, amp) as f32).collect();
    for b in 0..cols / ab {
        x[b * ab + rng.int(0, ab as i32 - 1) as usize] = -127.0;
    }
    x
}

/// Upper bound of the sum of |exact terms| (see fast_vs_ref.rs) for unit activation scales.
fn total(ty: GgmlType, row: &[u8], x: &[f32]) -> f64 {
    let mut w = vec![0.0f32; x.len()];
    dequantize_row(ty, row, &mut w).unwrap();
    let bs = block(ty);
    w.iter()
        .zip(x)
        .enumerate()
        .map(|(i, (a, b))| {
            ((*a as f64).abs() + 2.0 * min_term(ty, row, i / bs)) * (*b as f64).abs()
        })
        .sum()
}

fn check_exact(ty: GgmlType, row: &[u8], x: &[f32]) -> Result<(), TestCaseError> {
    prop_assume!(total(ty, row, x) < (1u64 << 24) as f64);
    let acts = QuantizedActs::new(ty, x).unwrap();
    let r = vec_dot_with(Isa::Scalar, ty, row, &acts).unwrap();
    for isa in Isa::available() {
        let f = vec_dot_with(isa, ty, row, &acts).unwrap();
        prop_assert_eq!(
            f.to_bits(),
            r.to_bits(),
            "{:?} {}: fast {} ref {}",
            isa,
            ty,
            f,
            r
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn integer_parts_exact_on_every_tier(ti in 0..KQ.len(), nb in 1usize..=4, amp in 1i32..=12, seed in any::<u64>()) {
        let ty = KQ[ti];
        let cols = nb * block(ty);
        let mut rng = SplitMix(seed);
        let row = random_row(ty, cols, &mut rng, true);
        let x = small_x(ty, cols, &mut rng, amp);
        check_exact(ty, &row, &x)?;
    }

    #[test]
    fn extreme_bytes_exact_on_every_tier(ti in 0..KQ.len(), fill in prop::sample::select(vec![0x00u8, 0xFF, 0x77, 0x88, 0xAA, 0x55, 0xF0, 0x0F]), seed in any::<u64>()) {
        let ty = KQ[ti];
        let cols = 2 * block(ty);
        let mut rng = SplitMix(seed);
        let mut row = random_row(ty, cols, &mut rng, true);
        // Overwrite every non-scale byte with `fill` (scales: leave the unit f16 / E8M0).
        let bs = ty.type_size() as usize;
        for blk in row.chunks_exact_mut(bs) {
            for (i, v) in blk.iter_mut().enumerate() {
                if !is_scale_byte(ty, i) {
                    *v = fill;
                }
            }
        }
        let x = small_x(ty, cols, &mut rng, 3);
        check_exact(ty, &row, &x)?;
    }
}

/// Whether byte `i` of a block of `ty` belongs to an f16 / E8M0 block scale.
fn is_scale_byte(ty: GgmlType, i: usize) -> bool {
    use GgmlType::*;
    match ty {
        Q4_0 | IQ4_NL | IQ4_XS | Q5_K => i < 2 || (ty == Q5_K && i < 4),
        Q4_1 | Q5_1 => i < 4,
        MXFP4 => i == 0,
        Q2_K => i >= 80,
        Q3_K => i >= 108,
        TQ1_0 => i >= 52,
        TQ2_0 => i >= 64,
        _ => unreachable!(),
    }
}

#[test]
fn one_hot_dot_reads_the_dequantized_value() {
    // x = -127 at position p (its block's Q8 scale is exactly 1), 0 elsewhere: every tier's
    // dot is then 127 * (-w[p]) computed exactly (unit block scales keep w[p] an integer).
    let mut rng = SplitMix(0x5eed);
    for ty in KQ {
        let cols = 2 * block(ty);
        let row = random_row(ty, cols, &mut rng, true);
        let mut w = vec![0.0f32; cols];
        dequantize_row(ty, &row, &mut w).unwrap();
        for p in (0..cols).step_by(7) {
            let mut x = vec![0.0f32; cols];
            x[p] = -127.0;
            let acts = QuantizedActs::new(ty, &x).unwrap();
            for isa in Isa::available() {
                let got = vec_dot_with(isa, ty, &row, &acts).unwrap();
                assert_eq!(got, -127.0 * w[p], "{isa:?} {ty} p={p}");
            }
        }
    }
}
