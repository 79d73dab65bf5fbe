//! Logits are identical, bit for bit, whether routed experts are resident or streamed
//! through the byte-budgeted cache, for every IO backend, O_DIRECT on and off, budgets
//! from the minimum (constant eviction) to everything, resident layers, 1 or 2 threads,
//! and router lookahead on and off (speculative reads only move bytes).
//! And the cache never holds more than its budget. Models: the qwen3moe fixtures and a
//! glm5next (GLM-5.3-Flash) fixture (dense leading layer, KDA state, f16 latent rows).

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{qwen3moe_fixture as fixture, qwen3moe_tokens as tokens, same_bits};
use sluice_engine::tier::PolicyKind;
use sluice_engine::tier::{StreamConfig, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};

/// Prefill in chunks of `batch`, then decode the rest one token at a time; every position's logits.
fn logits(m: &Model, threads: usize, batch: usize) -> Vec<f32> {
    logits_of(m, threads, batch, &tokens())
}

fn logits_of(m: &Model, threads: usize, batch: usize, toks: &[u32]) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let (prompt, rest) = toks.split_at(toks.len() / 2);
    let mut kv = m.new_state(256, false);
    let mut out = Vec::new();
    for c in prompt.chunks(batch) {
        out.extend(pool.install(|| m.forward(&mut kv, c, Logits::All)).unwrap());
    }
    for &t in rest {
        out.extend(
            pool.install(|| m.forward(&mut kv, &[t], Logits::All))
                .unwrap(),
        );
    }
    out
}

/// A model streaming through `cfg`, router lookahead on or off, and a handle on its source.
fn streamed_la(path: &Path, cfg: &StreamConfig, lookahead: bool) -> (Model, Arc<StreamingExperts>) {
    let mut m = Model::load(path).unwrap();
    let s = StreamingExperts::open(path, &m.groups.experts, m.cfg.n_expert_used, cfg).unwrap();
    s.set_lookahead(lookahead);
    let s = Arc::new(s);
    m.set_expert_source(Box::new(s.clone()));
    (m, s)
}

/// A streaming configuration; `high_priority` stays off in tests, `threads` at 2.
fn stream_cfg(
    budget: u64,
    policy: PolicyKind,
    resident_layers: usize,
    backend: Backend,
    direct: bool,
    depth: usize,
) -> StreamConfig {
    StreamConfig {
        budget,
        policy,
        resident_layers,
        io: IoConfig {
            backend,
            direct,
            depth,
            inflight_bytes: 0,
            threads: 2,
            high_priority: false,
        },
    }
}

fn check_model(name: &str) {
    check_model_at(&fixture(name), &tokens());
}

fn check_model_at(path: &Path, toks: &[u32]) {
    let name = path.display();
    let resident = Model::load(path).unwrap();
    let want = logits_of(&resident, 1, 64, toks);
    let k = resident.cfg.n_expert_used;
    let min = StreamingExperts::min_budget(&resident.groups.experts, k);
    let all = resident.groups.experts.total_bytes() * 2;
    let backends = [Backend::Uring, Backend::Pread, Backend::Mmap];
    let mut runs = 0;
    let (mut la_runs, mut la_predicted, mut la_issued) = (0, 0, 0);
    for backend in backends {
        for direct in [true, false] {
            if backend == Backend::Mmap && direct {
                continue; // mmap never uses O_DIRECT
            }
            for (budget, resident_layers) in [(min, 0), (min + min / 2, 0), (all, 0), (min, 1)] {
                for (threads, batch, depth) in [(1, 64, 1), (2, 3, 32)] {
                    for policy in [
                        PolicyKind::Lru,
                        PolicyKind::Lfu { half_life: 4 },
                        PolicyKind::default(),
                    ] {
                        // Router lookahead on in every other run (each configuration is
                        // covered both ways across the two policies of a pair).
                        let lookahead = runs % 2 == 1;
                        let mut cfg =
                            stream_cfg(budget, policy, resident_layers, backend, direct, depth);
                        // Every third run caps io_uring's bytes in flight (one small read
                        // at a time for these tiny experts).
                        if runs % 3 == 2 {
                            cfg.io.inflight_bytes = 4096;
                        }
                        let (m, s) = streamed_la(path, &cfg, lookahead);
                        let got = logits_of(&m, threads, batch, toks);
                        assert!(
                            same_bits(&got, &want),
                            "{name}: logits differ with {backend:?} direct={direct} budget={budget} resident_layers={resident_layers} threads={threads} batch={batch} policy={policy:?} lookahead={lookahead} inflight_bytes={}",
                            cfg.io.inflight_bytes
                        );
                        let ss = s.stream_stats();
                        if lookahead {
                            la_runs += 1;
                            la_predicted += ss.la_predicted;
                            la_issued += ss.la_issued;
                            assert!(ss.la_hit <= ss.la_issued && ss.la_correct <= ss.la_actual);
                        } else {
                            assert_eq!(ss.la_predicted + ss.la_issued, 0, "{name}: lookahead off");
                        }
                        runs += 1;
                    }
                }
            }
        }
    }
    assert!(runs >= 40);
    // Lookahead must have predicted and read something (else the runs above prove nothing).
    assert!(
        la_runs >= 20 && la_predicted > 0 && la_issued > 0,
        "{name}: lookahead idle ({la_runs} runs, {la_predicted} predicted, {la_issued} read)"
    );
}

#[test]
fn streaming_logits_bit_identical_model_a() {
    check_model("a-q8_0.gguf");
}

#[test]
fn streaming_logits_bit_identical_model_b_f32() {
    check_model("b-f32.gguf");
}

fn glm5next_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/glm5next")
        .join(name)
}

/// GLM-5.3-Flash (glm5next): KDA layers, pooled-DSA layers, a shared indexer layer, a
/// dense leading layer (no expert group), the long prompt of its oracle fixtures.
#[test]
fn streaming_logits_bit_identical_glm5next() {
    let toks = common::ids(&common::manifest_in("glm5next")["prompts"]["long"]);
    check_model_at(&glm5next_fixture("c-f32.gguf"), &toks);
}

/// At the minimum budget the cache must evict constantly, never exceed the budget, and
/// the bytes read must reconcile with the misses.
#[test]
fn minimum_budget_evicts_and_never_exceeds_budget() {
    let path = fixture("a-q8_0.gguf");
    let probe = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&probe.groups.experts, probe.cfg.n_expert_used);
    let cfg = stream_cfg(min, PolicyKind::Lru, 0, Backend::Pread, true, 8);
    let mut m = Model::load(&path).unwrap();
    let s = StreamingExperts::open(&path, &m.groups.experts, m.cfg.n_expert_used, &cfg).unwrap();
    let s = std::sync::Arc::new(s);
    m.set_expert_source(Box::new(s.clone()));
    let _ = logits(&m, 2, 4);
    let cs = s.cache_stats();
    assert!(cs.total.evictions > 0, "a minimum budget must evict");
    assert!(
        cs.peak_allocated <= min,
        "peak {} > budget {min}",
        cs.peak_allocated
    );
    assert!(cs.peak_bytes <= min);
    let io = s.io_stats();
    // Every miss is one read of gate+up+down: bytes requested == misses x expert bytes.
    let expert_bytes: u64 = {
        let sizes = m.groups.experts.total_bytes();
        sizes / (m.cfg.n_layer as u64 * m.cfg.n_expert as u64)
    };
    assert_eq!(io.bytes_requested, cs.total.misses * expert_bytes);
    assert!(io.bytes_read >= io.bytes_requested);
}

#[test]
fn budget_below_minimum_is_a_clear_error() {
    let path = fixture("a-q8_0.gguf");
    let m = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&m.groups.experts, m.cfg.n_expert_used);
    let cfg = StreamConfig {
        budget: min - 1,
        policy: PolicyKind::Lru,
        resident_layers: 0,
        io: IoConfig::default(),
    };
    let err = StreamingExperts::open(&path, &m.groups.experts, m.cfg.n_expert_used, &cfg)
        .err()
        .expect("a budget below the minimum must be refused")
        .to_string();
    assert!(
        err.contains(&min.to_string()),
        "error must name the minimum {min}: {err}"
    );
}

/// Regression: an error raised while a layer's reads are in flight must not leave stale
/// completions behind for the next layer (which would panic or pair the wrong bytes).
#[test]
fn error_mid_layer_leaves_no_reads_behind() {
    use sluice_engine::models::expert::ResidentExperts;
    use sluice_engine::tier::ExpertSource;
    let path = fixture("a-q8_0.gguf");
    let m = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&m.groups.experts, m.cfg.n_expert_used);
    let cfg = stream_cfg(min * 4, PolicyKind::Lru, 0, Backend::Pread, true, 8);
    let s = StreamingExperts::open(&path, &m.groups.experts, m.cfg.n_expert_used, &cfg).unwrap();
    let experts: Vec<usize> = (0..m.cfg.n_expert).collect();
    let err = s.for_each_expert(m.map.bytes(), 0, &experts, &mut |_, _| {
        Err(sluice_engine::tier::Stop)
    });
    assert!(err.is_err());
    // Every expert of both layers still comes back with the right bytes.
    for layer in 0..m.cfg.n_layer {
        let mut want = Vec::new();
        ResidentExperts::new(m.groups.experts.clone())
            .for_each_expert(m.map.bytes(), layer, &experts, &mut |i, v| {
                want.push((
                    i,
                    v.part(0).to_vec(),
                    v.part(1).to_vec(),
                    v.part(2).to_vec(),
                ));
                Ok(())
            })
            .unwrap();
        let mut got = Vec::new();
        s.for_each_expert(m.map.bytes(), layer, &experts, &mut |i, v| {
            got.push((
                i,
                v.part(0).to_vec(),
                v.part(1).to_vec(),
                v.part(2).to_vec(),
            ));
            Ok(())
        })
        .unwrap();
        got.sort_by_key(|g| g.0);
        assert_eq!(got, want, "layer {layer}");
    }
}

/// Slot memory is made ready in the background at load: once the filler is done the
/// budget is allocated as free slots (never more), before any read.
#[test]
fn slots_are_populated_in_the_background_within_the_budget() {
    let path = fixture("a-q8_0.gguf");
    let m = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&m.groups.experts, m.cfg.n_expert_used);
    let budget = 3 * min + min / 3;
    let cfg = stream_cfg(budget, PolicyKind::default(), 0, Backend::Pread, false, 4);
    let s = StreamingExperts::open(&path, &m.groups.experts, m.cfg.n_expert_used, &cfg).unwrap();
    s.wait_slots_ready();
    let cs = s.cache_stats();
    let slot = min / m.cfg.n_expert_used as u64;
    assert!(
        cs.bytes_allocated <= budget,
        "{} > {budget}",
        cs.bytes_allocated
    );
    assert!(
        cs.bytes_allocated + slot > budget,
        "only {} of {budget} allocated (slot {slot})",
        cs.bytes_allocated
    );
    assert_eq!(cs.total.requests(), 0);
    assert_eq!(cs.bytes_cached, 0);
}

/// A merged `ffn_gate_up_exps` file (tools/fixtures/make_merged_gate_up.py, from a-q8_0.gguf):
/// gate and up are halves of one tensor, so their unit parts are strided slices. Streaming
/// equals resident, and both equal the separate-tensor file bit for bit.
#[test]
fn streaming_logits_bit_identical_merged_gate_up() {
    check_model("a-q8_0-gate_up.gguf");
    let merged = Model::load(&fixture("a-q8_0-gate_up.gguf")).unwrap();
    let separate = Model::load(&fixture("a-q8_0.gguf")).unwrap();
    assert!(same_bits(
        &logits_of(&merged, 2, 5, &tokens()),
        &logits_of(&separate, 2, 5, &tokens())
    ));
}
