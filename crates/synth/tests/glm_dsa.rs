//! `sluice_synth::glm_dsa`: synthetic GLM-5.x files (iq2xxs and q2 layouts) on the shrunk
//! preset load in sluice with the release types and the IndexShare layout (no indexer
//! tensors on shared layers), give finite, varied logits, and the real preset plans the
//! release sizes (routed experts 174.0 GiB IQ2_XXS, 221.5 GiB Q2_K: ../shared/models/glm5.md
//! 5.1).
//!
//! (llama.cpp loading these files is checked by hand: the synth note in README.md. The
//! weights are random by design: no oracle for the numbers.)

use sluice_gguf::{GgmlType, GgufFile};
use sluice_models::{Logits, Model};
use sluice_synth as synth;
use sluice_synth::glm_dsa::{self as glm, GlmDsaConfig, GlmDsaPreset, GlmDsaQuant};
use sluice_synth::Vocab;

fn cfg(quant: GlmDsaQuant, preset: GlmDsaPreset) -> GlmDsaConfig {
    GlmDsaConfig {
        shape: preset.shape(),
        quant,
        seed: 3,
        name: "test".into(),
    }
}

#[test]
fn tiny_files_load_and_give_finite_varied_logits() {
    let dir = std::env::temp_dir().join(format!("sluice-synth-glm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (quant, ex) in [
        (GlmDsaQuant::Iq2xxs, GgmlType::IQ2_XXS),
        (GlmDsaQuant::Q2, GgmlType::Q2_K),
    ] {
        let path = dir.join(format!("{}.gguf", quant.name()));
        let plan = glm::plan(&cfg(quant, GlmDsaPreset::Tiny), Vocab::builtin()).unwrap();
        synth::write_replacing(&plan, &path).unwrap();
        let g = GgufFile::open(&path).unwrap();
        let ty = |n: &str| g.tensor(n).unwrap_or_else(|| panic!("{n}")).ty;
        assert_eq!(ty("blk.1.ffn_gate_exps.weight"), ex);
        assert_eq!(ty("blk.1.ffn_down_exps.weight"), ex);
        assert_eq!(ty("blk.0.attn_k_b.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.1.ffn_gate_inp.weight"), GgmlType::F32);
        assert!(g.tensor("blk.0.ffn_gate_exps.weight").is_none()); // dense layer 0
        assert!(g.tensor("blk.2.indexer.attn_k.weight").is_some()); // full
        assert!(g.tensor("blk.3.indexer.attn_k.weight").is_none()); // shared
        let m = Model::load(&path).unwrap();
        assert_eq!(m.cfg.arch, "glm-dsa");
        // 40 tokens > the preset's top-k 8: the sparse selection runs.
        let toks: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 250).collect();
        let mut st = m.new_state(256, false);
        let logits = m.forward(&mut st, &toks, Logits::All).unwrap();
        let n_vocab = m.cfg.n_vocab;
        assert!(logits.iter().all(|v| v.is_finite()), "{path:?}");
        let last = &logits[(toks.len() - 1) * n_vocab..];
        let (lo, hi) = last
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        assert!(hi - lo > 1e-3, "{path:?}: flat logits {lo}..{hi}");
        let l = m.forward(&mut st, &[7], Logits::Last).unwrap();
        assert!(l.iter().all(|v| v.is_finite()));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_real_preset_plans_the_release_sizes() {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    for (quant, want) in [(GlmDsaQuant::Iq2xxs, 174.0), (GlmDsaQuant::Q2, 221.5)] {
        let plan = glm::plan(&cfg(quant, GlmDsaPreset::Glm52), Vocab::builtin()).unwrap();
        let routed = gib(plan.role_bytes().routed_experts);
        assert!((routed - want).abs() < 0.1, "{quant:?}: {routed:.2} GiB");
        assert!(plan.fallbacks.is_empty(), "{:?}", plan.fallbacks);
        assert_eq!(
            plan.one_expert_bytes(),
            3 * 6144 * 2048 / 256 * {
                if quant == GlmDsaQuant::Iq2xxs {
                    66
                } else {
                    84
                }
            }
        );
    }
}
