//! Dequantizers against the `gguf` Python package (`gguf.quants.dequantize`).
//!
//! Fixture: `tests/fixtures/quant_blocks.bin`, made by `tools/fixtures/gen_quant_blocks.py`
//! (random blocks of every weight format + the first blocks of real Gemma 3 270M tensors +
//! real Gemma values quantized by gguf's own quantizers to the formats it can write).
//! Every value must match bit for bit (both sides do the same f32 operations).

use sluice_kernels::{dequantize_row, GgmlType};

struct Case {
    name: String,
    ty: GgmlType,
    raw: Vec<u8>,
    expected: Vec<f32>,
}

fn u32_at(b: &[u8], pos: &mut usize) -> u32 {
    let v = u32::from_le_bytes(b[*pos..*pos + 4].try_into().unwrap());
    *pos += 4;
    v
}

fn load() -> Vec<Case> {
    let b = include_bytes!("fixtures/quant_blocks.bin");
    assert_eq!(&b[..4], b"SLQB");
    let mut pos = 4;
    let n = u32_at(b, &mut pos);
    let mut cases = Vec::new();
    for _ in 0..n {
        let len = u32_at(b, &mut pos) as usize;
        let name = String::from_utf8(b[pos..pos + len].to_vec()).unwrap();
        pos += len;
        let ty = GgmlType::from_id(u32_at(b, &mut pos)).unwrap();
        let n_el = u32_at(b, &mut pos) as usize;
        let n_bytes = u32_at(b, &mut pos) as usize;
        let raw = b[pos..pos + n_bytes].to_vec();
        pos += n_bytes;
        let expected = b[pos..pos + 4 * n_el]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        pos += 4 * n_el;
        cases.push(Case {
            name,
            ty,
            raw,
            expected,
        });
    }
    assert_eq!(pos, b.len(), "trailing bytes in fixture");
    cases
}

#[test]
fn dequantize_matches_gguf_python() {
    let cases = load();
    let mut seen = std::collections::HashSet::new();
    for c in &cases {
        let mut out = vec![f32::NAN; c.expected.len()];
        dequantize_row(c.ty, &c.raw, &mut out).unwrap_or_else(|e| panic!("{}: {e}", c.name));
        for (i, (&got, &want)) in out.iter().zip(&c.expected).enumerate() {
            assert_eq!(
                got.to_bits(),
                want.to_bits(),
                "{} ({}) element {i}: got {got:e}, gguf says {want:e}",
                c.name,
                c.ty
            );
        }
        seen.insert((c.ty, c.name.starts_with("gemma/")));
    }
    use GgmlType::*;
    for ty in [F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K] {
        assert!(seen.contains(&(ty, false)), "no random case for {ty}");
    }
    // quants-k
    for ty in [
        Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0, TQ2_0,
    ] {
        assert!(seen.contains(&(ty, false)), "no random case for {ty}");
    }
    for ty in [Q4_0, Q4_1, Q5_1, MXFP4, TQ1_0, TQ2_0] {
        let requant = |c: &Case| c.ty == ty && c.name.starts_with("requant/");
        assert!(cases.iter().any(requant), "no gguf-quantized case for {ty}");
    }
    for ty in [F32, Q8_0, Q5_0, Q4_K, Q6_K] {
        assert!(seen.contains(&(ty, true)), "no Gemma case for {ty}");
    }
    // IQ grid formats: random + edge blocks only (no IQ tensors in Gemma).
    for ty in sluice_kernels::iq::IQ_TYPES {
        assert!(seen.contains(&(ty, false)), "no random case for {ty}");
    }
}

#[test]
fn dequantize_rejects_bad_lengths() {
    let mut out = vec![0.0f32; 256];
    assert!(dequantize_row(GgmlType::Q4_K, &[0u8; 143], &mut out).is_err());
    let mut out = vec![0.0f32; 100];
    assert!(dequantize_row(GgmlType::Q8_0, &[0u8; 34 * 3], &mut out).is_err());
    assert!(dequantize_row(GgmlType::Q4_0, &[0u8; 17], &mut out[..32]).is_err());
    assert!(dequantize_row(GgmlType::Q8_1, &[0u8; 36], &mut out[..32]).is_err());
}
