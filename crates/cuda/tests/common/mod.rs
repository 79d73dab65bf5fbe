//! Test files shared by the GPU test binaries.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use sluice_engine::models::compute::Compute;
use sluice_kernels::{dequantize_row, GgmlType, KernelError};

use sluice_synth::glm_dsa::{self as glm, GlmDsaConfig, GlmDsaQuant, GlmDsaShape};
use sluice_synth::Vocab;

/// A small random-weight GLM-DSA file (`sluice_synth::glm_dsa`) whose MLA has GLM-5's latent
/// widths (kv_lora 512, rope 64: the attention kernel's widest keys, 576, and values,
/// 512) and whose other sizes the GPU kernels take (every product's columns a multiple
/// of 32): `layers` layers (1 dense; GLM-5.2's IndexShare pattern: the first three run
/// their DSA indexer, the next three reuse its selection), hidden 256, 4 heads (nope 64,
/// v 64), 16 IQ2_XXS experts of 256 (top-4, biased sigmoid router, one shared expert), the
/// indexer's top-k `index_top_k`. Written under `dir`; its path.
pub fn glm_dsa_wide_mla(dir: &Path, layers: usize, index_top_k: usize) -> PathBuf {
    let shape = GlmDsaShape {
        layers,
        hidden: 256,
        vocab: None,
        heads: 4,
        q_lora: 128,
        kv_lora: 512,
        nope: 64,
        rope: 64,
        v_dim: 64,
        dense_layers: 1,
        dense_ff: 512,
        experts: 16,
        top_k: 4,
        expert_ff: 256,
        index_heads: 4,
        index_head_dim: 64,
        index_top_k,
        context: 4096,
        rope_base: 8e6,
    };
    let cfg = GlmDsaConfig {
        shape,
        quant: GlmDsaQuant::Iq2xxs,
        seed: 11,
        name: "glm-dsa wide MLA test".into(),
    };
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("glm-dsa-wide-mla-{layers}-top{index_top_k}.gguf"));
    let plan = glm::plan(&cfg, Vocab::builtin()).unwrap();
    sluice_synth::write_replacing(&plan, &path).unwrap();
    path
}

/// A small random-weight DeepSeek V4 file (`sluice_synth::deepseek4`) whose sizes the GPU
/// kernels take: 4 layers (sliding window only, sliding only, CSA with the lightning indexer,
/// HCA: the real schedule's first four), hidden 256, 4 heads of 512 (DeepSeek V4 Flash's head
/// size, 64 roped), q-LoRA 256, 2 output groups of rank 256, window 16, 16 experts of 256
/// (top-4; IQ2_XXS gate / up, Q2_K down; layer 0 hash-routed), indexer 4 heads of 64 (F16
/// weights) choosing `index_top_k` compressed rows. Written under `dir`; its path.
pub fn deepseek4_wide(dir: &Path, index_top_k: usize) -> PathBuf {
    use sluice_synth::deepseek4::{self as ds, Dsv4Config, Dsv4Quant, Dsv4Shape};
    let shape = Dsv4Shape {
        layers: 4,
        hidden: 256,
        vocab: None,
        heads: 4,
        head_dim: 512,
        rope_dim: 64,
        q_lora: 256,
        o_groups: 2,
        o_lora: 256,
        window: 16,
        experts: 16,
        top_k: 4,
        expert_ff: 256,
        hash_layers: 1,
        index_heads: 4,
        index_head_dim: 64,
        index_top_k,
        context: 4096,
    };
    let cfg = Dsv4Config {
        shape,
        quant: Dsv4Quant::Q2,
        seed: 5,
        name: "deepseek4 wide test".into(),
    };
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("deepseek4-wide-top{index_top_k}.gguf"));
    let plan = ds::plan(&cfg, Vocab::builtin()).unwrap();
    sluice_synth::write_replacing(&plan, &path).unwrap();
    path
}

/// A small random-weight Qwen3.8-Flash-Next file (`sluice_synth::qwen4exp`) whose sizes the
/// GPU kernels take (every product's columns a multiple of 32): `layers` layers (Gated
/// DeltaNet but on every 4th, QSA there, the PLE layer before layer 1: the real schedule;
/// 4 layers: DeltaNet on 0-2, QSA on 3), hidden 256
/// in 4 low-rank streams (rank 64), DeltaNet 2 key / 4 value heads of 64, QSA 4 heads of 128
/// over 2 KV heads (32 roped) whose indexer (2 heads of 64) keeps 4 blocks of 4 (a budget of
/// 16 positions, so it selects from position 19 on), 16 Q8_0 experts of 128 (top-4) and the
/// gated shared expert, a 2048-token vocabulary, a PLE table of F32 rows (heads of ~1000
/// rows). Written under `dir`; its path.
pub fn qwen4exp_wide(dir: &Path, layers: usize) -> PathBuf {
    use sluice_synth::qwen4exp::{self as q4, Q4Shape, Q4SynthConfig};
    let shape = Q4Shape {
        hidden: 256,
        streams: 4,
        hc_rank: 64,
        vocab: 2048,
        eos: 2047,
        experts: 16,
        top_k: 4,
        expert_ff: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 128,
        gdn_k_heads: 2,
        gdn_v_heads: 4,
        gdn_dim: 64,
        idx_heads: 2,
        idx_dim: 64,
        idx_budget: 16,
        idx_ratio: 4,
        ngram_base: 1000,
    };
    let cfg = Q4SynthConfig {
        shape,
        layers,
        quant: sluice_kernels::GgmlType::Q8_0,
        ple_quant: sluice_kernels::GgmlType::F32,
        seed: 7,
        name: "qwen4exp wide test".into(),
    };
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join(format!("qwen4exp-wide-{layers}.gguf"));
    let plan = q4::plan(&cfg, Vocab::builtin()).unwrap();
    sluice_synth::write_replacing(&plan, &path).unwrap();
    path
}

/// A small random-weight GLM-5.3-Flash file (`sluice_synth::glm5next`) whose sizes the GPU
/// kernels take: 8 layers (Kimi delta attention but on layers 3 and 7, pooled latent
/// attention with the k-pool indexer there; layer 0 dense), 4 hyper-connection streams of
/// 256, 4 heads (KDA heads of 64; latent 256, query / key heads of 64, values of 64), the
/// indexer 4 heads of 64 keeping 4 pools of 4 tokens (so it selects from position 20 on,
/// with the tail), 16 Q8_0 experts of 256 (top-4, biased sigmoid router, the shared
/// expert), a 2048-token vocabulary. Written under `dir`; its path.
pub fn glm5next_wide(dir: &Path) -> PathBuf {
    use sluice_synth::glm5next::{self as g5, G5Shape, G5SynthConfig};
    let shape = G5Shape {
        hidden: 256,
        vocab: 2048,
        dense: 1,
        ff: 512,
        top_k: 4,
        expert_ff: 256,
        heads: 4,
        kda_dim: 64,
        q_lora: 128,
        kv_lora: 256,
        head_k: 64,
        head_v: 64,
        idx_heads: 4,
        idx_dim: 64,
        idx_topk: 16,
        kpool: 4,
        streams: 4,
    };
    let cfg = G5SynthConfig {
        shape,
        layers: 8,
        experts: 16,
        quant: sluice_kernels::GgmlType::Q8_0,
        seed: 9,
        name: "glm5next wide test".into(),
    };
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("glm5next-wide.gguf");
    let plan = g5::plan(&cfg, Vocab::builtin()).unwrap();
    sluice_synth::write_replacing(&plan, &path).unwrap();
    path
}

/// The repository's `tests/fixtures`, or `SLUICE_FIXTURES` (the device carries them there).
#[allow(dead_code)] // not every test binary reads fixtures
pub fn fixtures() -> PathBuf {
    match std::env::var_os("SLUICE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

/// Every position's logits of `toks` through `m`, fed `chunk` tokens per forward pass on a
/// 4-thread pool, into a fresh state with 8 positions to spare.
#[allow(dead_code)] // no_gpu compiles this module without using it
pub fn logits_in_chunks(m: &mut sluice_engine::Model, toks: &[u32], chunk: usize) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let mut kv = m.new_state(toks.len() + 8, true);
    let mut out = Vec::new();
    for c in toks.chunks(chunk) {
        out.extend(
            pool.install(|| m.forward(&mut kv, c, sluice_engine::Logits::All))
                .unwrap(),
        );
    }
    out
}

/// The oracle backend: every weight row dequantized by the reference (`dequantize_row`),
/// f32 activations, products summed in f64. Slow; for small models only.
#[allow(dead_code)] // no_gpu compiles this module without using it
pub struct RefCompute;

impl Compute for RefCompute {
    fn linear(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let rb = w.len() / rows;
        let per_row: Vec<Vec<f32>> = (0..rows)
            .into_par_iter()
            .map(|r| {
                let mut d = vec![0.0f32; cols];
                dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut d)?;
                Ok((0..n)
                    .map(|t| {
                        d.iter()
                            .zip(&x[t * cols..(t + 1) * cols])
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>() as f32
                    })
                    .collect())
            })
            .collect::<Result<_, KernelError>>()?;
        for (r, c) in per_row.iter().enumerate() {
            for (t, v) in c.iter().enumerate() {
                y[t * rows + r] = *v;
            }
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "reference"
    }
}
