//! The IQ grid format dots against llama.cpp (the peer): `tools/fixtures/iq_dot_llama.c`,
//! built here against the libs of `tools/get-llama-cpp.sh --build`, dots random IQ rows with
//! the Q8_K quantization of random activations through `ggml_get_type_traits_cpu`.
//! The source dir comes from env SLUICE_LLAMA_CPP (skipped when unset, unless
//! SLUICE_REQUIRE_MODELS=1; skipped when the source has no build). llama.cpp sums the same exact integers in another float order,
//! so results must agree within the two-orders bound of `fast_vs_ref.rs`:
//! |ours - llama| <= (2 * blocks + 16) * u * T, T = sum_i |w_i * dy * qy_i|.

mod common;
mod iq_common;

use common::{random_x, SplitMix};
use iq_common::iq_row;
use sluice_kernels::iq::IQ_TYPES;
use sluice_kernels::{dequantize_row, vec_dot_with, Isa, QuantizedActs};
use std::path::PathBuf;
use std::process::Command;

fn llama_libs() -> Option<(PathBuf, PathBuf)> {
    let require = std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1");
    let Some(src) = std::env::var_os("SLUICE_LLAMA_CPP").map(PathBuf::from) else {
        assert!(
            !require,
            "SLUICE_LLAMA_CPP is not set (and SLUICE_REQUIRE_MODELS=1)"
        );
        eprintln!("note: SLUICE_LLAMA_CPP not set; skipping the llama.cpp IQ dot check");
        return None;
    };
    let libs = src.join("build/bin");
    if !libs.join("libggml-cpu.so").exists() {
        // tools/test.sh fetches the source only; the build (tools/get-llama-cpp.sh --build)
        // is optional, even with SLUICE_REQUIRE_MODELS=1.
        eprintln!("note: no llama.cpp build in {libs:?}; skipping the llama.cpp IQ dot check");
        return None;
    }
    Some((src, libs))
}

#[test]
fn iq_dots_agree_with_llama_cpp() {
    let Some((src, libs)) = llama_libs() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("sluice-iq-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("iq_dot_llama");
    let c = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tools/fixtures/iq_dot_llama.c"
    );
    let st = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&exe)
        .arg(c)
        .arg(format!("-I{}", src.join("ggml/include").display()))
        .arg(format!("-L{}", libs.display()))
        .args(["-lggml-cpu", "-lggml-base"])
        .arg(format!("-Wl,-rpath,{}", libs.display()))
        .status()
        .expect("run cc");
    assert!(st.success(), "building iq_dot_llama failed");

    // Cases: every IQ type, 1..=8 blocks, random rows and activations.
    let mut rng = SplitMix(0x1a_d07);
    let mut cases = Vec::new();
    for ty in IQ_TYPES {
        for k in 0..16 {
            let nb = 1 + k % 8;
            let cols = 256 * nb;
            let row = iq_row(ty, cols, &mut rng, false);
            let x = random_x(ty, cols, &mut rng, false);
            cases.push((ty, nb, row, x));
        }
    }
    let mut input = (cases.len() as u32).to_le_bytes().to_vec();
    for (ty, nb, row, x) in &cases {
        input.extend_from_slice(&ty.id().to_le_bytes());
        input.extend_from_slice(&(*nb as u32).to_le_bytes());
        input.extend_from_slice(row);
        x.iter()
            .for_each(|v| input.extend_from_slice(&v.to_le_bytes()));
    }
    let (inp, outp) = (dir.join("in.bin"), dir.join("out.bin"));
    std::fs::write(&inp, &input).unwrap();
    let st = Command::new(&exe).arg(&inp).arg(&outp).status().unwrap();
    assert!(st.success(), "iq_dot_llama failed");
    let out = std::fs::read(&outp).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(out.len(), 4 * cases.len());

    let u = f32::EPSILON as f64;
    let mut worst = 0.0f64;
    for (c, (ty, nb, row, x)) in cases.iter().enumerate() {
        let theirs = f32::from_le_bytes(out[4 * c..4 * c + 4].try_into().unwrap()) as f64;
        let acts = QuantizedActs::new(*ty, x).unwrap();
        let mut w = vec![0.0f32; x.len()];
        dequantize_row(*ty, row, &mut w).unwrap();
        let ys = acts.q8_k_blocks().unwrap();
        let t: f64 = (0..x.len())
            .map(|i| (w[i] as f64 * ys[i / 256].d as f64 * ys[i / 256].qs[i % 256] as f64).abs())
            .sum();
        let bound = (2 * nb + 16) as f64 * u * t;
        for isa in Isa::available() {
            let ours = vec_dot_with(isa, *ty, row, &acts).unwrap() as f64;
            let err = (ours - theirs).abs();
            assert!(
                err <= bound,
                "{ty} {isa:?} case {c}: ours {ours} llama.cpp {theirs} err {err} > bound {bound}"
            );
            if t > 0.0 {
                worst = worst.max(err / (u * t));
            }
        }
    }
    eprintln!(
        "{} cases agree with llama.cpp; worst |ours - llama| = {worst:.2} u * T",
        cases.len()
    );
}
