//! glm5next (GLM-5.3-Flash) forward pass against transformers (float32) on tiny random
//! models, converted to GGUF by llama.cpp's own converter.
//!
//! Fixtures: tests/fixtures/glm5next/, made by tools/fixtures/make_glm5next.py
//! (transformers 5.24 `Glm5NextTextModel` + its LM head, teacher-forced logits of a short
//! prompt and of a prompt long enough that the pooled indexer drops pools; three configs:
//! KDA with the lower-bound gate and with the softplus gate, kpool 4 and 2, clamps that
//! bite, a shared indexer layer). sluice never produced these numbers.
//!
//! Tolerance: 1e-3 of the largest |logit| against transformers; chunked prefill,
//! token-by-token decode and thread counts must give the same bits (the KDA recurrence and
//! every reduction run in one fixed order whatever the chunking).

mod common;
use common::{rewrite_with, same_bits};

use std::path::PathBuf;

use sluice_engine::tier::PolicyKind;
use sluice_engine::tier::{StreamConfig, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};

fn fixture(name: &str) -> PathBuf {
    common::fixture_in("glm5next", name)
}

fn prompt(name: &str) -> Vec<u32> {
    common::ids(&common::manifest_in("glm5next")["prompts"][name])
}

/// Every position's logits: prefill in chunks of `batch`, the last `decode` tokens one
/// at a time (latents and indexer keys in f32, as transformers keeps them).
fn run(m: &Model, toks: &[u32], batch: usize, decode: usize, threads: usize) -> Vec<f32> {
    common::logits_all(m, toks, 512, true, batch, decode, threads)
}

fn check(gguf: &str, model: &str) {
    common::check_prompts_against_transformers("glm5next", gguf, model, run);
}

#[test]
fn model_a_f32_matches_transformers() {
    check("a-f32.gguf", "a");
}

#[test]
fn model_b_f32_matches_transformers() {
    check("b-f32.gguf", "b");
}

#[test]
fn model_c_f32_matches_transformers() {
    check("c-f32.gguf", "c");
}

/// unsloth's spelling (`glm5next`, keys under that prefix) and the PR #27752 key
/// `attention.indexer.block_size`: the same model, the same bits.
#[test]
fn alias_spelling_and_block_size_key_load_the_same_model() {
    check("a-alias.gguf", "a");
    let toks = prompt("long");
    let a = run(
        &Model::load(&fixture("a-f32.gguf")).unwrap(),
        &toks,
        512,
        0,
        1,
    );
    let b = run(
        &Model::load(&fixture("a-alias.gguf")).unwrap(),
        &toks,
        512,
        0,
        1,
    );
    assert!(same_bits(&a, &b));
}

/// A snapshot taken mid-prompt and restored gives the same continuation (KDA state and
/// latent rows are copied, not shared).
#[test]
fn snapshot_restore_continues_identically() {
    let m = Model::load(&fixture("c-f32.gguf")).unwrap();
    let toks = prompt("long");
    let mut st = m.new_state(512, true);
    m.forward(&mut st, &toks[..20], Logits::None).unwrap();
    let snap = st.snapshot();
    let want = m.forward(&mut st, &toks[20..], Logits::All).unwrap();
    let mut other = m.new_state(512, true);
    m.forward(&mut other, &toks[..9], Logits::None).unwrap();
    other.restore(&snap);
    let got = m.forward(&mut other, &toks[20..], Logits::All).unwrap();
    assert!(same_bits(&got, &want));
    st.clear();
    let again = m.forward(&mut st, &toks, Logits::All).unwrap();
    let whole = run(&m, &toks, 512, 0, 1);
    assert!(same_bits(&again, &whole), "clear() leaves no state behind");
}

/// Routed experts streamed through the cache at its minimum budget, with the first MoE
/// layer pinned or not: the same bits as resident.
#[test]
fn streaming_experts_at_minimum_budget_is_bit_identical() {
    for name in ["a-f32.gguf", "c-f32.gguf"] {
        let path = fixture(name);
        let resident = Model::load(&path).unwrap();
        let toks = prompt("long");
        let want = run(&resident, &toks, 6, 5, 2);
        let k = resident.cfg.n_expert_used;
        let min = StreamingExperts::min_budget(&resident.groups.experts, k);
        for (backend, pinned) in [(Backend::Pread, 0), (Backend::Mmap, 0), (Backend::Pread, 1)] {
            let cfg = StreamConfig {
                budget: min,
                policy: PolicyKind::default(),
                resident_layers: pinned,
                io: IoConfig {
                    backend,
                    direct: false,
                    depth: 4,
                    inflight_bytes: 0,
                    threads: 2,
                    high_priority: false,
                },
            };
            let mut m = Model::load(&path).unwrap();
            let s = StreamingExperts::open(&path, &m.groups.experts, k, &cfg).unwrap();
            m.set_expert_source(Box::new(s));
            let got = run(&m, &toks, 6, 5, 2);
            assert!(
                same_bits(&got, &want),
                "{name} {backend:?} resident_layers {pinned}: streamed differs"
            );
        }
    }
}

/// Inconsistent hyper-parameters are refused at load with a one-line error naming the key
/// (or the tensor whose shape disagrees).
#[test]
fn bad_metadata_is_refused() {
    use sluice_gguf::{MetaArray, MetaType, MetaValue};
    let path = fixture("a-f32.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let bools = |v: &[bool]| {
        MetaValue::Array(MetaArray {
            elem_type: MetaType::Bool,
            values: v.iter().map(|&b| MetaValue::Bool(b)).collect(),
        })
    };
    let cases: Vec<(&str, MetaValue, &str)> = vec![
        (
            "glm5-next.attention.indexer.kpool",
            MetaValue::U32(3),
            "kpool",
        ),
        (
            "glm5-next.rope.dimension_count",
            MetaValue::U32(8),
            "rope.dimension_count",
        ),
        (
            "glm5-next.attention.head_count_kv",
            MetaValue::Array(MetaArray {
                elem_type: MetaType::I32,
                values: vec![MetaValue::I32(0), MetaValue::I32(1)],
            }),
            "head_count_kv",
        ),
        (
            "glm5-next.attention.indexer.types",
            bools(&[true, false, true, true]),
            "shares the indexer selection",
        ),
        (
            "glm5-next.attention.q_lora_rank",
            MetaValue::U32(16),
            "blk.1.indexer.attn_q_b.weight",
        ),
        (
            "glm5-next.expert_used_count",
            MetaValue::U32(9),
            "expert_used_count",
        ),
    ];
    let dir = std::env::temp_dir().join(format!("sluice-glm5-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (key, value, needle) in cases {
        let out = dir.join("bad.gguf");
        rewrite_with(&bytes, &path, key, value, &out);
        let err = match Model::load(&out) {
            Ok(_) => panic!("{key}: a bad value was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{key}: error does not name it: {err}");
        assert!(
            err.contains("bad.gguf"),
            "{key}: error does not name the file: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A file that carries an MTP block (`nextn_predict_layers` 1, per-layer arrays one longer,
/// `blk.N.*` with `nextn.*` after the main layers, as the converter writes it without
/// `--no-mtp`) loads, never runs the block (same logits as without it) and describes its
/// routed experts as streamable (they stay on disk).
#[test]
fn file_with_mtp_block_loads_and_ignores_it() {
    use sluice_gguf::{GgmlType, GgufFile, GgufWriter, MetaArray, MetaType, MetaValue, TensorSpec};
    let path = fixture("a-f32.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let file = GgufFile::parse(&bytes, &path).unwrap();
    let n = 4u64; // main layers of model a
    let mut meta = file.metadata.clone();
    for (k, v) in meta.iter_mut() {
        match k.as_str() {
            "glm5-next.block_count" => *v = MetaValue::U32(n as u32 + 1),
            "glm5-next.attention.head_count_kv" => {
                *v = MetaValue::Array(MetaArray {
                    elem_type: MetaType::I32,
                    values: [0, 1, 0, 1, 1].iter().map(|&x| MetaValue::I32(x)).collect(),
                })
            }
            "glm5-next.swiglu_clamp_exp" | "glm5-next.swiglu_clamp_shexp" => {
                *v = MetaValue::Array(MetaArray {
                    elem_type: MetaType::F32,
                    values: vec![MetaValue::F32(10.0); n as usize + 1],
                })
            }
            _ => {}
        }
    }
    meta.push(("glm5-next.nextn_predict_layers".into(), MetaValue::U32(1)));
    // The MTP block: layer 3's tensors (a DSA + MoE layer) renamed to blk.4, plus nextn.*.
    let e = 64u64;
    let mut specs: Vec<TensorSpec> = file.tensors.iter().map(TensorSpec::from).collect();
    let mut data: Vec<Vec<u8>> = file
        .tensors
        .iter()
        .map(|t| {
            let r = file.tensor_range(t);
            bytes[r.start as usize..r.end as usize].to_vec()
        })
        .collect();
    for t in &file.tensors {
        if let Some(rest) = t.name.strip_prefix("blk.3.") {
            if rest.starts_with("hc_") {
                continue; // the MTP block has no mHC
            }
            let r = file.tensor_range(t);
            specs.push(TensorSpec::new(format!("blk.{n}.{rest}"), &t.dims, t.ty));
            data.push(bytes[r.start as usize..r.end as usize].to_vec());
        }
    }
    for (name, dims) in [
        ("nextn.eh_proj.weight", vec![2 * e, e]),
        ("nextn.enorm.weight", vec![e]),
        ("nextn.hnorm.weight", vec![e]),
        ("nextn.shared_head_norm.weight", vec![e]),
    ] {
        let len: u64 = dims.iter().product();
        specs.push(TensorSpec::new(
            format!("blk.{n}.{name}"),
            &dims,
            GgmlType::F32,
        ));
        data.push(vec![0u8; 4 * len as usize]);
    }
    let dir = std::env::temp_dir().join(format!("sluice-glm5-mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("mtp.gguf");
    let f = std::fs::File::create(&out).unwrap();
    let mut w = GgufWriter::new(f, &out, &meta, &specs).unwrap();
    for (s, d) in specs.iter().zip(&data) {
        w.write_tensor(&s.name, d).unwrap();
    }
    w.finish().unwrap();

    let with_mtp = Model::load(&out).unwrap();
    assert_eq!(with_mtp.cfg.n_layer, n as usize);
    let layers = &with_mtp.groups.experts.layers;
    assert_eq!(layers.len(), n as usize + 1);
    assert!(layers[0].is_none() && layers[n as usize].is_some());
    let plain = Model::load(&path).unwrap();
    let toks = prompt("long");
    assert!(same_bits(
        &run(&with_mtp, &toks, 512, 3, 1),
        &run(&plain, &toks, 512, 3, 1)
    ));
    std::fs::remove_dir_all(&dir).ok();
}
