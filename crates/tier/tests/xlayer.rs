//! The cross-layer policy (`xl`) and the known-future yardstick (`Horizon`): hand-made
//! request sequences where the right victim is known, and a planted-correlation trace.

use sluice_tier::sim::{
    requests, simulate, simulate_belady, simulate_horizon_requests, simulate_kind,
};
use sluice_tier::xlayer::{CrossLayer, XlConfig};
use sluice_tier::{ExpertKey, NextUse, Policy, PolicyKind, RoutingTrace, TraceHeader};

fn header(n_layer: u32, n_expert: u32, top_k: u32, bytes: u64) -> TraceHeader {
    TraceHeader {
        model: "tiny-moe".into(),
        n_layer,
        n_expert,
        top_k,
        expert_bytes: vec![bytes; n_layer as usize],
    }
}

/// Feeds one token of top-1 requests, layer by layer.
fn token(p: &mut dyn Policy, experts: &[u32]) {
    for (l, &e) in experts.iter().enumerate() {
        p.on_request(ExpertKey::new(l as u32, e));
    }
    p.on_token_end();
}

#[test]
fn names_round_trip() {
    for (name, kind) in [
        ("xl", PolicyKind::CrossLayer { lags: 2 }),
        ("xl:0", PolicyKind::CrossLayer { lags: 0 }),
        ("XL:4", PolicyKind::CrossLayer { lags: 4 }),
    ] {
        assert_eq!(PolicyKind::from_name(name), Ok(kind));
        assert_eq!(PolicyKind::from_name(&kind.label()), Ok(kind));
    }
    assert!(PolicyKind::from_name("xl:x").is_err());
    assert!(PolicyKind::from_name("xl:99").is_err());
}

#[test]
fn xl_learns_that_an_expert_alternates() {
    // Two layers, top-1. Layer 0 alternates experts 0 and 1 every token; layer 1 always
    // uses expert 2. After a token that used expert 0, the next uses expert 1.
    // `next` sees equal rates (the older one, expert 1, goes: wrong); `xl` has learned
    // P(1 next | 0 now) = 1 and keeps 1, evicting 0.
    for lags in [0, 2] {
        let mut xl = CrossLayer::new(XlConfig {
            lags,
            ..Default::default()
        });
        let mut next = NextUse::new(64);
        for t in 0..20 {
            token(&mut xl, &[t % 2, 2]);
            token(&mut next, &[t % 2, 2]);
        }
        // 20 tokens: the last one (t = 19) used expert 1; one more with expert 0.
        for p in [&mut xl as &mut dyn Policy, &mut next] {
            token(p, &[0, 2]);
            p.on_insert(ExpertKey::new(0, 0));
            p.on_insert(ExpertKey::new(0, 1));
        }
        assert_eq!(next.victim(&mut |_| true), Some(ExpertKey::new(0, 1)));
        assert_eq!(xl.victim(&mut |_| true), Some(ExpertKey::new(0, 0)));
    }
}

#[test]
fn xl_predicts_the_next_layer_from_this_one() {
    // Two layers, top-1. Layer 1 follows layer 0: expert 0 -> 2, expert 1 -> 3. Layer 0
    // picks 1 13 times and 0 7 times; after a 1 comes another 1 8 times, a 0 4 times. The
    // trace ends with a token of 1; then a token starts with 0. With 2 and 3 of layer 1
    // cached, `next` evicts 2 (the lower rate), and so does `xl` with lags 0 (it has only
    // layer 1's previous set, 3, after which 3 came twice as often as 2). With lags >= 1 it
    // knows layer 1 will pick 2 after this 0 (7 of 7 times) and evicts 3.
    let seq = [0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1];
    let run = |p: &mut dyn Policy| {
        for &e in &seq {
            token(p, &[e, 2 + e]);
        }
        p.on_insert(ExpertKey::new(1, 2));
        p.on_insert(ExpertKey::new(1, 3));
        p.on_request(ExpertKey::new(0, 0));
        p.victim(&mut |_| true)
    };
    let two = ExpertKey::new(1, 2);
    let three = ExpertKey::new(1, 3);
    assert_eq!(run(&mut NextUse::new(64)), Some(two));
    assert_eq!(
        run(&mut *PolicyKind::CrossLayer { lags: 0 }.build()),
        Some(two)
    );
    assert_eq!(
        run(&mut *PolicyKind::CrossLayer { lags: 1 }.build()),
        Some(three)
    );
    assert_eq!(
        run(&mut *PolicyKind::CrossLayer { lags: 2 }.build()),
        Some(three)
    );
}

/// A trace with planted cross-layer correlation: runs of 1-3 tokens on one of `groups`
/// topics (topic 0 half the time, the other half spread over the rest); layer `l` of topic
/// `g` uses experts `(g * k + i + 3 l) % n_expert`, i < k. Layer 0's set reveals the topic,
/// hence every later layer's set.
fn planted(n_layer: u32, n_expert: u32, k: u32, groups: u32, n_tok: usize) -> RoutingTrace {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut tokens: Vec<Vec<u16>> = Vec::new();
    while tokens.len() < n_tok {
        let r = (rnd() % 1000) as u32;
        let g = if r < 500 { 0 } else { 1 + r % (groups - 1) };
        for _ in 0..1 + rnd() % 3 {
            tokens.push(
                (0..n_layer)
                    .flat_map(|l| (0..k).map(move |i| ((g * k + i + 3 * l) % n_expert) as u16))
                    .collect(),
            );
        }
    }
    tokens.truncate(n_tok);
    RoutingTrace::from_tokens(header(n_layer, n_expert, k, 1000), &tokens).unwrap()
}

#[test]
fn xl_beats_lru_on_planted_cross_layer_correlation() {
    // 4 layers, 16 experts, top-2, 6 topics, 800 tokens; 16 slots (two tokens' experts).
    let t = planted(4, 16, 2, 6, 800);
    let budget = 16 * 1000;
    let m = |kind| simulate_kind(&t, budget, kind).unwrap().misses;
    let (lru, next) = (m(PolicyKind::Lru), m(PolicyKind::NextUse { half_life: 64 }));
    let xl0 = m(PolicyKind::CrossLayer { lags: 0 });
    let xl = m(PolicyKind::default());
    let xl3 = m(PolicyKind::CrossLayer { lags: 3 });
    let bel = simulate_belady(&t, budget).unwrap().misses;
    let all = format!("belady {bel} xl:3 {xl3} xl {xl} xl:0 {xl0} lru {lru} next {next}");
    assert_eq!(PolicyKind::default(), PolicyKind::CrossLayer { lags: 2 });
    // The default beats lru and `next`; predicting from the current token's sets (lags)
    // beats predicting from each layer's previous set alone, the more layers the better.
    assert!(bel <= xl3 && xl3 < xl && xl < xl0, "{all}");
    assert!(xl < lru && xl < next, "{all}");
}

#[test]
fn horizon_spans_next_to_belady() {
    let t = planted(4, 16, 2, 6, 300);
    let n_req = requests(&t).len() as u64;
    for slots in [10u64, 16, 24] {
        let budget = slots * 1000;
        let bel = simulate_belady(&t, budget).unwrap();
        let next = simulate(&t, budget, Box::new(NextUse::new(64))).unwrap();
        // Nothing known: `next`'s rule. The whole trace known: Belady's.
        let h0 = simulate_horizon_requests(&t, budget, 0).unwrap();
        let hall = simulate_horizon_requests(&t, budget, n_req).unwrap();
        assert_eq!(h0.misses, next.misses);
        assert_eq!(hall.misses, bel.misses);
        let h1 = simulate_horizon_requests(&t, budget, 8).unwrap();
        assert!(bel.misses <= h1.misses);
    }
}
