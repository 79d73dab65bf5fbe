//! The IQ "grid" formats: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M.
//!
//! Owns: their block layouts (ggml's, byte for byte), the grid / sign tables ([`grids`],
//! generated from the `gguf` Python package), the scalar reference
//! ([`reference`](mod@reference): dequantize bit-equal to `gguf.quants.dequantize`, dot
//! with Q8_K activations) and the AVX2 kernels (`avx2.rs`).
//!
//! Every IQ block is 256 elements and decodes to the same integer form: a block scale `d`
//! (f32), 256 signed integer weights `q` (grid value times sign, or for IQ1 `8 * g + delta`)
//! and 16 odd sub-block multipliers `ls = 2 s + 1`, one per 16 elements, so that element
//! `i` is `d * ls[i / 16] * q[i] * MUL` with a per-format power of two `MUL`
//! ([`dot_mul`]). The dot with a Q8_K block is the exact integer
//! `isum = sum_m ls[m] * sum_{16} q * y`, scaled once: `acc += (d * dy) * isum * MUL`, one
//! f32 accumulator in block order (the fast paths compute the same `isum` and apply the
//! same float operations, so they equal the reference bit for bit).
//!
//! Layouts (all little endian, `f16 d` first except IQ1_M):
//! * IQ2_XXS (66 B): `d; u16 qs[32]`: per 32 elements 8 bytes: 4 grid indices (u8, 256-row
//!   `iq2xxs_grid`), then a u32 of 4 x 7-bit `ksigns` indices and a 4-bit scale (bits 28..32).
//! * IQ2_XS (74 B): `d; u16 qs[32]; u8 scales[8]`: each u16 = 9-bit grid index (512-row
//!   `iq2xs_grid`) | 7-bit ksigns index << 9; two 4-bit scales per 32 elements.
//! * IQ2_S (82 B): `d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]`: 10-bit grid index
//!   (1024-row `iq2s_grid`) = qs | 2 bits of qh; explicit sign bytes; 4-bit scales per 16.
//! * IQ3_XXS (98 B): `d; u8 qs[64]; u32 scales_signs[8]`: one byte per 4 elements
//!   (256-row `iq3xxs_grid`); per 32 elements a u32 of 4 ksigns indices + a 4-bit scale.
//! * IQ3_S (110 B): `d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]`: 9-bit index
//!   (512-row `iq3s_grid`) = qs | 1 bit of qh; explicit signs; 4-bit scale per 32.
//! * IQ1_S (50 B): `d; u8 qs[32]; u16 qh[8]`: 11-bit index (2048-row `iq1s_grid`, values
//!   -1/0/1) = qs | 3 bits of qh; per 32: 3-bit scale (bits 12..15), delta sign (bit 15).
//! * IQ1_M (56 B): `u8 qs[32]; u8 qh[16]; u16 scales[4]`: 11-bit index = qs | 3 bits of a qh
//!   nibble, whose 4th bit is the delta sign (per 8 elements); 3-bit scales per 16; the f16
//!   block scale is the top nibbles of the four scale words.

pub mod grids;
pub mod reference;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;

use crate::GgmlType;

/// The IQ grid formats implemented here.
pub const IQ_TYPES: [GgmlType; 7] = [
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
];

/// Whether `ty` is one of [`IQ_TYPES`].
#[inline]
pub fn is_iq(ty: GgmlType) -> bool {
    IQ_TYPES.contains(&ty)
}

/// IQ2_XXS block bytes.
pub const IQ2_XXS_BYTES: usize = 66;
/// IQ2_XS block bytes.
pub const IQ2_XS_BYTES: usize = 74;
/// IQ2_S block bytes.
pub const IQ2_S_BYTES: usize = 82;
/// IQ3_XXS block bytes.
pub const IQ3_XXS_BYTES: usize = 98;
/// IQ3_S block bytes.
pub const IQ3_S_BYTES: usize = 110;
/// IQ1_S block bytes.
pub const IQ1_S_BYTES: usize = 50;
/// IQ1_M block bytes.
pub const IQ1_M_BYTES: usize = 56;

/// Block bytes of an IQ format.
pub fn block_bytes(ty: GgmlType) -> usize {
    use GgmlType::*;
    match ty {
        IQ2_XXS => IQ2_XXS_BYTES,
        IQ2_XS => IQ2_XS_BYTES,
        IQ2_S => IQ2_S_BYTES,
        IQ3_XXS => IQ3_XXS_BYTES,
        IQ3_S => IQ3_S_BYTES,
        IQ1_S => IQ1_S_BYTES,
        IQ1_M => IQ1_M_BYTES,
        _ => panic!("{ty} is not an IQ grid format"),
    }
}

/// The power of two `MUL` of the module docs: element = `d * ls * q * MUL`.
pub fn dot_mul(ty: GgmlType) -> f32 {
    use GgmlType::*;
    match ty {
        IQ2_XXS | IQ2_XS | IQ2_S | IQ1_S | IQ1_M => 0.125,
        IQ3_XXS => 0.25,
        IQ3_S => 1.0,
        _ => panic!("{ty} is not an IQ grid format"),
    }
}

/// The IQ1_M block scale: f16 bits assembled from the top nibbles of the 4 scale words.
#[inline]
pub fn iq1m_d_bits(sc: &[u8]) -> u16 {
    let w = |k: usize| u16::from_le_bytes([sc[2 * k], sc[2 * k + 1]]);
    (w(0) >> 12) | ((w(1) >> 8) & 0x00F0) | ((w(2) >> 4) & 0x0F00) | (w(3) & 0xF000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksigns_are_7_bits_plus_even_parity() {
        // The AVX2 kernels rebuild bit 7 from the low 7 bits; this is the rule they use.
        for (i, &k) in grids::KSIGNS.iter().enumerate() {
            assert_eq!(k & 0x7F, i as u8);
            assert_eq!(k.count_ones() % 2, 0, "ksigns[{i}]");
        }
    }

    #[test]
    fn grid_values_are_in_range() {
        let bytes = |v: u64| v.to_le_bytes();
        for g in [
            &grids::IQ2XXS_GRID[..],
            &grids::IQ2XS_GRID[..],
            &grids::IQ2S_GRID[..],
        ] {
            assert!(g
                .iter()
                .all(|&r| bytes(r).iter().all(|b| [8, 25, 43].contains(b))));
        }
        assert!(grids::IQ3XXS_GRID
            .iter()
            .all(|r| r.to_le_bytes().iter().all(|&b| (4..=62).contains(&b))));
        assert!(grids::IQ3S_GRID
            .iter()
            .all(|r| r.to_le_bytes().iter().all(|&b| b % 2 == 1 && b <= 15)));
        assert!(grids::IQ1S_GRID
            .iter()
            .all(|&r| bytes(r).iter().all(|&b| [0xFF, 0, 1].contains(&b))));
    }
}
