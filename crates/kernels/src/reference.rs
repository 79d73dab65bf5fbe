//! Scalar reference kernels: the readable specification of every op.
//!
//! Owns: dequantization of every weight format and the dot of one weight row with one
//! prepared activation row. Fast paths must match these: integer parts exactly, float
//! results within the bounds documented in `tests/fast_vs_ref.rs`.
//!
//! Dot products are defined block by block: the integer dot of a block's quants with the
//! activation quants is exact (i32), then it is scaled and added to one f32 accumulator in
//! block order. Dense rows accumulate `w[i] * x[i]` in one f32 accumulator in index order.

use crate::formats::*;

mod kquants;
pub use kquants::*;

/// F32 row bytes -> f32.
pub fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

/// F16 row bytes -> f32.
pub fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// BF16 row bytes -> f32.
pub fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

/// Q8_0: `y = d * q`.
pub fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q8_0_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_to_f32(le_u16(b, 0));
        for (i, v) in y.iter_mut().enumerate() {
            *v = d * (b[2 + i] as i8) as f32;
        }
    }
}

/// The 32 signed 5-bit quants (-16..=15) of one Q5_0 block, in element order.
#[inline]
pub fn q5_0_quants(b: &[u8]) -> [i8; QK8_0] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    let mut q = [0i8; QK8_0];
    for j in 0..16 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        q[j] = ((qs[j] & 0x0F) | h0) as i8 - 16;
        q[j + 16] = ((qs[j] >> 4) | h1) as i8 - 16;
    }
    q
}

/// Q5_0: `y = d * (q - 16)`.
pub fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q5_0_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_to_f32(le_u16(b, 0));
        let q = q5_0_quants(b);
        for (v, &qi) in y.iter_mut().zip(&q) {
            *v = d * qi as f32;
        }
    }
}

/// The 256 unsigned 4-bit quants of one Q4_K block in element order.
#[inline]
pub fn q4k_quants(b: &[u8]) -> [u8; QK_K] {
    let qs = &b[16..144];
    let mut q = [0u8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = qs[32 * c + l] & 0x0F;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
    q
}

/// Q4_K: sub-block `j` (32 elements) is `d * sc[j] * q - dmin * m[j]`.
pub fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q4_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(le_u16(b, 0));
        let dmin = f16_to_f32(le_u16(b, 2));
        let q = q4k_quants(b);
        for j in 0..8 {
            let (sc, m) = q4k_scale_min(j, &b[4..16]);
            let d1 = d * sc as f32;
            let m1 = dmin * m as f32;
            for l in 32 * j..32 * j + 32 {
                y[l] = d1 * q[l] as f32 - m1;
            }
        }
    }
}

/// The 256 signed 6-bit quants (-32..=31) of one Q6_K block in element order.
#[inline]
pub fn q6k_quants(b: &[u8]) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..128 + 32 * h + 32];
        let out = &mut q[128 * h..128 * h + 128];
        for l in 0..32 {
            out[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
            out[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            out[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            out[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    q
}

/// Q6_K: element `i` is `(d * scales[i / 16]) * q[i]`.
pub fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q6_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(le_u16(b, 208));
        let q = q6k_quants(b);
        for (i, v) in y.iter_mut().enumerate() {
            let sc = b[192 + i / 16] as i8;
            *v = (d * sc as f32) * q[i] as f32;
        }
    }
}

/// F32 row . x.
pub fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (c, &xv) in row.chunks_exact(4).zip(x) {
        acc += f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * xv;
    }
    acc
}

/// F16 row . x.
pub fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (c, &xv) in row.chunks_exact(2).zip(x) {
        acc += f16_to_f32(u16::from_le_bytes([c[0], c[1]])) * xv;
    }
    acc
}

/// BF16 row . x.
pub fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (c, &xv) in row.chunks_exact(2).zip(x) {
        acc += bf16_to_f32(u16::from_le_bytes([c[0], c[1]])) * xv;
    }
    acc
}

/// Q8_0 row . Q8_0 activations: `sum_b (dx_b * dy_b) * isum_b`.
pub fn dot_q8_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q8_0_BYTES).zip(y) {
        let isum: i32 = (0..QK8_0)
            .map(|i| (b[2 + i] as i8) as i32 * yb.qs[i] as i32)
            .sum();
        acc += (f16_to_f32(le_u16(b, 0)) * f16_to_f32(yb.d)) * isum as f32;
    }
    acc
}

/// Q5_0 row . Q8_0 activations: `sum_b (dx_b * dy_b) * isum_b`.
pub fn dot_q5_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q5_0_BYTES).zip(y) {
        let q = q5_0_quants(b);
        let isum: i32 = (0..QK8_0).map(|i| q[i] as i32 * yb.qs[i] as i32).sum();
        acc += (f16_to_f32(le_u16(b, 0)) * f16_to_f32(yb.d)) * isum as f32;
    }
    acc
}

/// Integer parts of one Q4_K . Q8_K super-block: (`sum_j sc_j * sum q*y`, `sum_j m_j * ysum_j`).
pub fn q4k_block_isums(b: &[u8], yb: &BlockQ8K) -> (i32, i32) {
    let q = q4k_quants(b);
    let mut isum = 0i32;
    let mut msum = 0i32;
    for j in 0..8 {
        let (sc, m) = q4k_scale_min(j, &b[4..16]);
        let s: i32 = (32 * j..32 * j + 32)
            .map(|i| q[i] as i32 * yb.qs[i] as i32)
            .sum();
        isum += sc as i32 * s;
        msum += m as i32 * (yb.bsums[2 * j] as i32 + yb.bsums[2 * j + 1] as i32);
    }
    (isum, msum)
}

/// Q4_K row . Q8_K activations:
/// `sum_b (dy * d) * isum_b - (dy * dmin) * msum_b` (one accumulator, block order).
pub fn dot_q4_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q4_K_BYTES).zip(y) {
        let (isum, msum) = q4k_block_isums(b, yb);
        let d = yb.d * f16_to_f32(le_u16(b, 0));
        let dmin = yb.d * f16_to_f32(le_u16(b, 2));
        acc += d * isum as f32 - dmin * msum as f32;
    }
    acc
}

/// Integer part of one Q6_K . Q8_K super-block: `sum_j sc_j * sum_{16} q*y`.
pub fn q6k_block_isum(b: &[u8], yb: &BlockQ8K) -> i32 {
    let q = q6k_quants(b);
    (0..16)
        .map(|j| {
            let s: i32 = (16 * j..16 * j + 16)
                .map(|i| q[i] as i32 * yb.qs[i] as i32)
                .sum();
            (b[192 + j] as i8) as i32 * s
        })
        .sum()
}

/// Q6_K row . Q8_K activations: `sum_b (dy * d) * isum_b`.
pub fn dot_q6_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q6_K_BYTES).zip(y) {
        let d = yb.d * f16_to_f32(le_u16(b, 208));
        acc += d * q6k_block_isum(b, yb) as f32;
    }
    acc
}
