//! `sluice_synth::deepseek4`: synthetic DeepSeek V4 files (q2 and MXFP4 layouts) on the
//! shrunk preset load in sluice with every tensor the arch needs, in the release types,
//! a valid hash table, and give finite, varied logits; the same seed gives the same bytes.
//!
//! (llama.cpp loading these files is checked by hand: the synth note in README.md. The
//! weights are random by design: no oracle for the numbers.)

use std::path::{Path, PathBuf};

use sluice_gguf::{GgmlType, GgufFile};
use sluice_models::{Logits, Model};
use sluice_synth as synth;
use sluice_synth::deepseek4::{self as ds4, Dsv4Config, Dsv4Preset, Dsv4Quant};
use sluice_synth::Vocab;

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-synth-ds4-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cfg(quant: Dsv4Quant, layers: usize) -> Dsv4Config {
    let mut shape = Dsv4Preset::Tiny.shape();
    shape.layers = layers;
    Dsv4Config {
        shape,
        quant,
        seed: 7,
        name: "test".into(),
    }
}

fn write(cfg: &Dsv4Config, path: &Path) {
    let plan = ds4::plan(cfg, Vocab::builtin()).unwrap();
    synth::write_replacing(&plan, path).unwrap();
    assert_eq!(std::fs::metadata(path).unwrap().len(), plan.file_size());
}

#[test]
fn q2_and_mxfp4_files_load_and_give_finite_varied_logits() {
    let dir = tmp_dir("load");
    for (quant, gu, down) in [
        (Dsv4Quant::Q2, GgmlType::IQ2_XXS, GgmlType::Q2_K),
        (Dsv4Quant::Mxfp4, GgmlType::MXFP4, GgmlType::MXFP4),
    ] {
        // 2 layers (sliding only, one hash layer) and 4 (adds a CSA and an HCA layer).
        for layers in [2, 4] {
            let path = dir.join(format!("{}-{layers}.gguf", quant.name()));
            write(&cfg(quant, layers), &path);
            let g = GgufFile::open(&path).unwrap();
            let ty = |n: &str| g.tensor(n).unwrap_or_else(|| panic!("{n}")).ty;
            assert_eq!(ty("blk.0.ffn_gate_exps.weight"), gu);
            assert_eq!(ty("blk.0.ffn_up_exps.weight"), gu);
            assert_eq!(ty("blk.0.ffn_down_exps.weight"), down);
            assert_eq!(ty("blk.0.attn_q_b.weight"), GgmlType::Q8_0);
            assert_eq!(ty("blk.0.ffn_down_shexp.weight"), GgmlType::Q8_0);
            assert_eq!(ty("output.weight"), GgmlType::Q8_0);
            assert_eq!(ty("blk.0.hc_attn_fn.weight"), GgmlType::F16);
            assert_eq!(ty("blk.0.ffn_gate_tid2eid.weight"), GgmlType::I32);
            if layers == 4 {
                assert_eq!(ty("blk.2.attn_compressor_kv.weight"), GgmlType::F16);
                assert_eq!(ty("blk.2.indexer.attn_q_b.weight"), GgmlType::F16);
                assert_eq!(ty("blk.3.attn_compressor_ape.weight"), GgmlType::F16);
                assert!(g.tensor("blk.3.indexer.proj.weight").is_none());
            }
            let m = Model::load(&path).unwrap();
            let toks: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 250).collect();
            let mut st = m.new_state(256, false);
            let logits = m.forward(&mut st, &toks, Logits::All).unwrap();
            let n_vocab = m.cfg.n_vocab;
            assert_eq!(logits.len(), toks.len() * n_vocab);
            assert!(logits.iter().all(|v| v.is_finite()), "{path:?}");
            let last = &logits[(toks.len() - 1) * n_vocab..];
            let (lo, hi) = last
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            assert!(hi - lo > 1e-3, "{path:?}: flat logits {lo}..{hi}");
            // Decode steps after the prompt.
            for t in [3u32, 99, 200] {
                let l = m.forward(&mut st, &[t], Logits::Last).unwrap();
                assert!(l.iter().all(|v| v.is_finite()));
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn hash_table_has_k_distinct_valid_experts_per_token() {
    for (n, k) in [(256u32, 6u32), (16, 2), (8, 8), (7, 3)] {
        for t in 0..500u64 {
            let mut e: Vec<u32> = (0..k).map(|j| ds4::hash_expert(11, n, k, t, j)).collect();
            assert!(e.iter().all(|&x| x < n));
            e.sort_unstable();
            e.dedup();
            assert_eq!(e.len(), k as usize, "n {n} k {k} token {t}");
        }
    }
}

#[test]
fn the_real_preset_plans_the_release_sizes() {
    // Dry plans only (no bytes written): 43 layers of q2 are ~81 GiB like antirez's file.
    let mut c = cfg(Dsv4Quant::Q2, 43);
    c.shape = Dsv4Preset::Flash.shape();
    let plan = ds4::plan(&c, Vocab::builtin()).unwrap();
    let gib = plan.file_size() as f64 / (1u64 << 30) as f64;
    assert!((75.0..90.0).contains(&gib), "q2: {gib:.1} GiB");
    assert!(plan.fallbacks.is_empty(), "{:?}", plan.fallbacks);
    c.quant = Dsv4Quant::Mxfp4;
    let plan = ds4::plan(&c, Vocab::builtin()).unwrap();
    let gib = plan.file_size() as f64 / (1u64 << 30) as f64;
    assert!((135.0..160.0).contains(&gib), "mxfp4: {gib:.1} GiB");
}

#[test]
fn same_seed_same_bytes() {
    let dir = tmp_dir("seed");
    let (a, b) = (dir.join("a.gguf"), dir.join("b.gguf"));
    write(&cfg(Dsv4Quant::Q2, 2), &a);
    write(&cfg(Dsv4Quant::Q2, 2), &b);
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap());
    std::fs::remove_dir_all(&dir).unwrap();
}
