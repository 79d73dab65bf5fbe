//! Scalar reference for Q4_0, IQ4_NL, MXFP4 (with Q8_0 activations), Q4_1, Q5_1 (with Q8_1
//! activations) and Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0, TQ2_0 (with Q8_K activations).
//!
//! Dequantizers do the f32 operations of `gguf.quants.dequantize` in the same order
//! (so they match it bit for bit). Dots follow the crate convention: the integer parts of
//! a block are exact i32, then one f32 expression per block is added to a single
//! accumulator in block order. Formats with a per-block minimum (Q4_1, Q5_1) take the min
//! term from the Q8_1 block's stored `s = f16(d * sum q)` (d not yet rounded), exactly the
//! value ggml's `vec_dot_q4_1_q8_1` reads.

#![allow(clippy::needless_range_loop)] // index loops read like the layouts

use crate::formats::*;

/// The 32 nibbles of 16 packed bytes in element order: low nibbles, then high nibbles.
#[inline]
fn nibbles(qs: &[u8]) -> [u8; QK8_0] {
    let mut q = [0u8; QK8_0];
    for j in 0..16 {
        q[j] = qs[j] & 0x0F;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

/// The 32 signed quants (-8..=7) of a Q4_0 block.
#[inline]
pub fn q4_0_quants(b: &[u8]) -> [i8; QK8_0] {
    nibbles(&b[2..18]).map(|v| v as i8 - 8)
}

/// The 32 unsigned quants (0..=15) of a Q4_1 block.
#[inline]
pub fn q4_1_quants(b: &[u8]) -> [u8; QK8_0] {
    nibbles(&b[4..20])
}

/// The 32 unsigned quants (0..=31) of a Q5_1 block.
#[inline]
pub fn q5_1_quants(b: &[u8]) -> [u8; QK8_0] {
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let mut q = nibbles(&b[8..24]);
    for (i, v) in q.iter_mut().enumerate() {
        *v |= (((qh >> i) & 1) as u8) << 4;
    }
    q
}

/// The 32 values (in `KVALUES_IQ4NL`) of an IQ4_NL block.
#[inline]
pub fn iq4_nl_quants(b: &[u8]) -> [i8; QK8_0] {
    nibbles(&b[2..18]).map(|v| KVALUES_IQ4NL[v as usize])
}

/// The 32 doubled e2m1 values (in `KVALUES_MXFP4`) of an MXFP4 block.
#[inline]
pub fn mxfp4_quants(b: &[u8]) -> [i8; QK8_0] {
    nibbles(&b[1..17]).map(|v| KVALUES_MXFP4[v as usize])
}

/// Q4_0: `y = d * (q - 8)`.
pub fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q4_0_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_to_f32(le_u16(b, 0));
        for (v, &q) in y.iter_mut().zip(&q4_0_quants(b)) {
            *v = d * q as f32;
        }
    }
}

/// Q4_1: `y = d * q + m`.
pub fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q4_1_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_to_f32(le_u16(b, 0));
        let m = f16_to_f32(le_u16(b, 2));
        for (v, &q) in y.iter_mut().zip(&q4_1_quants(b)) {
            *v = d * q as f32 + m;
        }
    }
}

/// Q5_1: `y = d * q + m`.
pub fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(Q5_1_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_to_f32(le_u16(b, 0));
        let m = f16_to_f32(le_u16(b, 2));
        for (v, &q) in y.iter_mut().zip(&q5_1_quants(b)) {
            *v = d * q as f32 + m;
        }
    }
}

/// IQ4_NL: `y = d * kvalue`.
pub fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ4_NL_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = f16_to_f32(le_u16(b, 0));
        for (v, &q) in y.iter_mut().zip(&iq4_nl_quants(b)) {
            *v = d * q as f32;
        }
    }
}

/// MXFP4: `y = e8m0_half(e) * kvalue`.
pub fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(MXFP4_BYTES)
        .zip(dst.chunks_exact_mut(QK8_0))
    {
        let d = e8m0_to_f32_half(b[0]);
        for (v, &q) in y.iter_mut().zip(&mxfp4_quants(b)) {
            *v = d * q as f32;
        }
    }
}

/// Exact `sum_i qx[i] * qy[i]` over a 32-element block.
#[inline]
fn isum32<T: Copy + Into<i32>>(qx: &[T; QK8_0], qy: &[i8; QK8_0]) -> i32 {
    qx.iter().zip(qy).map(|(&a, &b)| a.into() * b as i32).sum()
}

/// Q4_0 row . Q8_0 activations: `sum_b (dx_b * dy_b) * isum_b`.
pub fn dot_q4_0(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q4_0_BYTES).zip(y) {
        let isum = isum32(&q4_0_quants(b), &yb.qs);
        acc += (f16_to_f32(le_u16(b, 0)) * f16_to_f32(yb.d)) * isum as f32;
    }
    acc
}

/// Q4_1 / Q5_1 block: `(dx * dy) * isum + m * s`, `s` the Q8_1 block's stored
/// `f16(d * sum q)` (as ggml's `vec_dot_q4_1_q8_1`).
#[inline]
fn min_block(b: &[u8], yb: &BlockQ8_1, q: &[u8; QK8_0]) -> f32 {
    let dy = f16_to_f32(yb.d);
    let isum = isum32(q, &yb.qs);
    (f16_to_f32(le_u16(b, 0)) * dy) * isum as f32 + f16_to_f32(le_u16(b, 2)) * f16_to_f32(yb.s)
}

/// Q4_1 row . Q8_1 activations: `sum_b (dx dy) isum_b + m_b s_b`.
pub fn dot_q4_1(row: &[u8], y: &[BlockQ8_1]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q4_1_BYTES).zip(y) {
        acc += min_block(b, yb, &q4_1_quants(b));
    }
    acc
}

/// Q5_1 row . Q8_1 activations: `sum_b (dx dy) isum_b + m_b s_b`.
pub fn dot_q5_1(row: &[u8], y: &[BlockQ8_1]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q5_1_BYTES).zip(y) {
        acc += min_block(b, yb, &q5_1_quants(b));
    }
    acc
}

/// IQ4_NL row . Q8_0 activations: `sum_b (dx_b * dy_b) * isum_b`.
pub fn dot_iq4_nl(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(IQ4_NL_BYTES).zip(y) {
        let isum = isum32(&iq4_nl_quants(b), &yb.qs);
        acc += (f16_to_f32(le_u16(b, 0)) * f16_to_f32(yb.d)) * isum as f32;
    }
    acc
}

/// MXFP4 row . Q8_0 activations: `sum_b (e8m0_half(e_b) * dy_b) * isum_b`.
pub fn dot_mxfp4(row: &[u8], y: &[BlockQ8_0]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(MXFP4_BYTES).zip(y) {
        let isum = isum32(&mxfp4_quants(b), &yb.qs);
        acc += (e8m0_to_f32_half(b[0]) * f16_to_f32(yb.d)) * isum as f32;
    }
    acc
}

// ---- 256-element super-blocks (Q8_K activations) ----

/// The 2-bit fields of a 64-byte array in element order (Q2_K, Q3_K low bits, TQ2_0):
/// element `128 h + 32 s + l` is `(qs[32 h + l] >> 2 s) & 3`.
#[inline]
fn crumbs(qs: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                q[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
            }
        }
    }
    q
}

/// The 256 unsigned quants (0..=3) of a Q2_K block.
#[inline]
pub fn q2k_quants(b: &[u8]) -> [u8; QK_K] {
    crumbs(&b[16..80])
}

/// The 256 signed quants (-4..=3) of a Q3_K block.
#[inline]
pub fn q3k_quants(b: &[u8]) -> [i8; QK_K] {
    let lo = crumbs(&b[32..96]);
    let mut q = [0i8; QK_K];
    for (e, v) in q.iter_mut().enumerate() {
        let h = (b[e % 32] >> (e / 32)) & 1;
        *v = lo[e] as i8 - if h == 0 { 4 } else { 0 };
    }
    q
}

/// The 256 unsigned quants (0..=31) of a Q5_K block.
#[inline]
pub fn q5k_quants(b: &[u8]) -> [u8; QK_K] {
    let qh = &b[16..48];
    let qs = &b[48..176];
    let mut q = [0u8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = qs[32 * c + l] & 0x0F;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    }
    for (e, v) in q.iter_mut().enumerate() {
        *v |= ((qh[e % 32] >> (e / 32)) & 1) << 4;
    }
    q
}

/// The 256 values (in `KVALUES_IQ4NL`) of an IQ4_XS block.
#[inline]
pub fn iq4xs_quants(b: &[u8]) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for j in 0..8 {
        let n = nibbles(&b[8 + 16 * j..8 + 16 * j + 16]);
        for l in 0..32 {
            q[32 * j + l] = KVALUES_IQ4NL[n[l] as usize];
        }
    }
    q
}

/// The 256 ternary quants (-1..=1) of a TQ1_0 block.
#[inline]
pub fn tq1_quants(b: &[u8]) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for k in 0..5 {
        for l in 0..32 {
            q[32 * k + l] = tq1_trit(b[l], k as u32) as i8 - 1;
        }
        for l in 0..16 {
            q[160 + 16 * k + l] = tq1_trit(b[32 + l], k as u32) as i8 - 1;
        }
    }
    for k in 0..4 {
        for l in 0..4 {
            q[240 + 4 * k + l] = tq1_trit(b[48 + l], k as u32) as i8 - 1;
        }
    }
    q
}

/// The 256 ternary quants (-1..=1) of a TQ2_0 block.
#[inline]
pub fn tq2_quants(b: &[u8]) -> [i8; QK_K] {
    crumbs(&b[0..64]).map(|v| v as i8 - 1)
}

/// Q2_K: `y = (d * sc) * q - (dmin * m)`, one scale/min per 16 elements.
pub fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q2_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(le_u16(b, 80));
        let dmin = f16_to_f32(le_u16(b, 82));
        let q = q2k_quants(b);
        for (i, v) in y.iter_mut().enumerate() {
            let s = b[i / 16];
            let dl = d * (s & 0x0F) as f32;
            let ml = dmin * (s >> 4) as f32;
            *v = dl * q[i] as f32 - ml;
        }
    }
}

/// Q3_K: `y = (d * sc) * q`, one signed scale per 16 elements.
pub fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q3_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(le_u16(b, 108));
        let sc = q3k_scales(&b[96..108]);
        let q = q3k_quants(b);
        for (i, v) in y.iter_mut().enumerate() {
            *v = (d * sc[i / 16] as f32) * q[i] as f32;
        }
    }
}

/// Q5_K: sub-block `j` (32 elements) is `(d * sc[j]) * q - dmin * m[j]`.
pub fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src.chunks_exact(Q5_K_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(le_u16(b, 0));
        let dmin = f16_to_f32(le_u16(b, 2));
        let q = q5k_quants(b);
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

/// IQ4_XS: sub-block `j` (32 elements) is `(d * ls[j]) * kvalue`.
pub fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(IQ4_XS_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_to_f32(le_u16(b, 0));
        let ls = iq4xs_scales(b);
        let q = iq4xs_quants(b);
        for (i, v) in y.iter_mut().enumerate() {
            *v = (d * ls[i / 32] as f32) * q[i] as f32;
        }
    }
}

/// TQ1_0: `y = d * t`, t in -1..=1.
pub fn dequantize_tq1_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(TQ1_0_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_to_f32(le_u16(b, 52));
        for (v, &q) in y.iter_mut().zip(&tq1_quants(b)) {
            *v = d * q as f32;
        }
    }
}

/// TQ2_0: `y = d * t`, t in -1..=1.
pub fn dequantize_tq2_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in src
        .chunks_exact(TQ2_0_BYTES)
        .zip(dst.chunks_exact_mut(QK_K))
    {
        let d = f16_to_f32(le_u16(b, 64));
        for (v, &q) in y.iter_mut().zip(&tq2_quants(b)) {
            *v = d * q as f32;
        }
    }
}

/// Exact `sum q[i] * y[i]` over `range`.
#[inline]
fn isum_range<T: Copy + Into<i32>>(q: &[T], y: &[i8], range: std::ops::Range<usize>) -> i32 {
    range.map(|i| q[i].into() * y[i] as i32).sum()
}

/// Integer parts of one Q2_K . Q8_K super-block:
/// (`sum_j sc_j * sum_{16} q*y`, `sum_j m_j * bsum_j`).
pub fn q2k_block_isums(b: &[u8], yb: &BlockQ8K) -> (i32, i32) {
    let q = q2k_quants(b);
    let mut isum = 0i32;
    let mut msum = 0i32;
    for j in 0..16 {
        let s = b[j];
        isum += (s & 0x0F) as i32 * isum_range(&q, &yb.qs, 16 * j..16 * j + 16);
        msum += (s >> 4) as i32 * yb.bsums[j] as i32;
    }
    (isum, msum)
}

/// Q2_K row . Q8_K activations: `sum_b (dy d) isum_b - (dy dmin) msum_b`.
pub fn dot_q2_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q2_K_BYTES).zip(y) {
        let (isum, msum) = q2k_block_isums(b, yb);
        let d = yb.d * f16_to_f32(le_u16(b, 80));
        let dmin = yb.d * f16_to_f32(le_u16(b, 82));
        acc += d * isum as f32 - dmin * msum as f32;
    }
    acc
}

/// Integer part of one Q3_K . Q8_K super-block: `sum_j sc_j * sum_{16} q*y`.
pub fn q3k_block_isum(b: &[u8], yb: &BlockQ8K) -> i32 {
    let q = q3k_quants(b);
    let sc = q3k_scales(&b[96..108]);
    (0..16)
        .map(|j| sc[j] as i32 * isum_range(&q, &yb.qs, 16 * j..16 * j + 16))
        .sum()
}

/// Q3_K row . Q8_K activations: `sum_b (dy d) isum_b`.
pub fn dot_q3_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q3_K_BYTES).zip(y) {
        let d = yb.d * f16_to_f32(le_u16(b, 108));
        acc += d * q3k_block_isum(b, yb) as f32;
    }
    acc
}

/// Integer parts of one Q5_K . Q8_K super-block:
/// (`sum_j sc_j * sum_{32} q*y`, `sum_j m_j * ysum_j`).
pub fn q5k_block_isums(b: &[u8], yb: &BlockQ8K) -> (i32, i32) {
    let q = q5k_quants(b);
    let mut isum = 0i32;
    let mut msum = 0i32;
    for j in 0..8 {
        let (sc, m) = q4k_scale_min(j, &b[4..16]);
        isum += sc as i32 * isum_range(&q, &yb.qs, 32 * j..32 * j + 32);
        msum += m as i32 * (yb.bsums[2 * j] as i32 + yb.bsums[2 * j + 1] as i32);
    }
    (isum, msum)
}

/// Q5_K row . Q8_K activations: `sum_b (dy d) isum_b - (dy dmin) msum_b`.
pub fn dot_q5_k(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(Q5_K_BYTES).zip(y) {
        let (isum, msum) = q5k_block_isums(b, yb);
        let d = yb.d * f16_to_f32(le_u16(b, 0));
        let dmin = yb.d * f16_to_f32(le_u16(b, 2));
        acc += d * isum as f32 - dmin * msum as f32;
    }
    acc
}

/// Integer part of one IQ4_XS . Q8_K super-block: `sum_j ls_j * sum_{32} kv*y`.
pub fn iq4xs_block_isum(b: &[u8], yb: &BlockQ8K) -> i32 {
    let q = iq4xs_quants(b);
    let ls = iq4xs_scales(b);
    (0..8)
        .map(|j| ls[j] as i32 * isum_range(&q, &yb.qs, 32 * j..32 * j + 32))
        .sum()
}

/// IQ4_XS row . Q8_K activations: `sum_b (dy d) isum_b`.
pub fn dot_iq4_xs(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(IQ4_XS_BYTES).zip(y) {
        let d = yb.d * f16_to_f32(le_u16(b, 0));
        acc += d * iq4xs_block_isum(b, yb) as f32;
    }
    acc
}

/// TQ1_0 row . Q8_K activations: `sum_b (dy d) * sum t*y`.
pub fn dot_tq1_0(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(TQ1_0_BYTES).zip(y) {
        let d = yb.d * f16_to_f32(le_u16(b, 52));
        acc += d * isum_range(&tq1_quants(b), &yb.qs, 0..QK_K) as f32;
    }
    acc
}

/// TQ2_0 row . Q8_K activations: `sum_b (dy d) * sum t*y`.
pub fn dot_tq2_0(row: &[u8], y: &[BlockQ8K]) -> f32 {
    let mut acc = 0.0f32;
    for (b, yb) in row.chunks_exact(TQ2_0_BYTES).zip(y) {
        let d = yb.d * f16_to_f32(le_u16(b, 64));
        acc += d * isum_range(&tq2_quants(b), &yb.qs, 0..QK_K) as f32;
    }
    acc
}
