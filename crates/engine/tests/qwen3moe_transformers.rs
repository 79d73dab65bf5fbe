//! qwen3moe forward pass against transformers (float32) on tiny random models.
//!
//! Fixtures: tests/fixtures/qwen3moe/, made by tools/fixtures/make_qwen3moe.py (transformers
//! builds the models with fixed seeds, writes them as GGUF with llama.cpp's tensor names,
//! and saves its own float32 logits for tokens.json). sluice never produced these numbers.

mod common;

use common::{qwen3moe_fixture, qwen3moe_tokens as tokens};
use sluice_engine::eval::read_npy_f32;
use sluice_engine::{Logits, Model};

/// sluice's logits for every position, evaluated in prompt chunks of `batch` tokens.
fn sluice_logits(model: &str, batch: usize, threads: usize) -> (Vec<f32>, usize) {
    let m = Model::load(&qwen3moe_fixture(model)).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let toks = tokens();
    // transformers keeps keys and values in float32.
    let mut kv = m.new_state(256, true);
    let mut out = Vec::new();
    for c in toks.chunks(batch) {
        out.extend(pool.install(|| m.forward(&mut kv, c, Logits::All)).unwrap());
    }
    (out, m.cfg.n_vocab)
}

fn reference(npy: &str) -> (Vec<f32>, Vec<usize>) {
    read_npy_f32(&qwen3moe_fixture(npy)).unwrap()
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let max_ref = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let max_diff = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    max_diff / max_ref
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

fn check_f32(model: &str, npy: &str) {
    let (want, shape) = reference(npy);
    for (batch, threads) in [(64, 1), (1, 2), (5, 2)] {
        let (got, n_vocab) = sluice_logits(model, batch, threads);
        assert_eq!(shape[shape.len() - 1], n_vocab);
        let err = rel_err(&got, &want);
        assert!(
            err < 1e-4,
            "{model} batch {batch}: relative error {err} >= 1e-4"
        );
    }
}

/// Q8_0 weights: the oracle is transformers on the same weights dequantized, in float32.
/// sluice (like llama.cpp) also rounds activations to Q8_0 before each product, so logits
/// differ by that rounding: at most 0.07 absolute here (llama.cpp with an F32 KV cache on
/// the same files deviates by the same amount: tests/fixtures/qwen3moe/llama_cpp_check.json).
/// The token sequence was chosen by the fixture script so that every position's reference
/// top-1 margin is at least 0.4 (tokens.json `smallest_top1_margin`), well above that
/// rounding: the top-1 token must agree at every position.
fn check_q8_0_top1(model: &str, npy: &str) {
    let (want, _) = reference(npy);
    let (got, n_vocab) = sluice_logits(model, 64, 2);
    let max_diff = got
        .iter()
        .zip(&want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{model}: max |sluice - reference| = {max_diff}");
    assert!(
        max_diff <= 0.07,
        "{model}: max |sluice - reference| = {max_diff} > 0.07"
    );
    for (p, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
        let (gi, wi) = (argmax(g), argmax(w));
        assert_eq!(
            gi, wi,
            "{model}: top-1 differs at position {p}: reference logits {} (ours) vs {} (reference's top-1)",
            w[gi], w[wi]
        );
    }
}

#[test]
fn model_a_f32_matches_transformers() {
    check_f32("a-f32.gguf", "a.logits.npy");
}

#[test]
fn model_b_f32_matches_transformers() {
    check_f32("b-f32.gguf", "b.logits.npy");
}

#[test]
fn expert_weights_norm_false_matches_transformers_without_renorm() {
    check_f32("a_nonorm-f32.gguf", "a_nonorm.logits.npy");
}

#[test]
fn model_a_q8_0_top1_matches_transformers() {
    check_q8_0_top1("a-q8_0.gguf", "a-q8_0.dequant.logits.npy");
}

#[test]
fn model_b_q8_0_top1_matches_transformers() {
    check_q8_0_top1("b-q8_0.gguf", "b-q8_0.dequant.logits.npy");
}

#[test]
fn nonorm_q8_0_top1_matches_transformers() {
    check_q8_0_top1("a_nonorm-q8_0.gguf", "a_nonorm-q8_0.dequant.logits.npy");
}

/// Logits are a pure function of the model and the tokens: threads and prefill chunking
/// change nothing, bit for bit.
#[test]
fn logits_bit_identical_across_threads_and_chunking() {
    let (a, _) = sluice_logits("a-q8_0.gguf", 64, 1);
    let (b, _) = sluice_logits("a-q8_0.gguf", 3, 2);
    let (c, _) = sluice_logits("a-q8_0.gguf", 1, 2);
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    assert!(a.iter().zip(&c).all(|(x, y)| x.to_bits() == y.to_bits()));
}
