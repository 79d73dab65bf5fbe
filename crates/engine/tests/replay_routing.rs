//! Routing replay (`sluice bench --replay-routing`, issue 32 item 2): a trace recorded on
//! the trained MoE (real routers) replayed on a random-weight synth of the same routing
//! geometry drives exactly the trace's experts through the streaming tier, under its
//! budget; a trace of another geometry is refused.
//!
//! Oracles independent of the replay code: the routing recorder of the replayed run (which
//! records what the MoE block ran) and the expert cache's lookup counters (what the
//! streaming tier was asked for), both compared with the trace as the reader parses it.

mod common;

use std::collections::BTreeSet;
use std::path::PathBuf;

use common::{fixture_in, json_ids, load_streamed};
use sluice_engine::tier::{RoutingTrace, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::Backend;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A random-weight qwen3moe with `experts` experts per layer, otherwise the trained MoE's
/// routing geometry (8 layers, all routed, top-4) at a smaller hidden size.
fn synth(experts: usize) -> PathBuf {
    use sluice_synth::Preset;
    let path = scratch(&format!("synth-{experts}.gguf"));
    let shape = sluice_synth::Shape {
        layers: 8,
        hidden: 64,
        heads: 2,
        kv_heads: 1,
        head_dim: 32,
        experts,
        top_k: 4,
        expert_ff: 64,
        context: 512,
        ..Preset::Tiny.shape()
    };
    common::write_synth_q8_0(&path, shape, 7, "replay target");
    path
}

/// Prefill `toks[..split]` in chunks of `chunk`, then decode the rest one at a time.
fn run(m: &Model, toks: &[u32], split: usize, chunk: usize) {
    let mut st = m.new_state(512, false);
    for c in toks[..split].chunks(chunk) {
        m.forward(&mut st, c, Logits::Last).unwrap();
    }
    for &t in &toks[split..] {
        m.forward(&mut st, &[t], Logits::Last).unwrap();
    }
}

/// The trained MoE's routing of its 128 held-out tokens (prefill in chunks of 32, then 32
/// decode steps), as `--record-routing` writes it.
fn real_trace(name: &str) -> PathBuf {
    let path = scratch(name);
    let mut m = Model::load(&fixture_in("trained-moe", "trained-moe-q4_0.gguf")).unwrap();
    m.record_routing(&path).unwrap();
    let toks = json_ids(&fixture_in("trained-moe", "tokens.json"));
    run(&m, &toks, 96, 32);
    m.finish_routing().unwrap();
    path
}

fn ids(trace: &RoutingTrace) -> Vec<Vec<u16>> {
    (0..trace.n_tokens())
        .map(|t| trace.token(t).to_vec())
        .collect()
}

#[test]
fn replay_drives_exactly_the_traced_experts_under_the_budget() {
    let trace_path = real_trace("real-a.slrt");
    let trace = RoutingTrace::read(&trace_path).unwrap();
    let n = trace.n_tokens();
    assert_eq!(n, 128);
    let synth = synth(32);

    // Without replay the synth's random router picks other experts (so the check below
    // cannot pass by accident).
    let own = scratch("own.slrt");
    let mut m = Model::load(&synth).unwrap();
    m.record_routing(&own).unwrap();
    // Any token ids: the synth's vocabulary differs from the trained model's.
    let toks: Vec<u32> = (0..n as u32 + 40).map(|i| (i * 37) % 200 + 1).collect();
    run(&m, &toks[..n], 100, 16);
    m.finish_routing().unwrap();
    assert_ne!(ids(&RoutingTrace::read(&own).unwrap()), ids(&trace));

    // Replayed, streamed at 3x the minimum budget, another chunking, 40 tokens past the
    // trace's end (it wraps to its start).
    let probe = Model::load(&synth).unwrap();
    let k = probe.cfg.n_expert_used;
    let budget = 3 * StreamingExperts::min_budget(&probe.groups.experts, k);
    let total = probe.groups.experts.total_bytes();
    assert!(budget < total / 2, "the budget must force evictions");
    drop(probe);
    let (mut m, s) = load_streamed(&synth, budget, Backend::Pread);
    let r = m.replay_routing(trace.clone(), &trace_path).unwrap();
    assert_eq!(r.trace().n_tokens(), n);
    let replayed = scratch("replayed.slrt");
    m.record_routing(&replayed).unwrap();
    let split = 75;
    run(&m, &toks, split, 25);
    m.finish_routing().unwrap();
    assert_eq!(
        m.routing_replay().unwrap().tokens_replayed(),
        toks.len() as u64
    );

    let got = ids(&RoutingTrace::read(&replayed).unwrap());
    let want: Vec<Vec<u16>> = (0..toks.len())
        .map(|t| trace.token(t % n).to_vec())
        .collect();
    assert_eq!(
        got, want,
        "the replayed run's recorded routing is not the trace's"
    );

    // What the streaming tier was asked for: per batch and layer, each distinct unit of
    // the batch's tokens once.
    let mut batches: Vec<std::ops::Range<usize>> = (0..split)
        .step_by(25)
        .map(|a| a..(a + 25).min(split))
        .collect();
    batches.extend((split..toks.len()).map(|t| t..t + 1));
    let moe = trace.header.moe_layers();
    let mut lookups = vec![0u64; moe.len()];
    for b in &batches {
        for (li, n_look) in lookups.iter_mut().enumerate() {
            let set: BTreeSet<u16> = b
                .clone()
                .flat_map(|t| want[t][li * k..(li + 1) * k].to_vec())
                .collect();
            *n_look += set.len() as u64;
        }
    }
    let cs = s.cache_stats();
    for (li, &l) in moe.iter().enumerate() {
        let st = &cs.per_layer[l as usize];
        assert_eq!(
            st.hits + st.misses,
            lookups[li],
            "layer {l}: the cache was asked for other units than the trace's"
        );
    }
    assert!(cs.total.misses > 0);
    assert!(
        cs.peak_allocated <= cs.budget && cs.budget == budget,
        "cache peak {} over budget {}",
        cs.peak_allocated,
        cs.budget
    );
}

#[test]
fn replay_refuses_a_trace_of_another_geometry() {
    let trace_path = real_trace("real-b.slrt");
    let mut m = Model::load(&synth(16)).unwrap();
    let trace = RoutingTrace::read(&trace_path).unwrap();
    let err = m
        .replay_routing(trace, &trace_path)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&*trace_path.to_string_lossy())
            && err.contains("32 experts")
            && err.contains("16 experts"),
        "{err}"
    );
    assert!(m.routing_replay().is_none());
}
