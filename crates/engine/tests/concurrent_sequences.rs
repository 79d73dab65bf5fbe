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
use sluice_engine::tier::{PolicyKind, StreamConfig, StreamingExperts};
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
    let mut m = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&m.groups.experts, m.cfg.n_expert_used);
    let cfg = StreamConfig {
        budget: min * budget_factor,
        policy: PolicyKind::Lru,
        resident_layers: 0,
        io: IoConfig {
            backend,
            direct: true,
            depth: 4,
            inflight_bytes: 0,
            threads: 2,
            high_priority: false,
        },
    };
    let s = StreamingExperts::open(&path, &m.groups.experts, m.cfg.n_expert_used, &cfg).unwrap();
    // Router lookahead on: speculative reads of one sequence land for another (it reads
    // nothing at the minimum budget, where every slot is the current layer's).
    s.set_lookahead(true);
    let s = Arc::new(s);
    m.set_expert_source(Box::new(s.clone()));
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
