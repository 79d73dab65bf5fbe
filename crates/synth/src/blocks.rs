//! Random tensor data for `sluice synth`: a small deterministic RNG and fillers that write
//! valid ggml blocks directly (random quants, sane f16 scales), never quantizing floats.
//!
//! Owns: how a chunk of one tensor's bytes is produced from (seed, tensor, chunk), and the
//! scale choices that give each block format a target standard deviation, so a model of
//! random weights keeps its activations bounded and its logits finite.

use sluice_gguf::GgmlType;
/// Bytes of one Q4_0 block (f16 scale + 32 nibbles).
pub const Q4_0_BYTES: usize = 18;

use sluice_kernels::formats::{f32_to_f16, Q4_K_BYTES, Q6_K_BYTES, Q8_0_BYTES, QK8_0, QK_K};

/// SplitMix64: seeds the per-chunk generator (and mixes the seed words).
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xoshiro256++: the bulk generator, one per chunk.
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator determined by `words` only (e.g. seed, tensor index, chunk index).
    pub fn new(words: &[u64]) -> Rng {
        let mut st = 0x5EED_5EED_0000_0001u64;
        for &w in words {
            st ^= w;
            splitmix64(&mut st);
        }
        let mut s = [0u64; 4];
        for v in &mut s {
            *v = splitmix64(&mut st);
        }
        Rng { s }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    #[inline]
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [lo, hi] (inclusive), for small ranges.
    #[inline]
    pub fn range_u8(&mut self, lo: u8, hi: u8) -> u8 {
        let span = u64::from(hi - lo) + 1;
        lo + (((self.next_u64() >> 32) * span) >> 32) as u8
    }

    /// Fill `buf` with random bytes.
    pub fn fill_bytes(&mut self, buf: &mut [u8]) {
        let mut chunks = buf.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// `w` with every byte 0x80 (-128) turned into 0x81 (-127), without branches.
#[inline]
pub fn no_minus_128(w: u64) -> u64 {
    const LOW7: u64 = 0x7F7F_7F7F_7F7F_7F7F;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let x = w ^ HIGH; // bytes that were 0x80 are now 0
    let nonzero = ((x & LOW7) + LOW7) | x; // high bit set in every nonzero byte
    w | ((!nonzero & HIGH) >> 7)
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fill {
    /// Every element 1.0 (norm weights). F32 only.
    Ones,
    /// Every element this value. F32 only.
    Const(f32),
    /// Zero-mean values of standard deviation `sigma` (block scales jittered by +-25 %).
    Random { sigma: f32 },
    /// A deepseek4 token-id -> experts table (I32 `[k, n_vocab]`): `k` distinct experts per
    /// token ([`hash_expert`]).
    HashTable { n_expert: u32, k: u32, salt: u64 },
}

/// Bytes of one block of `ty` and the elements it holds.
pub fn block_geometry(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q8_0 => (Q8_0_BYTES, QK8_0),
        GgmlType::Q4_0 => (Q4_0_BYTES, QK8_0),
        GgmlType::Q4_K => (Q4_K_BYTES, QK_K),
        GgmlType::Q6_K => (Q6_K_BYTES, QK_K),
        ty => ds4_geometry(ty).unwrap_or((4, 1)),
    }
}

/// Rows of `ty` hold a whole number of blocks.
pub fn fits(ty: GgmlType, row_len: usize) -> bool {
    row_len.is_multiple_of(block_geometry(ty).1)
}

/// A scale jitter in [0.75, 1.25): block scales of a real model vary.
#[inline]
fn jitter(rng: &mut Rng) -> f32 {
    0.75 + 0.5 * rng.unit()
}

/// Standard deviation of a uniform integer on [lo, hi].
fn uniform_std(lo: f32, hi: f32) -> f32 {
    let n = hi - lo + 1.0;
    ((n * n - 1.0) / 12.0).sqrt()
}

/// Fill `out` (a whole number of blocks of `ty`) with random data. `row_scale`, when given,
/// multiplies element `i` (counted from `first_elem`) by `row_scale[(i / row_len)]`; it is
/// only supported for F32 (the router).
pub fn fill_chunk(
    ty: GgmlType,
    fill: Fill,
    rng: &mut Rng,
    out: &mut [u8],
    row_scale: Option<(&[f32], usize, u64)>,
) {
    match (ty, fill) {
        (_, Fill::Ones) => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&1.0f32.to_le_bytes());
            }
        }
        (_, Fill::Const(v)) => {
            for c in out.chunks_exact_mut(4) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        (GgmlType::Q8_0, Fill::Random { sigma }) => {
            // q uniform on [-127, 127] (ggml never writes -128), value = d * q.
            let base = sigma / uniform_std(-127.0, 127.0);
            for b in out.chunks_exact_mut(Q8_0_BYTES) {
                let d = f32_to_f16(base * jitter(rng));
                b[..2].copy_from_slice(&d.to_le_bytes());
                for c in b[2..].chunks_exact_mut(8) {
                    c.copy_from_slice(&no_minus_128(rng.next_u64()).to_le_bytes());
                }
            }
        }
        (GgmlType::Q4_0, Fill::Random { sigma }) => {
            // value = d * (q - 8) with q in 0..=15 (random nibbles).
            let base = sigma / uniform_std(0.0, 15.0);
            for b in out.chunks_exact_mut(Q4_0_BYTES) {
                let d = f32_to_f16(base * jitter(rng));
                b[..2].copy_from_slice(&d.to_le_bytes());
                rng.fill_bytes(&mut b[2..]);
            }
        }
        (GgmlType::Q4_K, Fill::Random { sigma }) => {
            // value = d * sc * q - dmin * m with q in 0..=15; sc in 32..=63, m = sc and
            // dmin = 7.5 d centre it: value ~= d * sc * (q - 7.5).
            let base = sigma / (47.5 * uniform_std(0.0, 15.0));
            for b in out.chunks_exact_mut(Q4_K_BYTES) {
                let d = base * jitter(rng);
                b[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
                b[2..4].copy_from_slice(&f32_to_f16(7.5 * d).to_le_bytes());
                let mut sc = [0u8; 8];
                for s in &mut sc {
                    *s = rng.range_u8(32, 63);
                }
                b[4..16].copy_from_slice(&pack_q4k_scales(&sc, &sc));
                rng.fill_bytes(&mut b[16..]);
            }
        }
        (GgmlType::Q6_K, Fill::Random { sigma }) => {
            // value = d * scale * (q - 32) with q in 0..=63 (random ql/qh bits), scale 32..=127.
            let base = sigma / (79.5 * uniform_std(0.0, 63.0));
            for b in out.chunks_exact_mut(Q6_K_BYTES) {
                rng.fill_bytes(&mut b[..192]);
                for s in &mut b[192..208] {
                    *s = rng.range_u8(32, 127);
                }
                let d = f32_to_f16(base * jitter(rng));
                b[208..].copy_from_slice(&d.to_le_bytes());
            }
        }
        // The deepseek4 layout's types (generated by `fill_ds4`).
        (_, Fill::HashTable { .. }) => fill_ds4(ty, fill, rng, out, 0),
        (GgmlType::F16 | GgmlType::IQ2_XXS | GgmlType::Q2_K | GgmlType::MXFP4, _) => {
            fill_ds4(ty, fill, rng, out, 0)
        }
        (_, Fill::Random { sigma }) => {
            // F32: uniform on [-a, a], a = sigma * sqrt(3).
            let a = sigma * 3f32.sqrt();
            for (i, c) in out.chunks_exact_mut(4).enumerate() {
                let mut v = a * (2.0 * rng.unit() - 1.0);
                if let Some((scales, row_len, first)) = row_scale {
                    let row = ((first + i as u64) / row_len as u64) as usize;
                    v *= scales.get(row).copied().unwrap_or(1.0);
                }
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// The 12 packed bytes of a Q4_K block's 6-bit scales and mins (inverse of ggml's
/// `get_scale_min_k4`).
pub fn pack_q4k_scales(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    q
}

/// Bytes per block and values per block of the deepseek4 layout's own types.
fn ds4_geometry(ty: GgmlType) -> Option<(usize, usize)> {
    match ty {
        GgmlType::IQ2_XXS => Some((66, 256)),
        GgmlType::Q2_K => Some((84, 256)),
        GgmlType::MXFP4 => Some((17, 32)),
        GgmlType::F16 => Some((2, 1)),
        GgmlType::I32 => Some((4, 1)),
        _ => None,
    }
}

/// Expert `slot` of token `token` in a hash table: `k` distinct experts per token, spread
/// `n / k` apart from a per-token random start.
pub fn hash_expert(salt: u64, n_expert: u32, k: u32, token: u64, slot: u32) -> u32 {
    let mut st = salt ^ token.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    let base = (splitmix64(&mut st) % u64::from(n_expert)) as u32;
    let step = (n_expert / k.max(1)).max(1);
    (base + slot * step) % n_expert
}

/// Fill a chunk of one of the deepseek4 layout's own types (IQ2_XXS, Q2_K, MXFP4, F16, the
/// I32 hash table; `first_elem`: index of its first value).
pub(crate) fn fill_ds4(ty: GgmlType, fill: Fill, rng: &mut Rng, out: &mut [u8], first_elem: u64) {
    match (ty, fill) {
        (GgmlType::I32, Fill::HashTable { n_expert, k, salt }) => {
            for (i, c) in out.chunks_exact_mut(4).enumerate() {
                let at = first_elem + i as u64;
                let e = hash_expert(
                    salt,
                    n_expert,
                    k,
                    at / u64::from(k),
                    (at % u64::from(k)) as u32,
                );
                c.copy_from_slice(&(e as i32).to_le_bytes());
            }
        }
        (GgmlType::F16, Fill::Random { sigma }) => {
            let a = sigma * 3f32.sqrt();
            for c in out.chunks_exact_mut(2) {
                let v = a * (2.0 * rng.unit() - 1.0);
                c.copy_from_slice(&f32_to_f16(v).to_le_bytes());
            }
        }
        (GgmlType::IQ2_XXS, Fill::Random { sigma }) => {
            // Any bytes are a valid block: 8 groups of (4 grid indices, 4 x 7 sign bits + a
            // 4-bit scale). value = d * (0.5 + s) / 4 * grid (8, 25 or 43) * sign: RMS ~67 d.
            for b in out.chunks_exact_mut(66) {
                let d = sigma / 67.0 * (0.75 + 0.5 * rng.unit());
                b[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
                rng.fill_bytes(&mut b[2..]);
            }
        }
        (GgmlType::Q2_K, Fill::Random { sigma }) => {
            // value = d * sc * q - dmin * m, q in 0..=3; m = sc and dmin = 1.5 d centre it:
            // d * sc * (q - 1.5), sc in 1..=15: RMS ~10.2 d.
            for b in out.chunks_exact_mut(84) {
                for s in &mut b[..16] {
                    let sc = rng.range_u8(1, 15);
                    *s = sc | (sc << 4);
                }
                rng.fill_bytes(&mut b[16..80]);
                let d = sigma / 10.2 * (0.75 + 0.5 * rng.unit());
                b[80..82].copy_from_slice(&f32_to_f16(d).to_le_bytes());
                b[82..84].copy_from_slice(&f32_to_f16(1.5 * d).to_le_bytes());
            }
        }
        (GgmlType::MXFP4, Fill::Random { sigma }) => {
            // value = kvalues[q] (RMS 5.85 over random nibbles) * 2^(e - 128).
            let e0 = 128.0 + (sigma / 5.85).log2().round();
            for b in out.chunks_exact_mut(17) {
                b[0] = (e0 + f32::from(rng.range_u8(0, 1)) - 0.5)
                    .round()
                    .clamp(1.0, 254.0) as u8;
                rng.fill_bytes(&mut b[1..]);
            }
        }
        _ => out.fill(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_kernels::formats::q4k_scale_min;

    #[test]
    fn q4k_scales_round_trip() {
        let mut rng = Rng::new(&[7]);
        for _ in 0..1000 {
            let mut sc = [0u8; 8];
            let mut m = [0u8; 8];
            for j in 0..8 {
                sc[j] = rng.range_u8(0, 63);
                m[j] = rng.range_u8(0, 63);
            }
            let q = pack_q4k_scales(&sc, &m);
            for j in 0..8 {
                assert_eq!(q4k_scale_min(j, &q), (sc[j], m[j]), "j={j}");
            }
        }
    }

    #[test]
    fn no_minus_128_changes_only_0x80() {
        let mut rng = Rng::new(&[3]);
        for i in 0..100_000u64 {
            let mut w = rng.next_u64();
            if i % 3 == 0 {
                w = (w & !0xFF00_00FF_0000) | 0x8000_0080_0000; // force some 0x80 bytes
            }
            let want: Vec<u8> = w
                .to_le_bytes()
                .iter()
                .map(|&b| if b == 0x80 { 0x81 } else { b })
                .collect();
            assert_eq!(no_minus_128(w).to_le_bytes().to_vec(), want, "{w:#x}");
        }
        assert_eq!(no_minus_128(0x8080_8080_8080_8080), 0x8181_8181_8181_8181);
        assert_eq!(no_minus_128(0), 0);
    }

    #[test]
    fn range_u8_covers_its_bounds() {
        let mut rng = Rng::new(&[1, 2]);
        let v: Vec<u8> = (0..10_000).map(|_| rng.range_u8(32, 63)).collect();
        assert_eq!(v.iter().min(), Some(&32));
        assert_eq!(v.iter().max(), Some(&63));
    }
}
