//! The memory plan the expert-cache budget is checked against counts the experts of
//! `--resident-layers` (pinned outside the budget), and load refuses more resident layers
//! than the model has, and thread counts beyond the machine.

mod common;

use common::qwen3moe_fixture;
use sluice_engine::load::{
    max_compute_threads, Budget, LoadOptions, MemoryPlan, PackChoice, StreamOptions,
};
use sluice_engine::tier::PolicyKind;
use sluice_engine::{EngineError, Model};
use sluice_io::{Backend, IoConfig};

#[test]
fn plan_counts_resident_layers() {
    let m = Model::load(&qwen3moe_fixture("a-q8_0.gguf")).unwrap();
    let per_layer: Vec<u64> = m.groups.experts.unit_bytes_per_layer();
    let n_expert = m.cfg.n_expert as u64;
    assert_eq!(per_layer.len(), 2);
    let p0 = MemoryPlan::for_model(&m, 256, 0).unwrap();
    let p1 = MemoryPlan::for_model(&m, 256, 1).unwrap();
    let p2 = MemoryPlan::for_model(&m, 256, 2).unwrap();
    assert_eq!(p0.resident_layers, 0);
    assert_eq!(p1.resident_layers, per_layer[0] * n_expert);
    assert_eq!(p2.resident_layers, (per_layer[0] + per_layer[1]) * n_expert);
    assert_eq!(p2.resident_layers, m.groups.experts.total_bytes());
    // what the cache may take shrinks by exactly the pinned bytes (same MemAvailable read
    // is not guaranteed between calls, so compare through each plan's own numbers)
    for p in [p0, p1, p2] {
        assert_eq!(
            p.available_for_cache,
            p.available
                .saturating_sub(p.resident + p.resident_layers + p.kv)
        );
    }
}

/// `serve --parallel N`: the plan counts N sequences' KV caches and fixed state, each at
/// the context capped at the trained one (before, serve multiplied the context instead,
/// and the cap then hid all but one sequence).
#[test]
fn plan_counts_every_sequence() {
    let m = Model::load(&qwen3moe_fixture("a-q8_0.gguf")).unwrap();
    let c = &m.cfg;
    let one = c.kv_bytes_per_pos * 256 + c.state_bytes;
    assert_eq!(MemoryPlan::for_sequences(&m, 256, 1, 0).unwrap().kv, one);
    assert_eq!(
        MemoryPlan::for_sequences(&m, 256, 4, 0).unwrap().kv,
        4 * one
    );
    let full = c.kv_bytes_per_pos * c.n_ctx_train as u64 + c.state_bytes;
    let p = MemoryPlan::for_sequences(&m, 4 * c.n_ctx_train, 3, 0).unwrap();
    assert_eq!(p.kv, 3 * full);
    assert_eq!(p.sequences, 3);
}

fn opts(resident_layers: usize, threads: usize, io_threads: usize) -> LoadOptions {
    LoadOptions {
        path: qwen3moe_fixture("a-q8_0.gguf"),
        threads,
        ctx: 64,
        stream: Some(StreamOptions {
            budget: "100%".parse::<Budget>().unwrap(),
            budget_text: "100%".into(),
            policy: PolicyKind::default(),
            resident_layers,
            io: IoConfig {
                backend: Backend::Pread,
                direct: false,
                depth: 4,
                inflight_bytes: 0,
                threads: io_threads,
                high_priority: false,
            },
            hash_prefetch: true,
            lookahead: true,
            pack: PackChoice::Off,
            preload_profile: None,
        }),
        record_routing: None,
        ple: Default::default(),
        sequences: 1,
        device: Default::default(),
        weight_load: Default::default(),
    }
}

#[test]
fn load_refuses_too_many_resident_layers_and_threads() {
    let e = opts(3, 1, 2).load().err().expect("3 resident layers of 2");
    assert!(
        matches!(
            e,
            EngineError::Option {
                flag: "--resident-layers",
                ..
            }
        ),
        "{e}"
    );
    let l = opts(2, 1, 2).load().unwrap();
    assert_eq!(
        l.streaming.as_ref().unwrap().resident_read_bytes(),
        l.model.groups.experts.total_bytes()
    );
    let e = opts(0, max_compute_threads() + 1, 2).load().err().unwrap();
    assert!(matches!(e, EngineError::Option { flag: "-t", .. }), "{e}");
    let e = opts(0, 1, 100_000).load().err().unwrap();
    assert!(
        matches!(
            e,
            EngineError::Option {
                flag: "--io-threads",
                ..
            }
        ),
        "{e}"
    );
}
