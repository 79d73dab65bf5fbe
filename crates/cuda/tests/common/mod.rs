//! Test files shared by the GPU test binaries.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use sluice_synth::glm_dsa::{self as glm, GlmDsaConfig, GlmDsaQuant, GlmDsaShape};
use sluice_synth::{Vocab, WriteOptions};

/// A small random-weight GLM-DSA file (`sluice_synth::glm_dsa`) whose MLA has GLM-5's latent
/// widths (kv_lora 512, rope 64: the attention kernel's widest keys, 576, and values,
/// 512) and whose other sizes the GPU kernels take (every product's columns a multiple
/// of 32): 3 layers (1 dense), hidden 256, 4 heads (nope 64, v 64), 16 IQ2_XXS experts of
/// 256 (top-4, biased sigmoid router, one shared expert), the DSA indexer's top-k 64 (the
/// decoder plan holds for 64 positions). Written under `dir`; its path.
pub fn glm_dsa_wide_mla(dir: &Path) -> PathBuf {
    let shape = GlmDsaShape {
        layers: 3,
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
        index_top_k: 64,
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
    let path = dir.join("glm-dsa-wide-mla.gguf");
    let plan = glm::plan(&cfg, Vocab::builtin()).unwrap();
    let cancel = AtomicBool::new(false);
    sluice_synth::write(
        &plan,
        &path,
        &WriteOptions {
            force: true,
            progress: &|_| {},
            cancel: &cancel,
        },
    )
    .unwrap();
    path
}
