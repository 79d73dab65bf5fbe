//! The tiny qwen3moe fixtures (tests/fixtures/qwen3moe, made by
//! tools/fixtures/make_qwen3moe.py) and small comparison helpers, shared by the engine's
//! integration tests.

use std::path::{Path, PathBuf};

/// Path of a file in the qwen3moe fixture directory.
pub fn qwen3moe_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3moe")
        .join(name)
}

/// The fixture's token ids (tokens.json).
#[allow(dead_code)]
pub fn qwen3moe_tokens() -> Vec<u32> {
    let text = std::fs::read_to_string(qwen3moe_fixture("tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Whether two logit vectors are equal bit for bit.
#[allow(dead_code)]
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Router lookahead only moves bytes: `run` (the caller's token-by-token forward of the
/// model at `path`, where lookahead predicts) streamed with lookahead on gives `want` (the
/// resident logits) bit for bit, at a budget that evicts (3x the minimum) and at one that
/// holds every expert; off, nothing is predicted. Every byte read is a miss, a certain
/// prefetch or a lookahead read. Returns the lookahead reads issued (callers assert > 0).
#[allow(dead_code)]
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
