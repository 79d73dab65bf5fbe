//! Shared test helpers: random weight rows with sane scales, random activations.
#![allow(dead_code)]

use half::f16;
use proptest::prelude::*;
use sluice_kernels::GgmlType;

/// The weight formats with kernels.
pub const TYPES: [GgmlType; 18] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    // quants-k
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

/// Elements per activation block: 256 (Q8_K) for the 256-element weight formats, 32
/// (Q8_0) for the other quantized ones, 1 for the dense ones.
pub fn act_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
        _ => ty.block_size() as usize,
    }
}

/// Largest magnitude of the per-element offset subtracted through the activation sums
/// (`dmin * m`, Q4_1/Q5_1 `m`) of block `b` of `row`, 0 for formats without one.
pub fn min_term(ty: GgmlType, row: &[u8], b: usize) -> f64 {
    let bs = ty.type_size() as usize;
    let blk = &row[bs * b..bs * b + bs];
    let h = |i: usize| {
        half::f16::from_bits(u16::from_le_bytes([blk[i], blk[i + 1]]))
            .to_f64()
            .abs()
    };
    match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => h(2) * 63.0,
        GgmlType::Q2_K => h(82) * 15.0,
        GgmlType::Q4_1 | GgmlType::Q5_1 => h(2),
        _ => 0.0,
    }
}

/// Tiny deterministic generator (SplitMix64) so row contents follow from one proptest seed.
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Log-uniform magnitude in [lo, hi) with random sign.
    pub fn scale(&mut self, lo: f32, hi: f32) -> f32 {
        let t = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        let m = (lo.ln() + t * (hi.ln() - lo.ln())).exp();
        if self.next_u64() & 1 == 0 {
            m
        } else {
            -m
        }
    }
    pub fn int(&mut self, lo: i32, hi: i32) -> i32 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i32
    }
}

/// Elements per block.
pub fn block(ty: GgmlType) -> usize {
    ty.block_size() as usize
}

/// A random row of `cols` elements. `unit_scales`: every block scale is 1.0 (and dense
/// values small integers), so dot products are exact in f32 when magnitudes stay small.
pub fn random_row(ty: GgmlType, cols: usize, rng: &mut SplitMix, unit_scales: bool) -> Vec<u8> {
    let one = f16::from_f32(1.0).to_bits().to_le_bytes();
    let mut out = Vec::new();
    let f16s = |rng: &mut SplitMix, lo: f32, hi: f32| {
        if unit_scales {
            one
        } else {
            f16::from_f32(rng.scale(lo, hi)).to_bits().to_le_bytes()
        }
    };
    match ty {
        GgmlType::F32 => {
            for _ in 0..cols {
                let v = if unit_scales {
                    rng.int(-8, 8) as f32
                } else {
                    rng.unit() * rng.scale(1e-3, 1e3).abs()
                };
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for _ in 0..cols {
                let v = if unit_scales {
                    rng.int(-8, 8) as f32
                } else {
                    rng.unit() * rng.scale(1e-2, 1e2).abs()
                };
                out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for _ in 0..cols {
                let v = if unit_scales {
                    rng.int(-8, 8) as f32
                } else {
                    rng.unit() * rng.scale(1e-3, 1e3).abs()
                };
                out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
            }
        }
        GgmlType::Q8_0 | GgmlType::Q5_0 => {
            let rest = if ty == GgmlType::Q8_0 { 32 } else { 20 };
            for _ in 0..cols / 32 {
                out.extend_from_slice(&f16s(rng, 1e-3, 1.0));
                out.extend((0..rest).map(|_| rng.byte()));
            }
        }
        GgmlType::Q4_K => {
            for _ in 0..cols / 256 {
                out.extend_from_slice(&f16s(rng, 1e-4, 0.1));
                let dmin = f16s(rng, 1e-4, 0.1);
                // dmin is non-negative in real files; keep the sign random anyway for coverage
                out.extend_from_slice(&dmin);
                out.extend((0..140).map(|_| rng.byte()));
            }
        }
        GgmlType::Q6_K => {
            for _ in 0..cols / 256 {
                out.extend((0..208).map(|_| rng.byte()));
                out.extend_from_slice(&f16s(rng, 1e-4, 0.1));
            }
        }
        _ => random_row_kq(ty, cols, rng, unit_scales, &mut out),
    }
    assert_eq!(out.len() as u64, ty.row_bytes(cols as u64).unwrap());
    out
}

/// Random activations. `exact`: integers in -127..=127 whose quantization is lossless
/// (each activation block has an element equal to -127, so its scale is exactly 1).
pub fn random_x(ty: GgmlType, cols: usize, rng: &mut SplitMix, exact: bool) -> Vec<f32> {
    let ablock = act_block(ty).max(32);
    if exact {
        let mut x: Vec<f32> = (0..cols).map(|_| rng.int(-127, 127) as f32).collect();
        if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            for b in 0..cols / ablock {
                let i = b * ablock + rng.int(0, ablock as i32 - 1) as usize;
                x[i] = -127.0;
            }
        } else {
            for v in &mut x {
                *v = (*v / 16.0).round();
            }
        }
        return x;
    }
    let mut x = Vec::with_capacity(cols);
    for _ in 0..cols / ablock.min(cols.max(1)) {
        let s = rng.scale(1e-2, 1e2).abs();
        let zero_block = rng.int(0, 15) == 0;
        for _ in 0..ablock {
            x.push(if zero_block { 0.0 } else { rng.unit() * s });
        }
    }
    x.resize(cols, 0.5);
    x
}

/// Strategy: (type index, number of blocks, seed).
pub fn case() -> impl Strategy<Value = (usize, usize, u64)> {
    (0..TYPES.len(), 1usize..=12, any::<u64>())
}

/// Columns for `n_blocks` blocks of `ty` (dense types use 8-element "blocks" to vary tails).
pub fn cols_for(ty: GgmlType, n_blocks: usize, seed: u64) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => n_blocks * 37 + (seed % 29) as usize,
        _ => n_blocks * block(ty),
    }
}

/// [`random_row`] for the quants-k formats: random bytes, sane f16 (MXFP4: E8M0) scales.
fn random_row_kq(ty: GgmlType, cols: usize, rng: &mut SplitMix, unit: bool, out: &mut Vec<u8>) {
    let f16s = |rng: &mut SplitMix, out: &mut Vec<u8>, lo: f32, hi: f32| {
        let v = if unit { 1.0 } else { rng.scale(lo, hi) };
        out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
    };
    let bytes =
        |rng: &mut SplitMix, out: &mut Vec<u8>, n: usize| out.extend((0..n).map(|_| rng.byte()));
    for _ in 0..cols / block(ty) {
        match ty {
            GgmlType::Q4_0 | GgmlType::IQ4_NL => {
                f16s(rng, out, 1e-3, 1.0);
                bytes(rng, out, 16);
            }
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                f16s(rng, out, 1e-3, 1.0);
                f16s(rng, out, 1e-3, 1.0);
                bytes(rng, out, if ty == GgmlType::Q4_1 { 16 } else { 20 });
            }
            GgmlType::MXFP4 => {
                // E8M0 128 is 2^1, halved: 1.0.
                out.push(if unit { 128 } else { rng.int(110, 135) as u8 });
                bytes(rng, out, 16);
            }
            GgmlType::Q2_K => {
                bytes(rng, out, 80);
                f16s(rng, out, 1e-4, 0.1);
                f16s(rng, out, 1e-4, 0.1);
            }
            GgmlType::Q3_K => {
                bytes(rng, out, 108);
                f16s(rng, out, 1e-4, 0.1);
            }
            GgmlType::Q5_K => {
                f16s(rng, out, 1e-4, 0.1);
                f16s(rng, out, 1e-4, 0.1);
                bytes(rng, out, 172);
            }
            GgmlType::IQ4_XS => {
                f16s(rng, out, 1e-4, 0.1);
                bytes(rng, out, 134);
            }
            GgmlType::TQ1_0 | GgmlType::TQ2_0 => {
                bytes(rng, out, if ty == GgmlType::TQ1_0 { 52 } else { 64 });
                f16s(rng, out, 1e-3, 1.0);
            }
            _ => unreachable!("{ty}"),
        }
    }
}
