//! qwen4exp (Qwen3.8-Flash-Next) forward pass against transformers (float32) on tiny
//! random models, converted to GGUF by llama.cpp's own converter.
//!
//! Fixtures: tests/fixtures/qwen4exp/, made by tools/fixtures/make_qwen4exp.py
//! (transformers 5.24 `Qwen4ExpForCausalLM`, teacher-forced logits of prompts with EOS
//! inside, shorter and longer than the indexer budget). sluice never produced these numbers.

mod common;
use common::same_bits;

use std::path::PathBuf;

use sluice_engine::tier::PolicyKind;
use sluice_engine::tier::{StreamConfig, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};

fn fixture(name: &str) -> PathBuf {
    common::fixture_in("qwen4exp", name)
}

fn prompt(name: &str) -> Vec<u32> {
    common::ids(&common::manifest_in("qwen4exp")["prompts"][name])
}

/// Every position's logits: prefill in chunks of `batch`, the last `decode` tokens one
/// at a time (keys and values in f32, as transformers keeps them).
fn run(m: &Model, toks: &[u32], batch: usize, decode: usize, threads: usize) -> Vec<f32> {
    common::logits_all(m, toks, 512, true, batch, decode, threads)
}

fn check(gguf: &str, model: &str) {
    common::check_prompts_against_transformers("qwen4exp", gguf, model, run);
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

/// The converter's all-zero `attention.compress_ratios` (a-f32.gguf) and the same file
/// with the ratios transformers means (a-ratios-f32.gguf) run identically: sluice
/// restores ratio 4 on the all-zero file.
#[test]
fn zero_compress_ratios_are_restored_like_the_patched_file() {
    check("a-ratios-f32.gguf", "a");
    let toks = prompt("long");
    let a = run(
        &Model::load(&fixture("a-f32.gguf")).unwrap(),
        &toks,
        512,
        0,
        1,
    );
    let b = run(
        &Model::load(&fixture("a-ratios-f32.gguf")).unwrap(),
        &toks,
        512,
        0,
        1,
    );
    assert!(same_bits(&a, &b));
}

/// Routed experts streamed through the cache at its minimum budget: the same bits as
/// resident.
#[test]
fn streaming_experts_at_minimum_budget_is_bit_identical() {
    for name in ["a-f32.gguf", "c-f32.gguf"] {
        let path = fixture(name);
        let resident = Model::load(&path).unwrap();
        let toks = prompt("long");
        let want = run(&resident, &toks, 6, 5, 2);
        let k = resident.cfg.n_expert_used;
        let min = StreamingExperts::min_budget(&resident.groups.experts, k);
        for backend in [Backend::Pread, Backend::Mmap] {
            let cfg = StreamConfig {
                budget: min,
                policy: PolicyKind::default(),
                resident_layers: 0,
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
                "{name} {backend:?}: streamed differs"
            );
        }
    }
}

fn u64s(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The n-gram row ids of every token against transformers' own ids: the tiny models (hash
/// constants read from the converted GGUF files) and the real model's constants.
#[test]
fn ngram_row_ids_match_transformers() {
    use sluice_engine::models::arch::qwen4exp::load_qwen4exp;
    use sluice_engine::models::blocks::ple::NgramHash;
    let text = std::fs::read_to_string(fixture("ngram_rows.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    for model in ["a", "b", "c"] {
        let path = fixture(&format!("{model}-f32.gguf"));
        let file = sluice_gguf::GgufFile::open(&path).unwrap();
        let map = sluice_io::MappedFile::open(&path).unwrap();
        let m = load_qwen4exp(&file, &map).unwrap();
        let h = m.ple_hash().unwrap();
        for p in ["short", "long"] {
            let toks = prompt(p);
            let want: Vec<u64> = v["tiny"][model][p]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(u64s)
                .collect();
            let ctx = vec![h.eos; h.ngram - 1];
            let (got, _) = h.rows(&ctx, &toks);
            assert_eq!(got, want, "{model} {p}");
            // Token by token with the carried context: the same ids.
            let mut ctx = ctx;
            let mut one = Vec::new();
            for &t in &toks {
                let (ids, c) = h.rows(&ctx, &[t]);
                one.extend(ids);
                ctx = c;
            }
            assert_eq!(one, want, "{model} {p} token by token");
        }
    }
    let r = &v["real"];
    let h = NgramHash {
        ngram: 3,
        heads_per_ngram: 8,
        eos: r["eos"].as_u64().unwrap() as u32,
        multipliers: u64s(&r["multipliers"]),
        offsets: u64s(&r["head_offsets"]),
        vocab_sizes: u64s(&r["head_vocab_sizes"]),
    };
    // The constants of the spec (section 1.2), as the real GGUF files carry them.
    assert_eq!(
        h.multipliers,
        [23703573157769, 20109073645365, 8052911324071]
    );
    assert_eq!(h.offsets[15] + h.vocab_sizes[15], 320_001_446);
    let toks: Vec<u32> = u64s(&r["ids"]).iter().map(|&x| x as u32).collect();
    let want: Vec<u64> = r["rows"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(u64s)
        .collect();
    let (got, _) = h.rows(&[h.eos, h.eos], &toks);
    assert_eq!(got, want);
}

/// `--ple-io ram|mmap|direct` (any in-flight depth, row cache on or off, hints on or off):
/// the same logits, bit for bit, as reading the table through the model's own map.
#[test]
fn ple_io_modes_give_identical_logits() {
    use sluice_engine::load::LoadOptions;
    use sluice_engine::tier::{PleIo, PleOptions};
    for name in ["a-f32.gguf", "b-f32.gguf"] {
        let toks = prompt("long");
        let want = run(&Model::load(&fixture(name)).unwrap(), &toks, 8, 6, 1);
        for (io, inflight, cache, prefetch) in [
            (PleIo::Ram, 1, 0, true),
            (PleIo::Mmap, 1, 0, true),
            (PleIo::Mmap, 1, 0, false),
            (PleIo::Direct, 1, 0, true),
            (PleIo::Direct, 16, 1 << 10, true),
            (PleIo::Direct, 64, 64 << 20, true),
        ] {
            let loaded = LoadOptions {
                path: fixture(name),
                threads: 1,
                ctx: 512,
                stream: None,
                record_routing: None,
                ple: PleOptions {
                    io,
                    prefetch,
                    inflight,
                    row_cache_bytes: cache,
                },
                sequences: 1,
                device: Default::default(),
                weight_load: Default::default(),
            }
            .load()
            .unwrap();
            let ple = loaded.ple.as_ref().expect("a PLE reader is in effect");
            assert_eq!(ple.mode(), io);
            let got = run(&loaded.model, &toks, 8, 6, 1);
            assert!(
                same_bits(&got, &want),
                "{name} {io:?} inflight {inflight} cache {cache}"
            );
            let st = ple.stats();
            let heads = loaded.model.groups.row_tables[0].row_bytes; // nonzero
            assert!(heads > 0 && st.rows > 0);
            if io == PleIo::Direct && cache == 0 {
                assert!(st.reads > 0 && st.cache_hits == 0);
            }
            if io != PleIo::Mmap || !prefetch {
                assert_eq!(st.hints, 0, "{io:?}: no row hints");
            } else {
                assert!(st.hints > 0);
            }
        }
    }
}

/// The PLE table is a row-table group: never part of the resident (locked) ranges; routed
/// experts are unit layers of every layer.
#[test]
fn groups_describe_the_table_and_experts() {
    let m = Model::load(&fixture("a-f32.gguf")).unwrap();
    let g = &m.groups;
    assert_eq!(g.row_tables.len(), 1);
    let t = &g.row_tables[0];
    assert_eq!(t.name, "per_layer_token_embd.weight");
    assert_eq!((t.n_rows, t.row_bytes), (256, 8 * 4));
    let table = t.range();
    for r in g.resident_ranges(m.gguf.data_offset, m.gguf.file_size) {
        assert!(r.end <= table.start || r.start >= table.end);
    }
    assert_eq!(g.experts.layers.iter().flatten().count(), m.cfg.n_layer);
}

/// The per-sequence state beyond KV (DeltaNet conv/recurrent state, indexer keys, PLE
/// history and n-gram context) snapshots, restores and clears like the KV cache.
#[test]
fn snapshot_restore_and_clear_cover_the_recurrent_state() {
    let m = Model::load(&fixture("c-f32.gguf")).unwrap();
    let toks = prompt("long");
    let (a, b) = toks.split_at(13);
    let mut st = m.new_state(512, true);
    m.forward(&mut st, a, Logits::None).unwrap();
    let snap = st.snapshot();
    let first = m.forward(&mut st, b, Logits::All).unwrap();
    st.restore(&snap);
    let again = m.forward(&mut st, b, Logits::All).unwrap();
    assert!(same_bits(&first, &again));
    st.clear();
    m.forward(&mut st, a, Logits::None).unwrap();
    let cleared = m.forward(&mut st, b, Logits::All).unwrap();
    assert!(same_bits(&first, &cleared));
    // Prefix truncation is refused (recurrent state cannot be cut back).
    assert!(!st.truncate(5));
}

/// A file that counts the MTP draft layer in block_count (`nextn_predict_layers = 1`, the
/// per-layer arrays one longer) runs the main model's layers only: the same logits.
#[test]
fn mtp_layer_in_block_count_is_skipped() {
    use sluice_gguf::{GgufFile, GgufWriter, MetaArray, MetaValue};
    let src = fixture("a-f32.gguf");
    let mut file = GgufFile::open(&src).unwrap();
    let longer = |v: &MetaValue, extra: MetaValue| match v {
        MetaValue::Array(a) => {
            let mut values = a.values.clone();
            values.push(extra);
            MetaValue::Array(MetaArray {
                elem_type: a.elem_type,
                values,
            })
        }
        _ => panic!("not an array"),
    };
    for (k, v) in file.metadata.iter_mut() {
        match k.as_str() {
            "qwen4exp.block_count" => *v = MetaValue::U32(5),
            "qwen4exp.attention.recurrent_layers" => *v = longer(v, MetaValue::Bool(false)),
            "qwen4exp.attention.compress_ratios" => *v = longer(v, MetaValue::I32(0)),
            _ => {}
        }
    }
    file.metadata
        .push(("qwen4exp.nextn_predict_layers".into(), MetaValue::U32(1)));
    let dir = std::env::temp_dir().join(format!("sluice-q4mtp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("mtp.gguf");
    let mut r = std::fs::File::open(&src).unwrap();
    let w = std::io::BufWriter::new(std::fs::File::create(&out).unwrap());
    GgufWriter::rewrite(&file, &mut r, w, &out).unwrap();
    let toks = prompt("long");
    let want = run(&Model::load(&src).unwrap(), &toks, 512, 0, 1);
    let m = Model::load(&out).unwrap();
    assert_eq!(m.cfg.n_layer, 4);
    let got = run(&m, &toks, 512, 0, 1);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(same_bits(&got, &want));
}

/// Router lookahead (`--lookahead`) on and off, decoding the prompt's last tokens one at a
/// time (where it predicts): the resident logits bit for bit, and lookahead read ahead.
#[test]
fn lookahead_decode_equals_resident() {
    for name in ["a-f32.gguf", "c-f32.gguf"] {
        let path = fixture(name);
        let toks = prompt("long");
        let decode = toks.len() / 2;
        let want = run(&Model::load(&path).unwrap(), &toks, 6, decode, 2);
        let issued = common::check_lookahead(&path, &want, &|m| run(m, &toks, 6, decode, 2));
        assert!(issued > 0, "{name}: no lookahead read issued");
    }
}
