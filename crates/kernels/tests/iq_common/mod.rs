//! Helpers of the IQ grid format tests (kept apart from `common` so that file stays as is).
#![allow(dead_code)]

use super::common::SplitMix;
use half::f16;
use sluice_kernels::GgmlType;

/// A random row of IQ blocks: random bytes (every pattern is valid), block scale log-uniform
/// in [1e-4, 0.1) with random sign, or exactly 1.0 with `unit_scales`.
pub fn iq_row(ty: GgmlType, cols: usize, rng: &mut SplitMix, unit_scales: bool) -> Vec<u8> {
    let bs = ty.type_size() as usize;
    let mut out = Vec::with_capacity(cols / 256 * bs);
    for _ in 0..cols / 256 {
        let mut b: Vec<u8> = (0..bs).map(|_| rng.byte()).collect();
        let d = if unit_scales {
            f16::from_f32(1.0)
        } else {
            f16::from_f32(rng.scale(1e-4, 0.1))
        }
        .to_bits();
        if ty == GgmlType::IQ1_M {
            for k in 0..4 {
                let p = 48 + 2 * k;
                let w = u16::from_le_bytes([b[p], b[p + 1]]);
                let w = (w & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12);
                b[p..p + 2].copy_from_slice(&w.to_le_bytes());
            }
        } else {
            b[..2].copy_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&b);
    }
    assert_eq!(out.len() as u64, ty.row_bytes(cols as u64).unwrap());
    out
}
