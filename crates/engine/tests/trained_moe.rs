//! The trained MoE (issue 32): a qwen3moe trained on CPython's standard library by
//! tools/train-moe/train.py on the lent GPU and converted by llama.cpp's
//! convert_hf_to_gguf.py (tests/fixtures/trained-moe/, manifest.json says how). Its routers
//! are real, so these tests see real popularity skew and locality.
//!
//! The file is the trained Q8_0 file re-quantized to Q4_0 (tools/train-moe/requantize.py,
//! gguf-py's quantizer). Oracle: transformers in float32 on exactly those Q4_0-rounded
//! weights (tools/train-moe/oracle.py, on the lent GPU) for 128 held-out tokens; sluice never
//! produced these numbers.

mod common;

use common::{argmax, fixture_in, json_ids, load_streamed, logits_all, same_bits};
use sluice_engine::eval::read_npy_f32;
use sluice_engine::tier::StreamingExperts;
use sluice_engine::Model;
use sluice_io::Backend;

const DIR: &str = "trained-moe";
const MODEL: &str = "trained-moe-q4_0.gguf";

fn tokens() -> Vec<u32> {
    json_ids(&fixture_in(DIR, "tokens.json"))
}

/// sluice rounds activations to Q8_0 before each product (as llama.cpp does with Q4_0
/// weights), so its logits differ from the float32 reference by that rounding: about 0.13 at
/// a typical position of this model (largest logit about 18). A trained router has near-ties
/// among its 32 experts, and where the rounding flips one of the top-4 choices a position
/// moves further (up to about 2.2). llama.cpp on the same file deviates from this reference
/// the same way (median 0.127, 90th percentile 0.658, max 2.252, top-1 128 of 128:
/// llama_cpp_check.json; sluice measured 0.132, 0.737, 2.235, 128 of 128), so the bounds are
/// the ones set for the Q8_0 file this replaced (llama.cpp there: 0.173, 1.167, 2.203, 123):
/// the typical position within 2% of the largest logit, nine in ten within 8%, top-1 the same
/// at 90% of the positions and at every position whose reference margin is clear (1.0).
#[test]
fn q4_0_logits_match_transformers_on_the_rounded_weights() {
    let m = Model::load(&fixture_in(DIR, MODEL)).unwrap();
    let toks = tokens();
    let got = logits_all(&m, &toks, 256, true, 64, 0, 2);
    let (want, shape) = read_npy_f32(&fixture_in(DIR, "q4_0.dequant.logits.npy")).unwrap();
    let n_vocab = m.cfg.n_vocab;
    assert_eq!(shape, vec![toks.len(), n_vocab]);
    let scale = want.iter().fold(0.0f32, |a, b| a.max(b.abs()));
    let mut per_pos: Vec<f32> = got
        .chunks(n_vocab)
        .zip(want.chunks(n_vocab))
        .map(|(g, w)| {
            g.iter()
                .zip(w)
                .fold(0.0f32, |a, (x, y)| a.max((x - y).abs()))
        })
        .collect();
    per_pos.sort_by(f32::total_cmp);
    let median = per_pos[per_pos.len() / 2];
    let p90 = per_pos[per_pos.len() * 9 / 10];
    eprintln!(
        "|sluice - reference| per position: median {median}, 90th percentile {p90}, max {} (largest logit {scale})",
        per_pos[per_pos.len() - 1]
    );
    assert!(
        median <= 0.02 * scale,
        "median position differs by {median}"
    );
    assert!(
        p90 <= 0.08 * scale,
        "90th-percentile position differs by {p90}"
    );
    let (mut agree, mut clear) = (0, 0);
    for (p, (g, w)) in got.chunks(n_vocab).zip(want.chunks(n_vocab)).enumerate() {
        let wi = argmax(w);
        let second = w
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != wi)
            .fold(f32::MIN, |a, (_, &v)| a.max(v));
        let gi = argmax(g);
        agree += usize::from(gi == wi);
        if w[wi] - second >= 1.0 {
            clear += 1;
            assert_eq!(gi, wi, "top-1 differs at position {p} with a clear margin");
        }
    }
    eprintln!(
        "top-1 agrees at {agree} of {} positions ({clear} with a margin >= 1)",
        toks.len()
    );
    assert!(
        agree * 100 >= toks.len() * 90,
        "top-1 agrees at only {agree} positions"
    );
}

/// Streamed under a budget far below the experts' size, with real routing: the logits are
/// the resident model's, bit for bit, for both IO backends and thread counts, and the cache
/// never exceeds its budget.
#[test]
fn streamed_below_the_experts_size_equals_resident() {
    let path = fixture_in(DIR, MODEL);
    let toks = tokens();
    let resident = Model::load(&path).unwrap();
    let want = logits_all(&resident, &toks, 256, false, 16, 32, 2);
    let k = resident.cfg.n_expert_used;
    let min = StreamingExperts::min_budget(&resident.groups.experts, k);
    let total = resident.groups.experts.total_bytes();
    for (backend, threads, budget) in [(Backend::Pread, 1, min), (Backend::Uring, 2, total / 4)] {
        assert!(
            budget < total / 2,
            "the budget must be far below the experts' size"
        );
        let (m, s) = load_streamed(&path, budget, backend);
        let got = logits_all(&m, &toks, 256, false, 16, 32, threads);
        assert!(
            same_bits(&got, &want),
            "{backend:?} at {budget} bytes differs from resident"
        );
        let st = s.cache_stats();
        assert!(st.peak_allocated <= st.budget, "cache over its budget");
        assert!(st.total.misses > 0, "the budget should force reads");
    }
}
