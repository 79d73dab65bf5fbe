//! Block layouts of the K-quant family additions and the other "simple" formats:
//! Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4 (32-element blocks, paired with Q8_0 activations) and
//! Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0, TQ2_0 (256-element super-blocks, paired with Q8_K).
//!
//! Owns: their byte sizes (ggml's structs, byte for byte, all little endian), the
//! non-linear value tables (IQ4_NL / IQ4_XS, MXFP4's doubled e2m1 values), the E8M0 scale
//! conversion, and the unpacking of packed sub-block scales.

/// Q4_0: `{ f16 d; u8 qs[16] }`; element `j` is `qs[j] & 15`, element `j + 16` is
/// `qs[j] >> 4`, value `d * (q - 8)`.
pub const Q4_0_BYTES: usize = 18;
/// Q4_1: `{ f16 d; f16 m; u8 qs[16] }` (nibbles as Q4_0), value `d * q + m`.
pub const Q4_1_BYTES: usize = 20;
/// Q5_1: `{ f16 d; f16 m; u8 qh[4]; u8 qs[16] }` (nibbles as Q4_0, bit `i` of the
/// little-endian u32 `qh` is bit 4 of element `i`), value `d * q + m`.
pub const Q5_1_BYTES: usize = 24;
/// IQ4_NL: `{ f16 d; u8 qs[16] }` (nibbles as Q4_0), value `d * KVALUES_IQ4NL[q]`.
pub const IQ4_NL_BYTES: usize = 18;
/// MXFP4: `{ u8 e; u8 qs[16] }` (nibbles as Q4_0), value
/// `e8m0_to_f32_half(e) * KVALUES_MXFP4[q]`.
pub const MXFP4_BYTES: usize = 17;
/// Q2_K: `{ u8 scales[16]; u8 qs[64]; f16 d; f16 dmin }`. Element `128 h + 32 s + l` is
/// `(qs[32 h + l] >> 2 s) & 3`; sub-block `j = e / 16` has scale `scales[j] & 15` and min
/// `scales[j] >> 4`; value `(d * sc) * q - (dmin * m)`.
pub const Q2_K_BYTES: usize = 84;
/// Q3_K: `{ u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d }`. Low bits as Q2_K; element
/// `32 k + l` subtracts 4 when bit `k` of `hmask[l]` is clear; 16 signed 6-bit scales
/// (see [`q3k_scales`]); value `(d * sc) * q`.
pub const Q3_K_BYTES: usize = 110;
/// Q5_K: `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`. Nibbles and scales as
/// Q4_K; bit `k` of `qh[l]` is bit 4 of element `32 k + l`; value `(d * sc) * q - dmin * m`.
pub const Q5_K_BYTES: usize = 176;
/// IQ4_XS: `{ f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128] }`. Sub-block `j` (32
/// elements): nibbles of `qs[16 j..16 j + 16]`, low nibbles first; scale see
/// [`iq4xs_scales`]; value `(d * ls) * KVALUES_IQ4NL[q]`.
pub const IQ4_XS_BYTES: usize = 136;
/// TQ1_0: `{ u8 qs[48]; u8 qh[4]; f16 d }`: 5 (qs) or 4 (qh) base-3 digits per byte, read
/// out as `((u8)(byte * 3^k) * 3) >> 8` (see [`tq1_trit`]); value `d * (t - 1)`.
pub const TQ1_0_BYTES: usize = 54;
/// TQ2_0: `{ u8 qs[64]; f16 d }`: element `128 h + 32 s + l` is
/// `(qs[32 h + l] >> 2 s) & 3`, value `d * (q - 1)`.
pub const TQ2_0_BYTES: usize = 66;

/// IQ4_NL / IQ4_XS non-linear 4-bit values (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// MXFP4 e2m1 values, doubled (ggml's `kvalues_mxfp4`); the halving is in the scale.
pub const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of the E8M0 scale `2^(e - 127)`, as f32 bits exactly like ggml's
/// `GGML_E8M0_TO_FP32_HALF` (subnormal for `e < 2`).
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// The 16 signed 6-bit scales (-32..=31) of a Q3_K block's 12 scale bytes: low 4 bits of
/// scale `j` are nibble `j / 8` of byte `j % 8`, high 2 bits are bits `2 (j / 4)` of byte
/// `8 + j % 4`.
#[inline]
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let lo = (s[j % 8] >> (4 * (j / 8))) & 0x0F;
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 0x03;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// [`e8m0_to_f32_half`] of every byte, for table lookups in the kernels.
pub static E8M0_HALF: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut e = 0;
    while e < 256 {
        let bits = if e < 2 {
            0x0020_0000u32 << e
        } else {
            ((e as u32) - 1) << 23
        };
        t[e] = f32::from_bits(bits);
        e += 1;
    }
    t
};

/// The 16 Q3_K scales biased by +32 (0..=63), four per little-endian u32 in scale order:
/// the same values as [`q3k_scales`] plus 32, with whole-word masks and shifts.
#[inline]
pub fn q3k_scales_biased(s: &[u8; 12]) -> [u32; 4] {
    const LO4: u32 = 0x0f0f_0f0f;
    const LO2: u32 = 0x0303_0303;
    let a0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let a1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let a2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    [
        (a0 & LO4) | ((a2 & LO2) << 4),
        (a1 & LO4) | (((a2 >> 2) & LO2) << 4),
        ((a0 >> 4) & LO4) | (((a2 >> 4) & LO2) << 4),
        ((a1 >> 4) & LO4) | (((a2 >> 6) & LO2) << 4),
    ]
}

/// The 8 signed 6-bit scales (-32..=31) of an IQ4_XS block (bytes 2..8): low 4 bits of
/// scale `j` are nibble `j % 2` of `scales_l[j / 2]`, high 2 bits are bits `2 j` of the
/// little-endian u16 `scales_h`.
#[inline]
pub fn iq4xs_scales(b: &[u8]) -> [i8; 8] {
    let sh = u16::from_le_bytes([b[2], b[3]]);
    let mut out = [0i8; 8];
    for (j, o) in out.iter_mut().enumerate() {
        let lo = (b[4 + j / 2] >> (4 * (j % 2))) & 0x0F;
        let hi = ((sh >> (2 * j)) & 0x03) as u8;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// The 8 IQ4_XS scales biased by +32 (0..=63) as two little-endian u32: bytes of the first
/// are scales 0, 2, 4, 6, of the second scales 1, 3, 5, 7 (interleave them to get 0..8).
#[inline]
pub fn iq4xs_scales_biased(b: &[u8]) -> (u32, u32) {
    const LO4: u32 = 0x0f0f_0f0f;
    const LO2: u32 = 0x0303_0303;
    let l = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let h = u16::from_le_bytes([b[2], b[3]]) as u32;
    // Nibble i of scales_h to byte i.
    let t = (h | (h << 8)) & 0x00ff_00ff;
    let t = (t | (t << 4)) & LO4;
    (
        (l & LO4) | ((t & LO2) << 4),
        ((l >> 4) & LO4) | (((t >> 2) & LO2) << 4),
    )
}

/// Base-3 digit `k` (0..5) of a TQ1_0 byte, 0..=2, the way ggml reads it.
#[inline]
pub fn tq1_trit(byte: u8, k: u32) -> u8 {
    let p = byte.wrapping_mul(3u8.pow(k));
    ((p as u16 * 3) >> 8) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_table_equals_the_function() {
        for e in 0..=255u8 {
            assert_eq!(
                E8M0_HALF[e as usize].to_bits(),
                e8m0_to_f32_half(e).to_bits()
            );
        }
    }

    #[test]
    fn iq4xs_biased_scales_equal_the_plain_unpacking() {
        let mut b = [0u8; 8];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            for v in b.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *v = x as u8;
            }
            let (even, odd) = iq4xs_scales_biased(&b);
            let plain = iq4xs_scales(&b);
            for (j, &p) in plain.iter().enumerate() {
                let w = if j % 2 == 0 { even } else { odd };
                let v = (w >> (8 * (j / 2))) as u8;
                assert_eq!(v as i32 - 32, p as i32, "{b:?} scale {j}");
            }
        }
    }

    #[test]
    fn q3k_biased_scales_equal_the_plain_unpacking() {
        let mut s = [0u8; 12];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            for v in s.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *v = x as u8;
            }
            let words = q3k_scales_biased(&s);
            let plain = q3k_scales(&s);
            for (j, &p) in plain.iter().enumerate() {
                let b = (words[j / 4] >> (8 * (j % 4))) as u8;
                assert_eq!(b as i32 - 32, p as i32, "{s:?} scale {j}");
            }
        }
    }
}
