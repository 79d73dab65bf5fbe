//! Scalar reference for the IQ grid formats: decode to the integer form of the module docs
//! ([`decode`]), dequantize exactly like `gguf.quants.dequantize`, dot with Q8_K.

use super::grids::*;
use super::{dot_mul, iq1m_d_bits, IQ_TYPES};
use crate::formats::{f16_to_f32, le_u16, BlockQ8K, QK_K};
use crate::GgmlType;

/// One IQ block in integer form: element `i` is `d * ls[i / 16] * q[i] * MUL`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decoded {
    /// Block scale, f16 bits.
    pub d: u16,
    /// Signed integer weights (grid value * sign; IQ1: `8 * grid + delta`, delta = +-1).
    pub q: [i8; QK_K],
    /// Odd sub-block multipliers `2 s + 1`, one per 16 elements.
    pub ls: [u8; 16],
}

fn grid8(row: u64) -> [u8; 8] {
    row.to_le_bytes()
}

fn grid4(row: u32) -> [u8; 4] {
    row.to_le_bytes()
}

/// Decode one block of `ty` (one of [`IQ_TYPES`]) to its integer form.
pub fn decode(ty: GgmlType, b: &[u8]) -> Decoded {
    let mut o = Decoded {
        d: 0,
        q: [0; QK_K],
        ls: [0; 16],
    };
    // Write 8 elements at `at`: magnitudes `g`, negative where bit j of `signs` is set.
    let put = |q: &mut [i8; QK_K], at: usize, g: &[u8], signs: u8| {
        for (j, &m) in g.iter().enumerate() {
            let v = m as i8;
            q[at + j] = if (signs >> j) & 1 == 1 { -v } else { v };
        }
    };
    use GgmlType::*;
    match ty {
        IQ2_XXS => {
            o.d = le_u16(b, 0);
            for ib in 0..8 {
                let p = 2 + 8 * ib;
                let aux = u32::from_le_bytes([b[p + 4], b[p + 5], b[p + 6], b[p + 7]]);
                let ls = (2 * (aux >> 28) + 1) as u8;
                o.ls[2 * ib] = ls;
                o.ls[2 * ib + 1] = ls;
                for l in 0..4 {
                    let g = grid8(IQ2XXS_GRID[b[p + l] as usize]);
                    let s = KSIGNS[((aux >> (7 * l)) & 127) as usize];
                    put(&mut o.q, 32 * ib + 8 * l, &g, s);
                }
            }
        }
        IQ2_XS => {
            o.d = le_u16(b, 0);
            for ib in 0..8 {
                let sc = b[66 + ib];
                o.ls[2 * ib] = 2 * (sc & 0x0F) + 1;
                o.ls[2 * ib + 1] = 2 * (sc >> 4) + 1;
                for l in 0..4 {
                    let v = le_u16(b, 2 + 8 * ib + 2 * l);
                    let g = grid8(IQ2XS_GRID[(v & 511) as usize]);
                    put(&mut o.q, 32 * ib + 8 * l, &g, KSIGNS[(v >> 9) as usize]);
                }
            }
        }
        IQ2_S => {
            o.d = le_u16(b, 0);
            for ib in 0..8 {
                let qh = b[66 + ib] as usize;
                let sc = b[74 + ib];
                o.ls[2 * ib] = 2 * (sc & 0x0F) + 1;
                o.ls[2 * ib + 1] = 2 * (sc >> 4) + 1;
                for l in 0..4 {
                    let idx = b[2 + 4 * ib + l] as usize | (((qh >> (2 * l)) & 3) << 8);
                    let g = grid8(IQ2S_GRID[idx]);
                    put(&mut o.q, 32 * ib + 8 * l, &g, b[34 + 4 * ib + l]);
                }
            }
        }
        IQ3_XXS => {
            o.d = le_u16(b, 0);
            for ib in 0..8 {
                let p = 66 + 4 * ib;
                let aux = u32::from_le_bytes([b[p], b[p + 1], b[p + 2], b[p + 3]]);
                let ls = (2 * (aux >> 28) + 1) as u8;
                o.ls[2 * ib] = ls;
                o.ls[2 * ib + 1] = ls;
                for l in 0..4 {
                    let q0 = 2 + 8 * ib + 2 * l;
                    let mut g = [0u8; 8];
                    g[..4].copy_from_slice(&grid4(IQ3XXS_GRID[b[q0] as usize]));
                    g[4..].copy_from_slice(&grid4(IQ3XXS_GRID[b[q0 + 1] as usize]));
                    let s = KSIGNS[((aux >> (7 * l)) & 127) as usize];
                    put(&mut o.q, 32 * ib + 8 * l, &g, s);
                }
            }
        }
        IQ3_S => {
            o.d = le_u16(b, 0);
            for ib in 0..8 {
                let qh = b[66 + ib] as usize;
                let s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
                o.ls[2 * ib] = 2 * s + 1;
                o.ls[2 * ib + 1] = 2 * s + 1;
                for l in 0..4 {
                    let mut g = [0u8; 8];
                    for h in 0..2 {
                        let k = 2 * l + h;
                        let idx = b[2 + 8 * ib + k] as usize | (((qh >> k) & 1) << 8);
                        g[4 * h..4 * h + 4].copy_from_slice(&grid4(IQ3S_GRID[idx]));
                    }
                    put(&mut o.q, 32 * ib + 8 * l, &g, b[74 + 4 * ib + l]);
                }
            }
        }
        IQ1_S => {
            o.d = le_u16(b, 0);
            for ib in 0..8 {
                let qh = le_u16(b, 34 + 2 * ib) as usize;
                let ls = (2 * ((qh >> 12) & 7) + 1) as u8;
                o.ls[2 * ib] = ls;
                o.ls[2 * ib + 1] = ls;
                let delta: i8 = if qh & 0x8000 != 0 { -1 } else { 1 };
                for l in 0..4 {
                    let idx = b[2 + 4 * ib + l] as usize | (((qh >> (3 * l)) & 7) << 8);
                    let g = grid8(IQ1S_GRID[idx]);
                    let at = 32 * ib + 8 * l;
                    for (q, &gj) in o.q[at..at + 8].iter_mut().zip(&g) {
                        *q = 8 * (gj as i8) + delta;
                    }
                }
            }
        }
        IQ1_M => {
            o.d = iq1m_d_bits(&b[48..56]);
            for m in 0..16 {
                let w = le_u16(b, 48 + 2 * (m / 4));
                o.ls[m] = (2 * ((w >> (3 * (m % 4))) & 7) + 1) as u8;
            }
            for k in 0..32 {
                let nib = (b[32 + k / 2] >> (4 * (k % 2))) as usize & 0x0F;
                let idx = b[k] as usize | ((nib & 7) << 8);
                let delta: i8 = if nib & 8 != 0 { -1 } else { 1 };
                let g = grid8(IQ1S_GRID[idx]);
                for (q, &gj) in o.q[8 * k..8 * k + 8].iter_mut().zip(&g) {
                    *q = 8 * (gj as i8) + delta;
                }
            }
        }
        _ => panic!("{ty} is not an IQ grid format (one of {IQ_TYPES:?})"),
    }
    o
}

/// Dequantize a row of `ty` blocks, with the float operations of `gguf.quants.dequantize`:
/// IQ2_*: `(d * (0.5 + s) * 0.25) * g * sign`; IQ3_XXS: `(d * (0.5 + s) * 0.5) * g * sign`;
/// IQ3_S: `(d * (1 + 2 s)) * g * sign`; IQ1_*: `(d * (2 s + 1)) * (g +- 0.125)`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    use GgmlType::*;
    let bytes = super::block_bytes(ty);
    for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(QK_K)) {
        let dec = decode(ty, b);
        let d = f16_to_f32(dec.d);
        for (m, ym) in y.chunks_exact_mut(16).enumerate() {
            let ls = dec.ls[m];
            let s = ((ls - 1) / 2) as f32;
            let q = &dec.q[16 * m..16 * m + 16];
            match ty {
                IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS => {
                    let last = if ty == IQ3_XXS { 0.5 } else { 0.25 };
                    let db = d * (0.5 + s) * last;
                    for (v, &qi) in ym.iter_mut().zip(q) {
                        // (db * |q|) * sign == db * q exactly (rounding is symmetric).
                        *v = db * qi as f32;
                    }
                }
                IQ3_S => {
                    let db = d * ls as f32;
                    for (v, &qi) in ym.iter_mut().zip(q) {
                        *v = db * qi as f32;
                    }
                }
                _ => {
                    // IQ1: q = 8 g + delta, so q * 0.125 == g + delta * 0.125 exactly.
                    let dl = d * ls as f32;
                    for (v, &qi) in ym.iter_mut().zip(q) {
                        *v = dl * (qi as f32 * 0.125);
                    }
                }
            }
        }
    }
}

/// The exact integer part of one IQ block . Q8_K block: `sum_m ls[m] * sum_{16} q * y`.
pub fn block_isum(dec: &Decoded, yb: &BlockQ8K) -> i32 {
    (0..16)
        .map(|m| {
            let s: i32 = (16 * m..16 * m + 16)
                .map(|i| dec.q[i] as i32 * yb.qs[i] as i32)
                .sum();
            dec.ls[m] as i32 * s
        })
        .sum()
}

/// IQ row . Q8_K activations: `sum_b ((d_b * dy_b) * isum_b) * MUL`, one accumulator in
/// block order.
pub fn dot(ty: GgmlType, row: &[u8], y: &[BlockQ8K]) -> f32 {
    let bytes = super::block_bytes(ty);
    let mul = dot_mul(ty);
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(bytes).zip(y) {
        let dec = decode(ty, b);
        let isum = block_isum(&dec, yb);
        acc += (f16_to_f32(dec.d) * yb.d) * isum as f32 * mul;
    }
    acc
}
