//! Routing traces (round trip, hostile files) and the cache simulator (Belady against a
//! brute-force optimum and against every policy).

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use proptest::prelude::*;
use sluice_tier::sim::{
    requests, simulate_belady, simulate_kind, simulate_oracle_rate, simulate_preloaded,
};
use sluice_tier::{CacheError, PolicyKind, RoutingRecorder, RoutingTrace, TraceError, TraceHeader};
use sluice_tier::{ExpertKey, NextUse, Policy, Profile};

fn header(n_layer: u32, n_expert: u32, top_k: u32, bytes: u64) -> TraceHeader {
    TraceHeader {
        model: "tiny-moe".into(),
        n_layer,
        n_expert,
        top_k,
        expert_bytes: vec![bytes; n_layer as usize],
    }
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-trace-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn recorder_round_trip_with_batches_and_dense_layer() {
    let dir = tmpdir("rt");
    let path = dir.join("t.slrt");
    let mut h = header(3, 4, 2, 100);
    h.expert_bytes[0] = 0; // dense first layer: not recorded
    let mut rec = RoutingRecorder::create(&path, h.clone()).unwrap();
    // A prefill batch of 2 tokens, layers recorded in reverse order.
    rec.begin_batch(2).unwrap();
    rec.record_layer(2, &[3, 0, 1, 2]).unwrap();
    rec.record_layer(1, &[0, 1, 2, 3]).unwrap();
    rec.end_batch().unwrap();
    rec.record_token(&[&[1, 3], &[2, 0]]).unwrap();
    assert!(!path.exists(), "only the .tmp name exists before finish");
    assert_eq!(rec.finish().unwrap(), path);
    let t = RoutingTrace::read(&path).unwrap();
    assert_eq!(t.header, h);
    assert_eq!(t.batches, [2, 1]);
    assert_eq!(t.n_tokens(), 3);
    // Token-major, layer 1 then layer 2.
    assert_eq!(t.token(0), [0, 1, 3, 0]);
    assert_eq!(t.token(1), [2, 3, 1, 2]);
    assert_eq!(t.token(2), [1, 3, 2, 0]);
    assert_eq!(RoutingTrace::parse(&t.to_bytes(), &path).unwrap(), t);
    assert_eq!(std::fs::read(&path).unwrap(), t.to_bytes());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn recorder_rejects_misuse() {
    let dir = tmpdir("misuse");
    let path = dir.join("t.slrt");
    let mut rec = RoutingRecorder::create(&path, header(2, 4, 2, 10)).unwrap();
    assert!(rec.record_layer(0, &[0, 1]).is_err(), "outside a batch");
    rec.begin_batch(1).unwrap();
    assert!(rec.record_layer(0, &[0, 4]).is_err(), "expert out of range");
    assert!(rec.record_layer(0, &[2, 2]).is_err(), "repeated expert");
    assert!(rec.record_layer(0, &[1]).is_err(), "wrong count");
    assert!(rec.record_layer(5, &[0, 1]).is_err(), "no such layer");
    rec.record_layer(0, &[0, 1]).unwrap();
    assert!(rec.record_layer(0, &[0, 1]).is_err(), "twice");
    assert!(rec.end_batch().is_err(), "layer 1 missing");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn valid_bytes() -> Vec<u8> {
    let h = header(2, 4, 2, 100);
    RoutingTrace::from_tokens(h, &[vec![0, 1, 2, 3], vec![3, 2, 1, 0]])
        .unwrap()
        .to_bytes()
}

fn parse(b: &[u8]) -> Result<RoutingTrace, TraceError> {
    RoutingTrace::parse(b, Path::new("hostile.slrt"))
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn hostile_traces_give_clear_errors() {
    let good = valid_bytes();
    // Layout (module doc): fixed header 40 bytes, name "tiny-moe" 8, 2 x u64 sizes = 64;
    // then batches of 4 (count) + 2 layers x 2 ids x 2 bytes = 12 bytes.
    assert_eq!(good.len(), 40 + 8 + 16 + 2 * 12);
    assert!(parse(&good).is_ok());

    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(parse(&b), Err(TraceError::BadMagic { .. })));
    let mut b = good.clone();
    put_u32(&mut b, 4, 2);
    let e = parse(&b).unwrap_err();
    assert!(
        matches!(
            e,
            TraceError::Version {
                found: 2,
                supported: 1,
                ..
            }
        ),
        "{e}"
    );
    for (at, v, what) in [
        (8, 0, "n_layer"),
        (8, 1 << 30, "n_layer"),
        (12, 0, "n_expert"),
        (16, 5, "top_k"),
        (20, 1 << 31, "name"),
    ] {
        let mut b = good.clone();
        put_u32(&mut b, at, v);
        let e = parse(&b).unwrap_err();
        assert!(
            matches!(e, TraceError::Header { .. } | TraceError::Truncated { .. }),
            "{what}: {e}"
        );
    }
    // Expert id 9 >= n_expert 4 in token 1, layer 0.
    let mut b = good.clone();
    b[64 + 12 + 4] = 9;
    let e = parse(&b).unwrap_err();
    assert!(
        matches!(
            e,
            TraceError::BadExpert {
                token: 1,
                layer: 0,
                expert: 9,
                n_expert: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("hostile.slrt"));
    // Token 0 layer 1 = [2, 2].
    let mut b = good.clone();
    b[64 + 4 + 6] = 2;
    assert!(matches!(
        parse(&b),
        Err(TraceError::DuplicateExpert {
            token: 0,
            layer: 1,
            expert: 2,
            ..
        })
    ));
    let mut b = good.clone();
    b.extend_from_slice(&[0, 0]);
    assert!(matches!(
        parse(&b),
        Err(TraceError::TrailingBytes { extra: 2, .. })
    ));
    let mut b = good.clone();
    b[24] = 5; // n_tokens
    assert!(matches!(
        parse(&b),
        Err(TraceError::Count {
            what: "tokens",
            header: 5,
            found: 2,
            ..
        })
    ));
    let mut b = good.clone();
    b[32] = 3; // n_batches
    assert!(matches!(
        parse(&b),
        Err(TraceError::Count {
            what: "batches",
            ..
        })
    ));
    let mut b = good.clone();
    put_u32(&mut b, 64, 0); // batch of 0 tokens
    assert!(parse(&b).is_err());
    // Every proper prefix is an error (truncation), never a panic.
    for n in 0..good.len() {
        assert!(parse(&good[..n]).is_err(), "prefix of {n} bytes accepted");
    }
    // A batch claiming 2^32-1 tokens must not allocate for them.
    let mut b = good.clone();
    put_u32(&mut b, 64, u32::MAX);
    assert!(matches!(parse(&b), Err(TraceError::Truncated { .. })));
}

proptest! {
    /// Random byte edits never panic the reader.
    #[test]
    fn mutated_traces_never_panic(edits in prop::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut b = valid_bytes();
        for (i, v) in edits {
            let n = b.len();
            b[i % n] = v;
        }
        let _ = parse(&b);
    }
}

/// (request index, sorted cache contents) -> fewest misses from there on.
type Memo = HashMap<(usize, Vec<(u32, u32)>), u64>;

/// Brute-force optimum: minimum misses over every eviction choice, with the same rules as
/// the simulator (demand fetch; evict only when full; a layer's experts already requested
/// stay pinned until the layer ends). `cap` = slots (one size class).
fn brute_force(reqs: &[(u32, u32)], k: usize, cap: usize) -> u64 {
    fn go(
        i: usize,
        cache: BTreeSet<(u32, u32)>,
        reqs: &[(u32, u32)],
        k: usize,
        cap: usize,
        memo: &mut Memo,
    ) -> u64 {
        if i == reqs.len() {
            return 0;
        }
        let mkey = (i, cache.iter().copied().collect::<Vec<_>>());
        if let Some(&m) = memo.get(&mkey) {
            return m;
        }
        let r = reqs[i];
        let pinned = &reqs[i - i % k..i]; // earlier experts of this layer
        let best = if cache.contains(&r) {
            go(i + 1, cache, reqs, k, cap, memo)
        } else if cache.len() < cap {
            let mut c = cache.clone();
            c.insert(r);
            1 + go(i + 1, c, reqs, k, cap, memo)
        } else {
            cache
                .iter()
                .filter(|v| !pinned.contains(v))
                .map(|v| {
                    let mut c = cache.clone();
                    c.remove(v);
                    c.insert(r);
                    1 + go(i + 1, c, reqs, k, cap, memo)
                })
                .min()
                .expect("cap >= k leaves a victim")
        };
        memo.insert(mkey, best);
        best
    }
    go(0, BTreeSet::new(), reqs, k, cap, &mut HashMap::new())
}

/// Random trace: `n_tok` tokens, each layer picks `k` distinct experts (skewed toward low ids).
fn trace_strategy(
    n_layer: u32,
    n_expert: u32,
    k: u32,
    max_tok: usize,
) -> impl Strategy<Value = RoutingTrace> {
    let tok = prop::collection::vec(
        Just((0..n_expert).collect::<Vec<u32>>()).prop_shuffle(),
        n_layer as usize,
    );
    prop::collection::vec((tok, any::<bool>()), 1..max_tok).prop_map(move |toks| {
        let tokens: Vec<Vec<u16>> = toks
            .into_iter()
            .map(|(layers, skew)| {
                layers
                    .into_iter()
                    .flat_map(|mut perm| {
                        if skew {
                            perm.sort(); // this token picks the "hot" lowest ids
                        }
                        perm.into_iter().take(k as usize).map(|e| e as u16)
                    })
                    .collect()
            })
            .collect();
        RoutingTrace::from_tokens(header(n_layer, n_expert, k, 1000), &tokens).unwrap()
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Belady equals the brute-force optimum on tiny traces.
    #[test]
    fn belady_is_optimal_on_tiny_traces(t in trace_strategy(2, 5, 2, 7), slots in 2u64..5) {
        let k = t.header.top_k as usize;
        let reqs: Vec<(u32, u32)> = requests(&t).iter().map(|x| (x.layer, x.expert)).collect();
        let opt = brute_force(&reqs, k, slots as usize);
        let b = simulate_belady(&t, slots * 1000).unwrap();
        prop_assert_eq!(b.misses, opt);
        prop_assert_eq!(b.bytes_read, opt * 1000);
    }

    /// No policy misses less than Belady; budgets are respected.
    #[test]
    fn belady_beats_every_policy(t in trace_strategy(3, 8, 2, 40), slots in 2u64..12) {
        let budget = slots * 1000;
        let b = simulate_belady(&t, budget).unwrap();
        for kind in [PolicyKind::Lru, PolicyKind::Lfu { half_life: 4 }, PolicyKind::Lfu { half_life: 16 }, PolicyKind::Lru2, PolicyKind::NextUse { half_life: 2 }, PolicyKind::default()] {
            let r = simulate_kind(&t, budget, kind).unwrap();
            prop_assert!(b.misses <= r.misses, "{}: {} < belady {}", r.policy, r.misses, b.misses);
            prop_assert_eq!(r.requests, b.requests);
            prop_assert!(r.peak_bytes <= budget);
            prop_assert!(r.slot_allocations <= slots);
        }
    }
}

#[test]
fn simulator_counts_on_a_hand_trace() {
    // 1 layer, 3 experts, top-1, 2 slots of 1000 bytes. Requests 0 1 2 0 1 2.
    // LRU: all 6 miss (each request evicts the one needed next).
    // Belady: 0 m, 1 m, 2 m evicts 1 (0 is next at t3, 1 at t4) -> [0 2]; 0 hit;
    // 1 m evicts 0 (never used again; 2 next at t5) -> [2 1]; 2 hit. 4 misses.
    let h = header(1, 3, 1, 1000);
    let toks: Vec<Vec<u16>> = [0, 1, 2, 0, 1, 2].iter().map(|&e| vec![e]).collect();
    let t = RoutingTrace::from_tokens(h, &toks).unwrap();
    let lru = simulate_kind(&t, 2000, PolicyKind::Lru).unwrap();
    let bel = simulate_belady(&t, 2000).unwrap();
    assert_eq!((lru.misses, lru.hits, lru.bytes_read), (6, 0, 6000));
    assert_eq!((bel.misses, bel.hits, bel.bytes_read), (4, 2, 4000));
    // Below top_k x expert bytes is refused up front.
    assert!(matches!(
        simulate_kind(&t, 999, PolicyKind::Lru),
        Err(CacheError::BudgetBelowMinimum { min: 1000, .. })
    ));
    let report = sluice_tier::sim::format_report(&t, 2000, &[lru], Some(&bel));
    assert!(
        report.contains("lru") && report.contains("belady") && report.contains("+2 (x1.50)"),
        "{report}"
    );
}

#[test]
fn next_use_keeps_the_frequent_expert() {
    // 1 layer, 3 experts, top-1, 2 slots. Requests 0 0 0 0 1 2 0.
    // LRU: at 2 the cache is [0 1], 0 is older: evicted, so the last 0 misses (4 misses).
    // next: 0 was selected 4 times, 1 once: 1 goes, the last 0 hits (3 misses).
    let h = header(1, 3, 1, 1000);
    let toks: Vec<Vec<u16>> = [0, 0, 0, 0, 1, 2, 0].iter().map(|&e| vec![e]).collect();
    let t = RoutingTrace::from_tokens(h, &toks).unwrap();
    assert_eq!(simulate_kind(&t, 2000, PolicyKind::Lru).unwrap().misses, 4);
    assert_eq!(
        simulate_kind(&t, 2000, PolicyKind::default())
            .unwrap()
            .misses,
        3
    );
    assert_eq!(simulate_oracle_rate(&t, 2000).unwrap().misses, 3);
}

#[test]
fn next_use_evicts_the_layer_visited_farthest_ahead() {
    // Two layers, one cached expert each, equal rates. The layer just requested (0) is
    // visited again only after layer 1, so its expert goes although it is the more recent.
    let mut p = NextUse::new(64);
    let (a, b) = (ExpertKey::new(1, 0), ExpertKey::new(0, 0));
    p.on_request(a);
    p.on_insert(a);
    p.on_request(b);
    p.on_insert(b);
    assert_eq!(p.victim(&mut |_| true), Some(b));
    // Unless it is not evictable.
    assert_eq!(p.victim(&mut |k| k != b), Some(a));
    // A rarely selected expert of the next layer goes before a frequent one of this layer.
    let mut p = NextUse::new(64);
    for _ in 0..4 {
        p.on_request(b);
        p.on_request(a);
        p.on_token_end();
    }
    let c = ExpertKey::new(1, 1);
    p.on_request(b);
    p.on_insert(b);
    p.on_request(c);
    p.on_insert(c);
    p.on_request(b);
    assert_eq!(p.victim(&mut |_| true), Some(c));
}

#[test]
fn preloaded_profile_warms_the_cache() {
    // 2 layers, 4 experts, top-1; the trace uses experts 0 and 1 of each layer.
    let h = header(2, 4, 1, 1000);
    let toks: Vec<Vec<u16>> = (0..20)
        .map(|t| vec![(t % 2) as u16, (t % 2) as u16])
        .collect();
    let t = RoutingTrace::from_tokens(h, &toks).unwrap();
    let prof = Profile::from_trace(&t, None);
    assert_eq!(prof.rates.len(), 4);
    assert!(prof.rates.iter().all(|r| (r.1 - 0.5).abs() < 1e-12));
    // Room for all 4 used experts: cold, the 4 first requests miss; warm, none does.
    let cold = simulate_preloaded(&t, 4000, PolicyKind::default().build(), None).unwrap();
    let warm = simulate_preloaded(&t, 4000, PolicyKind::default().build(), Some(&prof)).unwrap();
    assert_eq!((cold.misses, warm.misses), (4, 0));
    assert_eq!(warm.bytes_read, 0);
    // The profile of the first half only, replayed on the second half.
    let half = Profile::from_trace(&t, Some(0..10));
    assert_eq!(half.tokens, 10);
    let rest = t.skip_tokens(10).unwrap();
    assert_eq!(rest.n_tokens(), 10);
    assert_eq!(rest.token(0), t.token(10));
    assert!(t.skip_tokens(20).is_none());
}
