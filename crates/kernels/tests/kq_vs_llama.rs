//! The quants-k dots (Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0,
//! TQ2_0) against llama.cpp, the peer: `tools/fixtures/kq_dot_llama.c`, compiled here
//! against the libs of `tools/get-llama-cpp.sh --build`, quantizes the same f32 activations
//! with ggml's own `from_float` for the type it pairs (Q8_0, Q8_1 or Q8_K) and runs ggml's
//! CPU `vec_dot`. Source dir from env SLUICE_LLAMA_CPP; skipped when unset (a failure with
//! SLUICE_REQUIRE_MODELS=1) or when that source has no build.
//!
//! Bound: the same exact integers summed in another float order, so
//! |ours - llama| <= (2 * terms + 16) * u * T (T and terms as in `fast_vs_ref.rs`); Q4_1 /
//! Q5_1 pair with Q8_1 in both, so their stored block sums are the same numbers.

mod common;

use common::*;
use sluice_kernels::formats::f16_to_f32;
use sluice_kernels::{dequantize_row, vec_dot_with, GgmlType, Isa, QuantizedActs};
use std::path::PathBuf;
use std::process::Command;

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

/// (llama.cpp source dir, dir of its built ggml libs), or None to skip.
fn llama() -> Option<(PathBuf, PathBuf)> {
    let require = std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1");
    let Some(src) = std::env::var_os("SLUICE_LLAMA_CPP").map(PathBuf::from) else {
        assert!(
            !require,
            "SLUICE_LLAMA_CPP unset with SLUICE_REQUIRE_MODELS=1"
        );
        eprintln!("note: SLUICE_LLAMA_CPP unset: quants-k llama.cpp check skipped");
        return None;
    };
    let libs = src.join("build/bin");
    if !libs.join("libggml-cpu.so").exists() {
        // The build (`tools/get-llama-cpp.sh --build`) is optional.
        eprintln!("note: no llama.cpp build in {libs:?}: quants-k llama.cpp check skipped");
        return None;
    }
    Some((src, libs))
}

/// T: sum of |exact terms| of the block-wise dot (min terms counted twice, as in
/// fast_vs_ref.rs).
fn magnitudes(ty: GgmlType, row: &[u8], x: &[f32]) -> f64 {
    let cols = x.len();
    let mut w = vec![0.0f32; cols];
    dequantize_row(ty, row, &mut w).unwrap();
    let acts = QuantizedActs::new(ty, x).unwrap();
    let mut t = 0.0f64;
    if let Some(ys) = acts.q8_0_blocks() {
        for (b, yb) in ys.iter().enumerate() {
            let dy = f16_to_f32(yb.d) as f64;
            for i in 0..32 {
                t += (w[32 * b + i] as f64 * dy * yb.qs[i] as f64).abs();
            }
        }
    } else if let Some(ys) = acts.q8_1_blocks() {
        // Q4_1 / Q5_1: the same Q8_1 block sums as llama.cpp's, so no extra allowance.
        for (b, yb) in ys.iter().enumerate() {
            let dy = f16_to_f32(yb.d) as f64;
            let m = min_term(ty, row, b);
            for i in 0..32 {
                let qy = yb.qs[i] as f64;
                t += (w[32 * b + i] as f64 * dy * qy).abs() + 2.0 * (m * dy * qy).abs();
            }
            t += (m * f16_to_f32(yb.s) as f64).abs();
        }
    } else {
        let ys = acts.q8_k_blocks().unwrap();
        for (b, yb) in ys.iter().enumerate() {
            let m = min_term(ty, row, b);
            for i in 0..256 {
                let v = yb.d as f64 * yb.qs[i] as f64;
                t += (w[256 * b + i] as f64 * v).abs() + 2.0 * (m * v).abs();
            }
        }
    }
    t
}

#[test]
fn quants_k_dots_agree_with_llama_cpp() {
    let Some((src, libs)) = llama() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("sluice-kq-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("kq_dot_llama");
    let c_src = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tools/fixtures/kq_dot_llama.c"
    );
    let st = Command::new("cc")
        .arg("-O2")
        .arg("-o")
        .arg(&exe)
        .arg(c_src)
        .arg(format!("-I{}", src.join("ggml/include").display()))
        .arg(format!("-L{}", libs.display()))
        .args(["-lggml-cpu", "-lggml-base"])
        .arg(format!("-Wl,-rpath,{}", libs.display()))
        .status()
        .expect("run cc");
    assert!(st.success(), "compiling {c_src} failed");

    let mut rng = SplitMix(0x6b71_6c6c);
    let mut cases = Vec::new();
    for ty in KQ {
        for nb in [1usize, 2, 3, 8] {
            for _ in 0..6 {
                let cols = nb * block(ty);
                let row = random_row(ty, cols, &mut rng, false);
                let x = random_x(ty, cols, &mut rng, false);
                cases.push((ty, row, x));
            }
        }
    }
    let mut input = (cases.len() as u32).to_le_bytes().to_vec();
    for (ty, row, x) in &cases {
        input.extend_from_slice(&ty.id().to_le_bytes());
        input.extend_from_slice(&(x.len() as u32).to_le_bytes());
        input.extend_from_slice(row);
        x.iter()
            .for_each(|v| input.extend_from_slice(&v.to_le_bytes()));
    }
    let (fin, fout) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&fin, &input).unwrap();
    let st = Command::new(&exe).arg(&fin).arg(&fout).status().unwrap();
    assert!(st.success(), "kq_dot_llama failed");
    let out = std::fs::read(&fout).unwrap();
    assert_eq!(out.len(), 4 * cases.len());

    let u = f32::EPSILON as f64;
    let mut worst = std::collections::BTreeMap::new();
    for (k, (ty, row, x)) in cases.iter().enumerate() {
        let peer = f32::from_le_bytes(out[4 * k..4 * k + 4].try_into().unwrap()) as f64;
        let acts = QuantizedActs::new(*ty, x).unwrap();
        let t = magnitudes(*ty, row, x);
        let bs = block(*ty);
        let terms = 2 * x.len() / bs;
        let bound = (2 * terms + 16) as f64 * u * t;
        for isa in [Isa::Scalar, Isa::best()] {
            let ours = vec_dot_with(isa, *ty, row, &acts).unwrap() as f64;
            let err = (ours - peer).abs();
            assert!(
                err <= bound,
                "{ty} {isa:?} cols {}: sluice {ours} llama.cpp {peer} err {err:e} > bound {bound:e}",
                x.len()
            );
            let rel = if bound > 0.0 { err / bound } else { 0.0 };
            let e = worst.entry(ty.to_string()).or_insert(0.0f64);
            *e = e.max(rel);
        }
    }
    eprintln!("worst |sluice - llama.cpp| / bound per type: {worst:?}");
    std::fs::remove_dir_all(&dir).ok();
}
