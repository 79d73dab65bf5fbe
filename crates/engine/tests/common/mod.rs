//! The tiny qwen3moe fixtures (tests/fixtures/qwen3moe, made by
//! tools/fixtures/make_qwen3moe.py) and small comparison helpers, shared by the engine's
//! integration tests.

// Each test binary compiles this module and uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// Path of a file in the qwen3moe fixture directory.
pub fn qwen3moe_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3moe")
        .join(name)
}

/// The fixture's token ids (tokens.json).
pub fn qwen3moe_tokens() -> Vec<u32> {
    json_ids(&qwen3moe_fixture("tokens.json"))
}

/// The `ids` array of a fixture's JSON file (tokens.json, manifest.json).
pub fn json_ids(path: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Whether two logit vectors are equal bit for bit.
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Router lookahead only moves bytes: `run` (the caller's token-by-token forward of the
/// model at `path`, where lookahead predicts) streamed with lookahead on gives `want` (the
/// resident logits) bit for bit, at a budget that evicts (3x the minimum) and at one that
/// holds every expert; off, nothing is predicted. Every byte read is a miss, a certain
/// prefetch or a lookahead read. Returns the lookahead reads issued (callers assert > 0).
pub fn check_lookahead(
    path: &Path,
    want: &[f32],
    run: &dyn Fn(&sluice_engine::Model) -> Vec<f32>,
) -> u64 {
    use sluice_engine::tier::{PolicyKind, StreamConfig, StreamingExperts};
    use sluice_io::{Backend, IoConfig};
    let probe = sluice_engine::Model::load(path).unwrap();
    let k = probe.cfg.n_expert_used;
    let min = StreamingExperts::min_budget(&probe.groups.experts, k);
    let all = probe.groups.experts.total_bytes() * 2;
    let mut issued = 0;
    for (budget, on, backend) in [
        (3 * min, true, Backend::Pread),
        (3 * min, false, Backend::Pread),
        (3 * min, true, Backend::Uring),
        (all, true, Backend::Pread),
    ] {
        let cfg = StreamConfig {
            budget,
            policy: PolicyKind::default(),
            resident_layers: 0,
            io: IoConfig {
                backend,
                direct: true,
                depth: 8,
                inflight_bytes: 0,
                threads: 2,
                high_priority: false,
            },
        };
        let mut m = sluice_engine::Model::load(path).unwrap();
        let s =
            std::sync::Arc::new(StreamingExperts::open(path, &m.groups.experts, k, &cfg).unwrap());
        s.set_lookahead(on);
        m.set_expert_source(Box::new(s.clone()));
        let got = run(&m);
        assert!(
            same_bits(&got, want),
            "{}: logits differ with lookahead {on} (budget {budget}, {backend:?})",
            path.display()
        );
        let (cs, io, ss) = (s.cache_stats(), s.io_stats(), s.stream_stats());
        let misses: u64 = cs
            .per_layer
            .iter()
            .zip(&m.groups.experts.unit_bytes_per_layer())
            .map(|(l, &b)| l.misses * b)
            .sum();
        assert_eq!(
            io.bytes_requested,
            misses + ss.prefetch_bytes + ss.la_bytes + ss.reread_bytes,
            "{}: bytes read != misses + prefetches + lookahead",
            path.display()
        );
        assert!(cs.peak_allocated <= budget);
        if on {
            assert!(ss.la_predicted > 0, "{}: nothing predicted", path.display());
            assert!(ss.la_hit <= ss.la_issued && ss.la_correct <= ss.la_actual);
            issued += ss.la_issued;
        } else {
            assert_eq!(ss.la_predicted + ss.la_issued, 0);
        }
    }
    issued
}

/// Path of a file in `tests/fixtures/<dir>` (the per-architecture oracle fixtures).
pub fn fixture_in(dir: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(dir)
        .join(name)
}

/// `tests/fixtures/<dir>/manifest.json`, parsed.
pub fn manifest_in(dir: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture_in(dir, "manifest.json")).unwrap())
        .unwrap()
}

/// Token ids stored as a JSON array.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every position's logits of `toks` on a fresh sequence of `ctx` positions: prefill in
/// chunks of `batch`, then the last `decode` tokens one at a time, on `threads` threads.
pub fn logits_all(
    m: &sluice_engine::Model,
    toks: &[u32],
    ctx: usize,
    kv_f32: bool,
    batch: usize,
    decode: usize,
    threads: usize,
) -> Vec<f32> {
    use sluice_engine::Logits;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let (pre, rest) = toks.split_at(toks.len() - decode);
    let mut st = m.new_state(ctx, kv_f32);
    let mut out = Vec::new();
    for c in pre.chunks(batch) {
        out.extend(pool.install(|| m.forward(&mut st, c, Logits::All)).unwrap());
    }
    for &t in rest {
        out.extend(
            pool.install(|| m.forward(&mut st, &[t], Logits::All))
                .unwrap(),
        );
    }
    out
}

/// Index of the largest value (the first one on a tie).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// max |a - b| / max |b|
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_ref = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_diff = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    max_diff / max_ref
}

/// Copy the GGUF `bytes` (read from `path`) to `out` with metadata `key` set to `value`.
pub fn rewrite_with(
    bytes: &[u8],
    path: &Path,
    key: &str,
    value: sluice_gguf::MetaValue,
    out: &Path,
) {
    let mut file = sluice_gguf::GgufFile::parse(bytes, path).unwrap();
    for (k, v) in file.metadata.iter_mut() {
        if k == key {
            *v = value.clone();
        }
    }
    let dst = std::fs::File::create(out).unwrap();
    sluice_gguf::GgufWriter::rewrite(&file, &mut std::io::Cursor::new(bytes), dst, out).unwrap();
}

/// The file at `path` loaded with its routed experts streamed through an LRU cache of
/// `budget` bytes (O_DIRECT, depth 4, 2 IO threads) on `backend`.
pub fn load_streamed(
    path: &Path,
    budget: u64,
    backend: sluice_io::Backend,
) -> (
    sluice_engine::Model,
    std::sync::Arc<sluice_engine::tier::StreamingExperts>,
) {
    use sluice_engine::tier::{PolicyKind, StreamConfig, StreamingExperts};
    let mut m = sluice_engine::Model::load(path).unwrap();
    let cfg = StreamConfig {
        budget,
        policy: PolicyKind::Lru,
        resident_layers: 0,
        io: sluice_io::IoConfig {
            backend,
            direct: true,
            depth: 4,
            inflight_bytes: 0,
            threads: 2,
            high_priority: false,
        },
    };
    let k = m.cfg.n_expert_used;
    let s = StreamingExperts::open(path, &m.groups.experts, k, &cfg).unwrap();
    let s = std::sync::Arc::new(s);
    m.set_expert_source(Box::new(s.clone()));
    (m, s)
}

/// The comparison every architecture's transformers test makes on all positions' logits
/// (`got` from sluice, `want` from transformers float32; `[positions, n_vocab]`): every
/// value finite, the largest |difference| within `rel` of the largest |reference logit|.
/// Returns the largest |reference logit|.
pub fn assert_close_to_reference(
    name: &str,
    got: &[f32],
    want: &[f32],
    n_vocab: usize,
    rel: f32,
) -> f32 {
    assert_eq!(got.len(), want.len(), "{name}: logits count");
    let max_ref = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let mut worst = (0.0f32, 0usize);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let d = (a - b).abs();
        assert!(d.is_finite(), "{name}: non-finite logit at {i}");
        if d > worst.0 {
            worst = (d, i / n_vocab);
        }
    }
    let (d, at) = worst;
    eprintln!(
        "{name}: max |sluice - transformers| = {d} at position {at} (max |logit| {max_ref}, relative {})",
        d / max_ref
    );
    assert!(
        d <= rel * max_ref,
        "{name}: max |sluice - transformers| = {d} at position {at} > {rel} * {max_ref}"
    );
    max_ref
}

/// Top-1 agrees at every position where the reference's top-1 margin exceeds `margin`
/// (near-ties may flip with summation order).
pub fn assert_top1_where_clear(name: &str, got: &[f32], want: &[f32], n_vocab: usize, margin: f32) {
    for (p, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > margin {
            assert_eq!(
                argmax(g),
                argmax(w),
                "{name}: top-1 differs at position {p}"
            );
        }
    }
}

/// Each position's largest |got - want|.
pub fn per_position_max_diff(got: &[f32], want: &[f32], n_vocab: usize) -> Vec<f32> {
    got.chunks(n_vocab)
        .zip(want.chunks(n_vocab))
        .map(|(g, w)| {
            g.iter()
                .zip(w)
                .fold(0.0f32, |a, (x, y)| a.max((x - y).abs()))
        })
        .collect()
}

/// The recurrent architectures' oracle check (qwen4exp, glm5next): for each prompt of
/// the fixture's manifest, one-shot prefill within 1e-3 of the largest |logit| of
/// transformers' `{reference}.{prompt}.logits.npy`, and chunked prefill, token-by-token
/// decode and other thread counts giving the same bits. `run(model, tokens, batch,
/// decode, threads)` computes every position's logits.
pub fn check_prompts_against_transformers(
    dir: &str,
    gguf: &str,
    reference: &str,
    run: impl Fn(&sluice_engine::Model, &[u32], usize, usize, usize) -> Vec<f32>,
) {
    let m = sluice_engine::Model::load(&fixture_in(dir, gguf)).unwrap();
    let man = manifest_in(dir);
    for p in ["short", "long"] {
        let toks = ids(&man["prompts"][p]);
        let npy = fixture_in(dir, &format!("{reference}.{p}.logits.npy"));
        let (want, _) = sluice_engine::eval::read_npy_f32(&npy).unwrap();
        let whole = run(&m, &toks, 512, 0, 1);
        let err = rel_err(&whole, &want);
        eprintln!("{gguf} {p}: max |sluice - transformers| / max |logit| = {err:.3e}");
        assert!(err < 1e-3, "{gguf} {p}: relative error {err} >= 1e-3");
        for (batch, decode, threads) in [(5, 0, 2), (3, 4, 1), (1, 0, 2), (7, toks.len() / 2, 2)] {
            let got = run(&m, &toks, batch, decode, threads);
            assert!(
                same_bits(&got, &whole),
                "{gguf} {p}: batch {batch} decode {decode} threads {threads} differs from one-shot prefill"
            );
        }
    }
}

/// Write a random-weight qwen3moe of `shape` (`sluice synth`, Q8_0, no router skew) to
/// `path`.
pub fn write_synth_q8_0(path: &Path, shape: sluice_synth::Shape, seed: u64, name: &str) {
    use sluice_synth::{Plan, SynthConfig, Vocab, WriteOptions};
    let cfg = SynthConfig {
        shape,
        quant: sluice_gguf::GgmlType::Q8_0,
        router_skew: 0.0,
        seed,
        name: name.into(),
    };
    let plan = Plan::new(&cfg, Vocab::builtin()).unwrap();
    let cancel = std::sync::atomic::AtomicBool::new(false);
    sluice_synth::write(
        &plan,
        path,
        &WriteOptions {
            force: true,
            progress: &|_| {},
            cancel: &cancel,
        },
    )
    .unwrap();
}
