//! Several sequences forwarding at once through one model and one streaming expert tier
//! at a tiny budget: each one's logits are byte-identical to the same sequence run alone
//! (reads are routed to the sequence that issued them; a unit another sequence is reading
//! is waited for; budget held by other sequences' pins is waited out). Also: a session
//! snapshot restores to the same logits as recomputing the prefix.

mod common;

use std::sync::Arc;

use common::{qwen3moe_fixture as fixture, qwen3moe_tokens as tokens};
use sluice_engine::load::LoadOptions;
use sluice_engine::session::Session;
use sluice_engine::tier::{PolicyKind, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};

/// Sequence `i`: the fixture's tokens rotated by `5 * i` (different routing per sequence).
fn sequence(i: usize) -> Vec<u32> {
    let mut t = tokens();
    let n = t.len();
    t.rotate_left((5 * i) % n);
    t
}

/// Prefill half in chunks of 3, decode the rest; every position's logits.
fn run(m: &Model, toks: &[u32]) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let (prompt, rest) = toks.split_at(toks.len() / 2);
    let mut st = m.new_state(256, false);
    let mut out = Vec::new();
    for c in prompt.chunks(3) {
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

fn streamed(name: &str, backend: Backend, budget_factor: u64) -> (Model, Arc<StreamingExperts>) {
    let path = fixture(name);
    let probe = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&probe.groups.experts, probe.cfg.n_expert_used);
    let (m, s) = common::load_streamed(&path, min * budget_factor, backend);
    // Router lookahead on: speculative reads of one sequence land for another (it reads
    // nothing at the minimum budget, where every slot is the current layer's).
    s.set_lookahead(true);
    (m, s)
}

fn concurrent_equals_alone(name: &str, backend: Backend, budget_factor: u64) {
    const N: usize = 4;
    let alone: Vec<Vec<f32>> = {
        let resident = Model::load(&fixture(name)).unwrap();
        (0..N).map(|i| run(&resident, &sequence(i))).collect()
    };
    let (m, s) = streamed(name, backend, budget_factor);
    let m = Arc::new(m);
    for round in 0..3 {
        let handles: Vec<_> = (0..N)
            .map(|i| {
                let m = m.clone();
                std::thread::spawn(move || run(&m, &sequence(i)))
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let got = h.join().expect("sequence thread panicked");
            assert!(
                got.iter()
                    .zip(&alone[i])
                    .all(|(a, b)| a.to_bits() == b.to_bits())
                    && got.len() == alone[i].len(),
                "{name} {backend:?} x{budget_factor}: sequence {i} (round {round}) differs from running it alone"
            );
        }
    }
    let st = s.cache_stats();
    assert!(
        st.peak_allocated <= st.budget,
        "cache peak {} over budget {}",
        st.peak_allocated,
        st.budget
    );
    assert!(st.total.misses > 0, "the budget should force reads");
}

#[test]
fn four_sequences_at_the_minimum_budget_pread() {
    concurrent_equals_alone("a-q8_0.gguf", Backend::Pread, 1);
}

#[test]
fn four_sequences_at_twice_the_minimum_uring() {
    concurrent_equals_alone("a-q8_0.gguf", Backend::Uring, 2);
}

#[test]
fn four_sequences_f32_model_at_the_minimum_uring() {
    concurrent_equals_alone("b-f32.gguf", Backend::Uring, 1);
}

#[test]
fn snapshot_restore_equals_recompute() {
    let loaded = LoadOptions {
        ple: Default::default(),
        path: fixture("a-q8_0.gguf"),
        threads: 1,
        ctx: 256,
        stream: None,
        record_routing: None,
        sequences: 1,
        device: Default::default(),
        weight_load: Default::default(),
    }
    .load()
    .unwrap();
    let toks = tokens();
    let (prefix, rest) = toks.split_at(10);
    let mut s = Session::new(&loaded, 256, false, 4);
    s.prefill(prefix, Logits::None).unwrap();
    let (snap, hist) = s.snapshot();
    let first = s.prefill(rest, Logits::All).unwrap();
    // Diverge, then come back to the prefix.
    s.step(7).unwrap();
    s.restore(&snap, &hist);
    assert_eq!(s.history(), prefix);
    let again = s.prefill(rest, Logits::All).unwrap();
    assert_eq!(first, again);
    // Prefix reuse keeps what is shared and re-evaluates the rest.
    let reused = s.reuse_prefix(&toks[..12]);
    assert_eq!(reused, 12);
    let mut fresh = Session::new(&loaded, 256, false, 4);
    let want = fresh.prefill(&toks, Logits::All).unwrap();
    assert_eq!(first[..], want[10 * 512..]);
}

/// A synthetic qwen3moe large enough that its matmuls split over the compute threads (the
/// fixture's hidden 64 never does): 2 layers, hidden 512, 32 experts of 512, top-4, Q8_0.
fn synth_model() -> std::path::PathBuf {
    use sluice_synth::Preset;
    let dir = std::env::temp_dir().join(format!("sluice-concurrent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("moe.gguf");
    let shape = sluice_synth::Shape {
        layers: 2,
        hidden: 512,
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        experts: 32,
        top_k: 4,
        expert_ff: 512,
        context: 1024,
        ..Preset::Tiny.shape()
    };
    common::write_synth_q8_0(&path, shape, 0, "concurrent prefills");
    path
}

/// Issue 35 item 1: sessions of one loaded model prefilling long prompts at once at the
/// minimum budget. With one shared rayon pool a worker waiting in a join of sequence A's
/// matmul stole sequence B's whole forward; B then waited for budget that only A (below it
/// on the same stack) could release, and every request hung. Each session's logits must
/// equal the same prompt run alone; a watchdog turns a hang into a failure.
#[test]
fn concurrent_long_prefills_through_sessions_do_not_deadlock() {
    use sluice_engine::load::{Budget, PackChoice, StreamOptions};
    use sluice_engine::tier::SizeSpec;
    use std::sync::mpsc;
    use std::time::Duration;

    const N: usize = 3;
    const LEN: usize = 580;
    const BATCH: usize = 512;
    let path = synth_model();
    // Different prompts (different routing) per sequence.
    let prompt = |i: usize| -> Vec<u32> {
        (0..LEN)
            .map(|j| ((j * 7919 + i * 104_729) % 251) as u32 + 1)
            .collect()
    };
    let options = |stream: Option<StreamOptions>| LoadOptions {
        ple: Default::default(),
        path: path.clone(),
        threads: 2,
        ctx: 1024,
        stream,
        record_routing: None,
        sequences: 3,
        device: Default::default(),
        weight_load: Default::default(),
    };
    let alone: Vec<Vec<f32>> = {
        let loaded = options(None).load().unwrap();
        (0..N)
            .map(|i| {
                let mut s = Session::new(&loaded, 1024, false, BATCH);
                s.prefill(&prompt(i), Logits::Last).unwrap()
            })
            .collect()
    };
    let resident = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&resident.groups.experts, resident.cfg.n_expert_used);
    drop(resident);
    let loaded = options(Some(StreamOptions {
        budget: Budget::Size(SizeSpec::Bytes(min)),
        budget_text: format!("{min}"),
        policy: PolicyKind::Lru,
        resident_layers: 0,
        io: IoConfig {
            backend: Backend::Pread,
            direct: false,
            depth: 4,
            inflight_bytes: 0,
            threads: 2,
            high_priority: false,
        },
        hash_prefetch: true,
        lookahead: false,
        pack: PackChoice::Off,
        preload_profile: None,
    }))
    .load()
    .unwrap();
    let loaded = Arc::new(loaded);
    let (tx, rx) = mpsc::channel();
    for round in 0..3 {
        for i in 0..N {
            let loaded = loaded.clone();
            let tx = tx.clone();
            std::thread::spawn(move || {
                let mut s = Session::new(&loaded, 1024, false, BATCH);
                let got = s.prefill(&prompt(i), Logits::Last);
                let _ = tx.send((i, got));
            });
        }
        for _ in 0..N {
            let (i, got) = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("concurrent prefills through sessions hung (no answer in 120 s)");
            let got = got.unwrap();
            assert!(
                got.len() == alone[i].len()
                    && got
                        .iter()
                        .zip(&alone[i])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "sequence {i} (round {round}) differs from running it alone"
            );
        }
    }
    let st = loaded.streaming.as_ref().unwrap().cache_stats();
    assert!(st.peak_allocated <= st.budget, "cache over its budget");
    let _ = std::fs::remove_dir_all(path.parent().unwrap());
}
