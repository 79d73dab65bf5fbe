//! GLM-5.x (`glm-dsa`) forward pass against transformers (float32) on tiny random models,
//! chunking invariance, snapshots, and streaming == resident (budgets, IO backends,
//! resident layers).
//!
//! Fixtures: tests/fixtures/glm_dsa/, made by tools/fixtures/make_glm_dsa.py (transformers
//! 5.24 `GlmMoeDsaForCausalLM` builds the models with fixed seeds; llama.cpp's converter
//! writes the GGUF; transformers saves its own float32 logits for the token ids of
//! manifest.json). sluice never produced these numbers. The prompt (96 tokens) is 6 to 24
//! times the models' indexer top-k, so the sparse selection drops most tokens, and model a
//! and c have "shared" layers that reuse an earlier layer's selection.

mod common;
use common::{argmax, same_bits};

use std::path::{Path, PathBuf};

use sluice_engine::eval::read_npy_f32;
use sluice_engine::tier::{PolicyKind, StreamConfig, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};

fn fixture(name: &str) -> PathBuf {
    common::fixture_in("glm_dsa", name)
}

fn manifest() -> serde_json::Value {
    common::manifest_in("glm_dsa")
}

fn tokens() -> Vec<u32> {
    common::ids(&manifest()["ids"])
}

/// Every position's logits: prefill in chunks of `batch`, with `threads` threads.
fn run(m: &Model, batch: usize, threads: usize, kv_f32: bool) -> Vec<f32> {
    common::logits_all(m, &tokens(), 256, kv_f32, batch, 0, threads)
}

/// With an f32 latent cache sluice computes what transformers computes in float32, except
/// that it runs MLA absorbed (the query through `attn_k_b`, the attended latent through
/// `attn_v_b`) where transformers expands keys and values: the same sums in another order,
/// ~1e-6 relative per operation. The tolerance, 1e-3 of the largest |logit| (the issue's
/// bound), fails on any real mistake (a wrong rotation, selection, norm or router moves
/// logits by 1e-2..1). The indexer and router choices could flip on a near-tie; the fixture
/// records the smallest gaps (manifest `min_*_gap`). Top-1 must agree wherever the
/// reference's top-1 margin exceeds 1e-3.
fn check(name: &str) {
    let man = manifest();
    let entry = &man["models"][name];
    let m = Model::load(&fixture(entry["file"].as_str().unwrap())).unwrap();
    assert_eq!(m.cfg.arch, "glm-dsa");
    let (want, shape) = read_npy_f32(&fixture(entry["logits"].as_str().unwrap())).unwrap();
    let n_vocab = m.cfg.n_vocab;
    assert_eq!(shape[1], n_vocab);
    let got = run(&m, 32, 2, true);
    let max_ref = common::assert_close_to_reference(name, &got, &want, n_vocab, 1e-3);
    common::assert_top1_where_clear(name, &got, &want, n_vocab, 1e-3);
    // The default f16-rounded latent rows (llama.cpp's default cache type; the indexer keys
    // stay f32): the rounding (~5e-4 relative) moves logits by ~2e-3, and by up to ~1e-2 of
    // the largest |logit| where it flips a near-tied choice (llama.cpp with its default F16 cache:
    // 2e-3, and 0.050 at one position of model b, llama_cpp_check.json). Bound: every
    // position within 2e-2 of the largest |logit|.
    let f16 = run(&m, 32, 2, false);
    let per_pos = common::per_position_max_diff(&f16, &want, n_vocab);
    let worst_f16 = per_pos.iter().fold(0.0f32, |a, &b| a.max(b));
    eprintln!("{name}: with f16 latent rows: max |sluice - transformers| = {worst_f16}");
    assert!(
        worst_f16 <= 2e-2 * max_ref,
        "{name}: f16 latent rows: max |sluice - transformers| = {worst_f16}"
    );
}

#[test]
fn model_a_matches_transformers() {
    check("a");
}

#[test]
fn model_b_matches_transformers() {
    check("b");
}

#[test]
fn model_c_matches_transformers() {
    check("c");
}

/// Latent and indexer caches carry across prefill chunks and decode steps: one-shot
/// prefill, odd chunks and token-by-token give the same bits (f16 cache, 1 or 2 threads).
#[test]
fn chunked_prefill_equals_token_by_token() {
    for name in ["a-f32.gguf", "b-f32.gguf", "c-f32.gguf"] {
        let m = Model::load(&fixture(name)).unwrap();
        let whole = run(&m, 96, 1, false);
        for (batch, threads) in [(1, 2), (7, 2), (50, 1)] {
            let got = run(&m, batch, threads, false);
            assert!(
                same_bits(&got, &whole),
                "{name}: batch {batch} threads {threads} differs from one-shot prefill"
            );
        }
    }
}

/// A snapshot taken mid-sequence and restored continues exactly like the original.
#[test]
fn snapshot_restore_continues_identically() {
    let m = Model::load(&fixture("a-f32.gguf")).unwrap();
    let toks = tokens();
    let mut st = m.new_state(256, false);
    m.forward(&mut st, &toks[..60], Logits::Last).unwrap();
    let snap = st.snapshot();
    let a = m.forward(&mut st, &toks[60..70], Logits::All).unwrap();
    let mut other = m.new_state(256, false);
    other.restore(&snap);
    let b = m.forward(&mut other, &toks[60..70], Logits::All).unwrap();
    assert!(same_bits(&a, &b));
}

/// Routed experts streamed through the byte-budgeted cache (minimum budget, 3x, everything;
/// pread and io_uring, direct or not; the first MoE layer pinned resident) give the
/// resident logits bit for bit, and every byte read is a miss.
#[test]
fn streaming_equals_resident() {
    for name in ["a-f32.gguf", "b-f32.gguf", "c-f32.gguf"] {
        let path = fixture(name);
        let resident = Model::load(&path).unwrap();
        let want = run(&resident, 16, 2, false);
        let k = resident.cfg.n_expert_used;
        let min = StreamingExperts::min_budget(&resident.groups.experts, k);
        let all = resident.groups.experts.total_bytes() * 2;
        for (budget, backend, direct, pinned) in [
            (min, Backend::Pread, true, 0),
            (min, Backend::Uring, false, 0),
            (3 * min, Backend::Pread, true, 0),
            (3 * min, Backend::Uring, true, 0),
            (all, Backend::Pread, false, 0),
            (all, Backend::Pread, true, 1),
        ] {
            let cfg = StreamConfig {
                budget,
                policy: PolicyKind::Lru,
                resident_layers: pinned,
                io: IoConfig {
                    backend,
                    direct,
                    depth: 8,
                    inflight_bytes: 0,
                    threads: 2,
                    high_priority: false,
                },
            };
            let mut m = Model::load(&path).unwrap();
            let s = std::sync::Arc::new(
                StreamingExperts::open(&path, &m.groups.experts, k, &cfg).unwrap(),
            );
            m.set_expert_source(Box::new(s.clone()));
            let got = run(&m, 16, 2, false);
            assert!(
                same_bits(&got, &want),
                "{name}: streamed logits differ (budget {budget}, {backend:?}, direct {direct}, resident layers {pinned})"
            );
            let (cs, io) = (s.cache_stats(), s.io_stats());
            let per_layer = m.groups.experts.unit_bytes_per_layer();
            let misses: u64 = cs
                .per_layer
                .iter()
                .zip(&per_layer)
                .map(|(l, &b)| l.misses * b)
                .sum();
            assert!(cs.peak_allocated <= budget);
            eprintln!(
                "{name} budget {budget} {backend:?} resident layers {pinned}: misses {} hits {} bytes read {} (misses {misses})",
                cs.total.misses, cs.total.hits, io.bytes_requested
            );
        }
    }
}

/// The 32-block types llama-quantize falls back to for GLM rows that are not multiples of
/// 256 (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) and Q8_0, every matrix of model a in that type
/// (`llama-quantize --pure`; norms and router F32; `attn_k_b` / `attn_v_b` F32, see
/// tools/fixtures/make_glm_dsa_quant.py for why), against llama.cpp's logits on the same
/// files (F32 KV). Both round the activations to Q8_0 (Q8_1 for Q4_1 / Q5_1) before each product, so most positions
/// agree bit for bit; where summation order flips a near-tied choice, a position moves. Bounds: the
/// median position within 1e-3 of the largest |logit|, >= 90% of the positions within 1e-2,
/// top-1 agreement wherever llama.cpp's margin exceeds 0.05 at >= 95% of those positions.
#[test]
fn fallback_types_match_llama_cpp() {
    let q: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("quant.json")).unwrap()).unwrap();
    let mut failed = Vec::new();
    for (ty, entry) in q["types"].as_object().unwrap() {
        let m = Model::load(&fixture(entry["file"].as_str().unwrap())).unwrap();
        let (want, _) = read_npy_f32(&fixture(entry["logits"].as_str().unwrap())).unwrap();
        let n_vocab = m.cfg.n_vocab;
        let got = run(&m, 32, 2, true);
        assert_eq!(got.len(), want.len());
        let max_ref = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let mut per_pos = Vec::new();
        let (mut clear, mut agree) = (0, 0);
        for (g, w) in got.chunks(n_vocab).zip(want.chunks(n_vocab)) {
            per_pos.push(
                g.iter()
                    .zip(w)
                    .fold(0.0f32, |a, (x, y)| a.max((x - y).abs())),
            );
            let mut sorted = w.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 0.05 {
                clear += 1;
                agree += usize::from(argmax(g) == argmax(w));
            }
        }
        let within = per_pos.iter().filter(|&&d| d <= 1e-2 * max_ref).count();
        let mut sorted = per_pos.clone();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let median = sorted[sorted.len() / 2];
        eprintln!(
            "{ty}: |sluice - llama.cpp|: median position {median} (max |logit| {max_ref}), max {}, {within}/{} positions within 1e-2, top-1 {agree}/{clear} where the margin > 0.05",
            sorted[sorted.len() - 1],
            per_pos.len()
        );
        // Q4_1 / Q5_1 pair with Q8_1 activations in both engines (the stored block sums), so
        // they are held to the same bounds as the other types.
        let ok = median <= 1e-3 * max_ref
            && within * 10 >= per_pos.len() * 9
            && agree * 100 >= clear * 95;
        if !ok {
            failed.push(ty.clone());
        }
    }
    assert!(failed.is_empty(), "outside the bounds: {failed:?}");
}

/// A copy of fixture `name` with its metadata edited by `edit`, written to `out`.
fn rewrite(name: &str, out: &Path, edit: impl FnOnce(&mut Vec<(String, sluice_gguf::MetaValue)>)) {
    let src = fixture(name);
    let mut file = sluice_gguf::GgufFile::open(&src).unwrap();
    edit(&mut file.metadata);
    let mut r = std::fs::File::open(&src).unwrap();
    let w = std::io::BufWriter::new(std::fs::File::create(out).unwrap());
    sluice_gguf::GgufWriter::rewrite(&file, &mut r, w, out).unwrap();
}

/// Without `attention.indexer.types` the kinds follow llama.cpp's rule: all full below a
/// 1M-token context (model b, all full: the same bits), else the GLM-5.2 pattern (full,
/// full, full, shared, full for 5 layers: b carries indexer weights on every layer, like
/// unsloth's files, and layer 3 must ignore them, so the logits change once the selection
/// drops tokens, and only there). A file whose shared layers lack indexer weights fails
/// with an error naming the missing tensor when the rule makes them full.
#[test]
fn indexer_types_fallback_by_context_length() {
    use sluice_gguf::MetaValue;
    let dir = std::env::temp_dir().join(format!("sluice-glm-types-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let drop_types = |m: &mut Vec<(String, MetaValue)>| {
        m.retain(|(k, _)| k != "glm-dsa.attention.indexer.types")
    };
    let want = run(&Model::load(&fixture("b-f32.gguf")).unwrap(), 32, 2, true);
    let n_vocab = 512;

    let short = dir.join("b-short.gguf");
    rewrite("b-f32.gguf", &short, drop_types);
    assert!(same_bits(
        &run(&Model::load(&short).unwrap(), 32, 2, true),
        &want
    ));

    let long = dir.join("b-1m.gguf");
    rewrite("b-f32.gguf", &long, |m| {
        drop_types(m);
        for (k, v) in m.iter_mut() {
            if k == "glm-dsa.context_length" {
                *v = MetaValue::U32(1_048_576);
            }
        }
    });
    let got = run(&Model::load(&long).unwrap(), 32, 2, true);
    let top_k = 16;
    let differs = |p: usize| {
        !same_bits(
            &got[p * n_vocab..(p + 1) * n_vocab],
            &want[p * n_vocab..(p + 1) * n_vocab],
        )
    };
    assert!(
        (0..top_k).all(|p| !differs(p)),
        "dense-equivalent positions moved"
    );
    assert!(
        (top_k..96).any(differs),
        "the GLM-5.2 pattern was not applied"
    );

    let c = dir.join("c-no-types.gguf");
    rewrite("c-f32.gguf", &c, drop_types);
    let err = match Model::load(&c) {
        Ok(_) => panic!("c without indexer types loaded"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("blk.1.indexer"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Bad metadata: a clear one-line error naming the key, never a panic.
#[test]
fn bad_metadata_is_a_clear_error() {
    use sluice_gguf::{MetaArray, MetaType, MetaValue};
    let dir = std::env::temp_dir().join(format!("sluice-glm-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: Vec<(&str, MetaValue, &str)> = vec![
        (
            "glm-dsa.attention.indexer.types",
            MetaValue::Array(MetaArray {
                elem_type: MetaType::Bool,
                values: vec![MetaValue::Bool(false); 4],
            }),
            "indexer.types",
        ),
        (
            "glm-dsa.attention.indexer.types",
            MetaValue::Array(MetaArray {
                elem_type: MetaType::Bool,
                values: vec![MetaValue::Bool(true); 2],
            }),
            "indexer.types",
        ),
        (
            "glm-dsa.attention.indexer.top_k",
            MetaValue::U32(0),
            "top_k",
        ),
        (
            "glm-dsa.rope.dimension_count",
            MetaValue::U32(7),
            "rope.dimension_count",
        ),
        (
            "glm-dsa.expert_gating_func",
            MetaValue::U32(9),
            "expert_gating_func",
        ),
        (
            "glm-dsa.expert_used_count",
            MetaValue::U32(99),
            "expert_used_count",
        ),
    ];
    for (i, (key, value, needle)) in cases.into_iter().enumerate() {
        let out = dir.join(format!("bad{i}.gguf"));
        rewrite("a-f32.gguf", &out, |m| {
            match m.iter_mut().find(|(k, _)| k == key) {
                Some((_, v)) => *v = value.clone(),
                // (the converter writes no expert_gating_func for this config)
                None => m.push((key.to_string(), value.clone())),
            }
        });
        let err = match Model::load(&out) {
            Ok(_) => panic!("{key}: a bad value was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(needle), "{key}: error does not name it: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A file that carries an MTP block (`nextn_predict_layers` 1, `blk.4.*` with `nextn.*`
/// after the 4 main layers, as the converter appends GLM-5.2's `model.layers.78`) loads,
/// never runs the block (same logits as without it) and describes its routed experts as
/// streamable (so they stay on disk and are never locked).
#[test]
fn file_with_mtp_block_loads_and_ignores_it() {
    use sluice_gguf::{GgmlType, GgufFile, GgufWriter, MetaArray, MetaType, MetaValue, TensorSpec};
    let path = fixture("a-f32.gguf");
    let bytes = std::fs::read(&path).unwrap();
    let file = GgufFile::parse(&bytes, &path).unwrap();
    let n = 4u64;
    let mut meta = file.metadata.clone();
    for (k, v) in meta.iter_mut() {
        match k.as_str() {
            "glm-dsa.block_count" => *v = MetaValue::U32(n as u32 + 1),
            "glm-dsa.nextn_predict_layers" => *v = MetaValue::U32(1),
            "glm-dsa.attention.indexer.types" => {
                *v = MetaValue::Array(MetaArray {
                    elem_type: MetaType::Bool,
                    values: [true, true, false, true, true]
                        .iter()
                        .map(|&b| MetaValue::Bool(b))
                        .collect(),
                })
            }
            _ => {}
        }
    }
    // The MTP block: layer 3's tensors renamed to blk.4, plus nextn.*.
    let e = 64u64;
    let mut specs: Vec<TensorSpec> = file.tensors.iter().map(TensorSpec::from).collect();
    let slice = |t: &sluice_gguf::TensorInfo| {
        let r = file.tensor_range(t);
        bytes[r.start as usize..r.end as usize].to_vec()
    };
    let mut data: Vec<Vec<u8>> = file.tensors.iter().map(slice).collect();
    for t in &file.tensors {
        if let Some(rest) = t.name.strip_prefix("blk.3.") {
            specs.push(TensorSpec::new(format!("blk.{n}.{rest}"), &t.dims, t.ty));
            data.push(slice(t));
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
    let dir = std::env::temp_dir().join(format!("sluice-glm-mtp-{}", std::process::id()));
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
    assert_eq!(with_mtp.groups.experts.layers.len(), n as usize + 1);
    assert!(with_mtp.groups.experts.layers[n as usize].is_some());
    let plain = Model::load(&path).unwrap();
    assert!(same_bits(
        &run(&with_mtp, 32, 2, false),
        &run(&plain, 32, 2, false)
    ));
    std::fs::remove_dir_all(&dir).ok();
}

/// Router lookahead (`--lookahead`) on and off, decoding token by token (where it
/// predicts): the resident logits bit for bit, and lookahead really read ahead.
#[test]
fn lookahead_decode_equals_resident() {
    for name in ["a-f32.gguf", "b-f32.gguf", "c-f32.gguf"] {
        let path = fixture(name);
        let want = run(&Model::load(&path).unwrap(), 1, 2, false);
        let issued = common::check_lookahead(&path, &want, &|m| run(m, 1, 2, false));
        assert!(issued > 0, "{name}: no lookahead read issued");
    }
}
