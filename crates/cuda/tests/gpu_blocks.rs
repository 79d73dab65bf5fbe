//! The GPU decoder's blocks against the CPU's, in the spirit of llama.cpp's
//! `test-backend-ops` (needs a CUDA device; ignored otherwise:
//! `cargo test --release -p sluice-cuda --test gpu_blocks -- --ignored --test-threads 1`,
//! once as is (f16 operands on tensor cores) and once with `SLUICE_CUDA_MMA=0` (f32
//! operands)).
//!
//! Each case is the smallest random-weight model that holds a set of block kinds (so every
//! kind of `crates/cuda/src/blocks/` is covered by at least one case), run through the CPU
//! decoder with reference products (every weight row dequantized, f32 activations, sums in
//! f64: the oracle) and through the GPU decoder (`GpuDecoder`, the whole forward pass), 40
//! tokens in chunks of 16 (the last chunk of 8 takes the decode kernels). Per position the
//! deviation is `max |gpu - cpu| / max |cpu|` over the logits. Bounds, set before a run on
//! a device:
//! - f32 operands: median within 1e-6 of the largest logit, worst within 1e-5 (the
//!   whole-forward tests measured 2.9e-7 to 9.1e-7 medians and a worst of 1.3e-6 on the
//!   H200; the worst is looser for the discontinuous choices, router and indexer top-k);
//! - f16 operands: median within 2e-2 (f16 rounding of the weights' products, and near-tied
//!   router / indexer scores on random weights may pick other rows: GLM-DSA's and
//!   GLM-5.3-Flash's whole-forward bound); with int8 products (Q8_0 / Q4_K weights, the
//!   default; `SLUICE_CUDA_INT8=0`: f16), whose activations are quantized per 32 values as
//!   the CPU's quantized products quantize theirs, within the larger of 2e-2 and twice the
//!   CPU's own median (its quantized products against the same oracle; printed).
//!
//! Not an isolated-block harness: a block runs inside its smallest model, so a failure names
//! the case's blocks, not one kernel (the kernels themselves are `gpu_kernels`' tests).

mod common;
use common::{fixtures, RefCompute};

use std::path::{Path, PathBuf};

use sluice_cuda::forward::{ExpertPlacement, GpuDecoder};
use sluice_cuda::Cuda;
use sluice_engine::Model;

const TOKENS: u32 = 40;
const CHUNK: usize = 16;

/// Every position's logits of `toks` on `path`: on the GPU decoder, or on the CPU with
/// reference products.
fn logits(path: &Path, toks: &[u32], gpu: bool) -> (Vec<f32>, usize) {
    logits_on(path, toks, Some(gpu))
}

/// [`logits`], or (`None`) on the CPU with its own quantized products.
fn logits_on(path: &Path, toks: &[u32], gpu: Option<bool>) -> (Vec<f32>, usize) {
    let mut m = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if gpu == Some(true) {
        let c = Cuda::new(m.map.bytes())
            .unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"));
        let plan = m.plan().expect("a plan for this architecture");
        let dec = GpuDecoder::new(&c, plan, m.map.bytes(), ExpertPlacement::Resident)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        m.set_device_forward(Box::new(dec));
    } else if gpu == Some(false) {
        m.set_compute(Box::new(RefCompute));
    }
    let out = common::logits_in_chunks(&mut m, toks, CHUNK);
    (out, m.cfg.n_vocab)
}

/// Per position `max |gpu - cpu| / max |cpu|`, sorted.
fn deviations(gpu: &[f32], cpu: &[f32], n_vocab: usize) -> Vec<f32> {
    assert_eq!(gpu.len(), cpu.len());
    let mut d: Vec<f32> = gpu
        .chunks(n_vocab)
        .zip(cpu.chunks(n_vocab))
        .map(|(g, c)| {
            let diff = g
                .iter()
                .zip(c)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            let top = c.iter().map(|v| v.abs()).fold(0.0, f32::max);
            diff / top
        })
        .collect();
    d.sort_by(f32::total_cmp);
    d
}

/// Case `what` (the block kinds it holds) on the model at `path`: the GPU against the CPU
/// within the module's bounds.
fn check(what: &str, path: &Path) {
    let vocab = Model::load(path).unwrap().cfg.n_vocab as u32;
    let toks: Vec<u32> = (0..TOKENS).map(|i| (i * 37 + 11) % vocab).collect();
    let (gpu, n_vocab) = logits(path, &toks, true);
    let (cpu, _) = logits(path, &toks, false);
    let d = deviations(&gpu, &cpu, n_vocab);
    let (median, worst) = (d[d.len() / 2], d[d.len() - 1]);
    let f32_operands = std::env::var("SLUICE_CUDA_MMA").as_deref() == Ok("0");
    eprintln!(
        "{what} ({} operands, {} positions): max |gpu - cpu| / max |cpu|: median {median:e}, worst {worst:e}",
        if f32_operands { "f32" } else { "f16" },
        d.len()
    );
    assert!(
        gpu.iter().all(|v| v.is_finite()),
        "{what}: non-finite logits"
    );
    if f32_operands {
        assert!(median <= 1e-6, "{what}: median {median:e} > 1e-6");
        assert!(worst <= 1e-5, "{what}: worst {worst:e} > 1e-5");
    } else if std::env::var("SLUICE_CUDA_INT8").as_deref() != Ok("0") {
        let (q, _) = logits_on(path, &toks, None);
        let cm = deviations(&q, &cpu, n_vocab)[d.len() / 2];
        eprintln!("{what}: the CPU's quantized products against the same oracle: median {cm:e}");
        let bound = 2e-2f32.max(2.0 * cm);
        assert!(median <= bound, "{what}: median {median:e} > {bound:e}");
    } else {
        assert!(median <= 2e-2, "{what}: median {median:e} > 2e-2");
    }
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("sluice-gpu-blocks-{name}-{}", std::process::id()))
}

/// GQA attention (q / k norms, NEOX RoPE), the softmax router's MoE (F32 weights).
#[test]
#[ignore = "needs a CUDA device"]
fn gqa_and_moe_match_the_cpu() {
    check(
        "attention (GQA) + moe",
        &fixtures().join("qwen3moe/a-f32.gguf"),
    );
}

/// Absorbed MLA with GLM's DSA indexer (`dsa_indexer`) and a dense FFN (1 layer), then the
/// biased sigmoid router's MoE with its shared expert (2 layers).
#[test]
#[ignore = "needs a CUDA device"]
fn mla_dsa_ffn_and_shared_moe_match_the_cpu() {
    let dir = scratch("mla");
    check(
        "mla + dsa_indexer + ffn",
        &common::glm_dsa_wide_mla(&dir, 1, 16),
    );
    check(
        "mla + dsa_indexer + ffn + moe (shared)",
        &common::glm_dsa_wide_mla(&dir, 2, 16),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// DeepSeek V4 attention (window, compressor, lightning indexer, sinks, grouped output),
/// hyper-connections with the learned head mix, the hashed and biased routers.
#[test]
#[ignore = "needs a CUDA device"]
fn dsv4_attention_and_hyper_match_the_cpu() {
    let dir = scratch("dsv4");
    check(
        "dsv4_attention + hyper + moe (hash)",
        &common::deepseek4_wide(&dir, 8),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Gated DeltaNet, QSA, the low-rank hyper-connection mixers, the hashed n-gram PLE layer
/// and the gated shared expert.
#[test]
#[ignore = "needs a CUDA device"]
fn deltanet_qsa_lowrank_and_ple_match_the_cpu() {
    let dir = scratch("q4");
    check(
        "deltanet + qsa + hyper_lowrank + ple + moe (gated shared)",
        &common::qwen4exp_wide(&dir, 4),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Kimi delta attention, pooled latent attention with the k-pool indexer, the streams'
/// mean before the head.
#[test]
#[ignore = "needs a CUDA device"]
fn kda_and_pooled_mla_match_the_cpu() {
    let dir = scratch("g5");
    check(
        "kda + mla_pooled + hyper (mean head)",
        &common::glm5next_wide(&dir),
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
