//! Whole models on the GPU backend against transformers and against the CPU backend
//! (needs a CUDA device; ignored otherwise:
//! `cargo test --release -p sluice-cuda --test gpu_logits -- --ignored --test-threads 1`).
//!
//! Fixtures: tests/fixtures/qwen3moe (transformers float32 logits, made by
//! tools/fixtures/make_qwen3moe.py; `SLUICE_FIXTURES` points elsewhere, e.g. on a machine
//! that has the test binary but not the checkout). Gemma 3 270M from `SLUICE_GEMMA` or
//! `$HOME/.cache/sluice/models/gemma-3-270m-q4_k_m.gguf` (skipped with a note if absent,
//! unless `SLUICE_REQUIRE_MODELS` is set).

use std::path::PathBuf;

use sluice_cuda::Cuda;
use sluice_engine::eval::read_npy_f32;
use sluice_engine::{Logits, Model};

fn fixtures() -> PathBuf {
    match std::env::var_os("SLUICE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn json(path: PathBuf) -> serde_json::Value {
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Every position's logits, the prompt in chunks of `batch`, on the GPU or the CPU.
fn logits(
    path: &PathBuf,
    toks: &[u32],
    batch: usize,
    gpu: bool,
) -> (Vec<f32>, usize, Option<Cuda>) {
    let mut m = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let g = if gpu {
        let c = Cuda::new(m.map.bytes())
            .unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"));
        m.set_compute(Box::new(c.clone()));
        Some(c)
    } else {
        None
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let mut kv = m.new_state(toks.len() + 8, true);
    let mut out = Vec::new();
    for c in toks.chunks(batch) {
        out.extend(pool.install(|| m.forward(&mut kv, c, Logits::All)).unwrap());
    }
    (out, m.cfg.n_vocab, g)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

fn top2_margin(row: &[f32]) -> f32 {
    let mut s = row.to_vec();
    s.sort_by(|a, b| b.total_cmp(a));
    s[0] - s[1]
}

fn qwen3moe(name: &str) -> PathBuf {
    fixtures().join("qwen3moe").join(name)
}

fn qwen3moe_tokens() -> Vec<u32> {
    ids(&json(qwen3moe("tokens.json"))["ids"])
}

/// F32 weights: the GPU keeps f32 activations, like transformers: the CPU's bound (max
/// |diff| / max |ref| < 1e-4) holds; chunking (64 vs 1 token per call) changes no bit.
#[test]
#[ignore = "needs a CUDA device"]
fn qwen3moe_f32_on_gpu_matches_transformers() {
    let toks = qwen3moe_tokens();
    for (model, npy) in [
        ("a-f32.gguf", "a.logits.npy"),
        ("b-f32.gguf", "b.logits.npy"),
    ] {
        let (want, _) = read_npy_f32(&qwen3moe(npy)).unwrap();
        let (got, _, g) = logits(&qwen3moe(model), &toks, 64, true);
        let err = max_abs_diff(&got, &want) / max_abs(&want);
        let s = g.unwrap().stats();
        eprintln!("{model} on the GPU: max |gpu - transformers| / max |ref| = {err:e}; {s:?}");
        assert!(
            s.gpu_jobs > 0 && s.resident_bytes > 0,
            "{model}: nothing ran on the GPU"
        );
        assert!(err < 1e-4, "{model}: relative error {err} >= 1e-4");
        let (one, _, _) = logits(&qwen3moe(model), &toks, 1, true);
        assert!(
            got.iter()
                .zip(&one)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{model}: GPU logits differ between batch 64 and batch 1"
        );
    }
}

/// Q8_0 weights: oracle transformers on the dequantized weights (float32). The CPU rounds
/// activations to Q8_0 and stays within 0.07; the GPU does not round them, so it must stay
/// within that bound too, with the top-1 equal at every position (the fixture's reference
/// margins are >= 0.4).
#[test]
#[ignore = "needs a CUDA device"]
fn qwen3moe_q8_0_on_gpu_matches_transformers() {
    let toks = qwen3moe_tokens();
    for (model, npy) in [
        ("a-q8_0.gguf", "a-q8_0.dequant.logits.npy"),
        ("b-q8_0.gguf", "b-q8_0.dequant.logits.npy"),
    ] {
        let (want, _) = read_npy_f32(&qwen3moe(npy)).unwrap();
        let (got, n_vocab, _) = logits(&qwen3moe(model), &toks, 64, true);
        let (cpu, _, _) = logits(&qwen3moe(model), &toks, 64, false);
        let d_gpu = max_abs_diff(&got, &want);
        let d_cpu = max_abs_diff(&cpu, &want);
        eprintln!("{model}: max |gpu - reference| = {d_gpu}, max |cpu - reference| = {d_cpu}, max |gpu - cpu| = {}", max_abs_diff(&got, &cpu));
        assert!(
            d_gpu <= 0.07,
            "{model}: max |gpu - reference| = {d_gpu} > 0.07"
        );
        for (p, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
            assert_eq!(
                argmax(g),
                argmax(w),
                "{model}: top-1 differs at position {p}"
            );
        }
    }
}

/// Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0, F32 products): GPU against CPU on the
/// prompt and greedy continuation llama.cpp recorded (tests/fixtures/gemma3; with a
/// vocabulary-trimmed copy, the ids below its size). Bound: every
/// position's max |gpu - cpu| within 3% of the CPU's max |logit| (the CPU's Q8 activation
/// rounding is most of it), and the same top-1 wherever the CPU's top-2 margin exceeds 0.25.
#[test]
#[ignore = "needs a CUDA device"]
fn gemma_on_gpu_matches_cpu() {
    let path = match std::env::var_os("SLUICE_GEMMA") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(".cache/sluice/models/gemma-3-270m-q4_k_m.gguf"),
    };
    if !path.exists() {
        assert!(
            std::env::var_os("SLUICE_REQUIRE_MODELS").is_none(),
            "{} does not exist (tools/get-gemma.sh)",
            path.display()
        );
        eprintln!("note: {} not found; skipping Gemma", path.display());
        return;
    }
    let greedy = json(fixtures().join("gemma3/llama_greedy.json"));
    let r = &greedy["results"][0];
    let mut toks = ids(&r["prompt_ids"]);
    toks.extend(ids(&r["generated_ids"]));
    // A vocabulary-trimmed copy (tools/cuda/trim_vocab.py) keeps the ids below its size.
    let n_vocab = Model::load(&path).unwrap().cfg.n_vocab;
    toks.retain(|&t| (t as usize) < n_vocab);
    assert!(
        toks.len() >= 16,
        "only {} of the ids are below {n_vocab}",
        toks.len()
    );
    let (gpu, n_vocab, g) = logits(&path, &toks, 64, true);
    let (cpu, _, _) = logits(&path, &toks, 64, false);
    let s = g.unwrap().stats();
    let (mut worst, mut clear, mut agree) = (0.0f32, 0, 0);
    for (p, (a, b)) in gpu.chunks(n_vocab).zip(cpu.chunks(n_vocab)).enumerate() {
        let d = max_abs_diff(a, b) / max_abs(b);
        worst = worst.max(d);
        assert!(
            d <= 0.03,
            "position {p}: max |gpu - cpu| = {d} of max |logit|"
        );
        if top2_margin(b) > 0.25 {
            clear += 1;
            agree += usize::from(argmax(a) == argmax(b));
        }
    }
    eprintln!(
        "gemma: worst position max |gpu - cpu| / max |cpu| = {worst:e}; top-1 equal at {agree}/{clear} positions with margin > 0.25 ({} positions); {s:?}",
        toks.len()
    );
    assert_eq!(agree, clear, "top-1 differs where the margin is clear");
}
