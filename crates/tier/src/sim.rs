//! Offline cache simulator: replays a routing trace against a budget with each policy and
//! with Belady's optimum.
//!
//! Owns: the replay loop, the Belady policy, the known-future yardstick [`Horizon`] and the
//! report table of `sluice cache-sim`.
//! The replay drives the real [`ExpertCache`] (with accounting-only [`NoBuf`] slots), so
//! budget, pinning and size-class rules are exactly the engine's. Request order is the
//! decode order: token by token, layer by layer, the layer's k experts in router order;
//! the k experts of a layer stay pinned until the layer is done, so they must all fit at
//! once. Prefill batches are replayed token by token too (the engine loads each expert of
//! a batch once per layer, so prefill misses are over-counted here).
//!
//! Belady: evict the cached expert whose next request is farthest in the future. With one
//! size class this is the optimum of any demand-fetching cache (the tests check it against
//! a brute-force search on tiny traces), so no policy can miss less. With several size
//! classes it is the classic heuristic, not a strict bound (the report says so).
//! Prefetching is not modelled: every miss is a demand read.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;

use super::cache::{CacheConfig, CacheError, ExpertCache, ExpertKey, Lookup};
use super::policy::{NextUse, Policy, PolicyKind};
use super::profile::Profile;
use super::slot::NoBuf;
use super::trace::RoutingTrace;

/// Outcome of one replay.
#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    pub policy: String,
    pub requests: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Sum of the missed experts' bytes.
    pub bytes_read: u64,
    pub slot_allocations: u64,
    pub peak_bytes: u64,
}

impl SimResult {
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.hits as f64 / self.requests as f64
        }
    }
}

/// The flattened request sequence of a trace, in replay order.
pub fn requests(trace: &RoutingTrace) -> Vec<ExpertKey> {
    let moe = trace.header.moe_layers();
    let k = trace.header.top_k as usize;
    let mut v = Vec::with_capacity(trace.n_tokens() * moe.len() * k);
    for t in 0..trace.n_tokens() {
        let ids = trace.token(t);
        for (li, &layer) in moe.iter().enumerate() {
            for &e in &ids[li * k..(li + 1) * k] {
                v.push(ExpertKey::new(layer, e as u32));
            }
        }
    }
    v
}

/// Slot size classes of a trace's model: (distinct expert sizes, class of each layer).
pub fn size_classes(trace: &RoutingTrace) -> (Vec<usize>, Vec<usize>) {
    let mut sizes: Vec<usize> = Vec::new();
    let mut of_layer = vec![0; trace.header.n_layer as usize];
    for (l, &b) in trace.header.expert_bytes.iter().enumerate() {
        if b == 0 {
            continue;
        }
        let b = b as usize;
        of_layer[l] = match sizes.iter().position(|&s| s == b) {
            Some(c) => c,
            None => {
                sizes.push(b);
                sizes.len() - 1
            }
        };
    }
    (sizes, of_layer)
}

/// The smallest budget the trace can be replayed with: top_k x the largest expert.
pub fn min_trace_budget(trace: &RoutingTrace) -> u64 {
    let largest = trace.header.expert_bytes.iter().copied().max().unwrap_or(0);
    super::cache::min_budget(trace.header.top_k as usize, largest)
}

/// Replays `trace` against `budget` bytes with `policy`.
pub fn simulate(
    trace: &RoutingTrace,
    budget: u64,
    policy: Box<dyn Policy>,
) -> Result<SimResult, CacheError> {
    simulate_preloaded(trace, budget, policy, None)
}

/// Seeds the policy from `profile` and fills `cache` with the profile's most popular
/// experts while they fit in the budget without evicting (what `--preload-profile` does
/// at start). Returns the bytes filled.
pub fn preload<B: crate::SlotBuf>(
    cache: &ExpertCache<B>,
    profile: &Profile,
    class_of_layer: impl Fn(u32) -> Option<(usize, usize)>,
    mut fill: impl FnMut(ExpertKey, crate::cache::Reservation<B>) -> Result<(), CacheError>,
) -> Result<u64, CacheError> {
    for &(k, r) in &profile.rates {
        cache.seed(k, r);
    }
    let mut filled = 0;
    for (k, _) in profile.ranked() {
        let Some((class, bytes)) = class_of_layer(k.layer) else {
            continue;
        };
        let s = cache.stats();
        if s.bytes_allocated + bytes as u64 > cache.budget() || cache.contains(k) {
            if s.bytes_allocated + bytes as u64 > cache.budget() {
                break;
            }
            continue;
        }
        let r = cache.reserve(k, class)?;
        fill(k, r)?;
        filled += bytes as u64;
    }
    Ok(filled)
}

/// [`simulate`], with the cache warmed from a popularity profile first (the warm-up's
/// reads are not counted as misses).
pub fn simulate_preloaded(
    trace: &RoutingTrace,
    budget: u64,
    policy: Box<dyn Policy>,
    profile: Option<&Profile>,
) -> Result<SimResult, CacheError> {
    let (sizes, of_layer) = size_classes(trace);
    let name = policy.name().to_string();
    let cache = ExpertCache::<NoBuf>::new(
        CacheConfig {
            budget,
            slot_sizes: sizes,
            top_k: trace.header.top_k as usize,
            n_layer: trace.header.n_layer,
        },
        policy,
    )?;
    let mut preloaded = 0;
    if let Some(p) = profile {
        let slot_sizes = cache.slot_sizes();
        preloaded = preload(
            &cache,
            p,
            |l| {
                let b = *trace.header.expert_bytes.get(l as usize)?;
                (b > 0).then(|| (of_layer[l as usize], slot_sizes[of_layer[l as usize]]))
            },
            |_, r| cache.fill(r.ticket, r.buf, &[]).map(drop),
        )?;
    }
    let moe = trace.header.moe_layers();
    let k = trace.header.top_k as usize;
    let mut pins = Vec::with_capacity(k);
    for t in 0..trace.n_tokens() {
        let ids = trace.token(t);
        for (li, &layer) in moe.iter().enumerate() {
            for &e in &ids[li * k..(li + 1) * k] {
                let key = ExpertKey::new(layer, e as u32);
                match cache.lookup(key) {
                    Lookup::Hit(p) => pins.push(p),
                    // Every reservation is filled at once here, so nothing is pending.
                    Lookup::Miss | Lookup::Pending => {
                        let r = cache.reserve(key, of_layer[layer as usize])?;
                        pins.push(cache.fill(r.ticket, r.buf, &[])?);
                    }
                }
            }
            pins.clear(); // the layer is done: unpin its experts
        }
        cache.end_token();
    }
    let s = cache.stats();
    Ok(SimResult {
        policy: name,
        requests: s.total.requests(),
        hits: s.total.hits,
        misses: s.total.misses,
        evictions: s.total.evictions,
        bytes_read: s.bytes_filled - preloaded,
        slot_allocations: s.slot_allocations,
        peak_bytes: s.peak_bytes,
    })
}

/// Replays with a policy chosen by name; the result is labelled with `kind.label()`.
pub fn simulate_kind(
    trace: &RoutingTrace,
    budget: u64,
    kind: PolicyKind,
) -> Result<SimResult, CacheError> {
    let mut r = simulate(trace, budget, kind.build())?;
    r.policy = kind.label();
    Ok(r)
}

/// Replays with the expected-next-use rule and every expert's selection rate counted over
/// the whole trace in hindsight ([`NextUse::frozen`]): the best a frequency-based online
/// policy can do when requests are independent, so the yardstick for online policies.
pub fn simulate_oracle_rate(trace: &RoutingTrace, budget: u64) -> Result<SimResult, CacheError> {
    let p = Profile::from_trace(trace, None);
    simulate(trace, budget, Box::new(NextUse::frozen(p.rates)))
}

/// Replays with Belady's rule.
pub fn simulate_belady(trace: &RoutingTrace, budget: u64) -> Result<SimResult, CacheError> {
    simulate(trace, budget, Box::new(Belady::new(&requests(trace))))
}

/// Belady's rule as a policy over a known request sequence; it must see exactly that
/// sequence through `on_request`.
pub struct Belady {
    /// For request i: position of the next request of the same key (u64::MAX = never).
    next: Vec<u64>,
    pos: usize,
    /// Next use of each key as of its latest request.
    latest: HashMap<ExpertKey, u64>,
    cached: HashMap<ExpertKey, u64>,
    order: BTreeSet<(Reverse<u64>, ExpertKey)>,
}

impl Belady {
    pub fn new(reqs: &[ExpertKey]) -> Belady {
        let mut next = vec![u64::MAX; reqs.len()];
        let mut seen: HashMap<ExpertKey, u64> = HashMap::new();
        for (i, k) in reqs.iter().enumerate().rev() {
            if let Some(&j) = seen.get(k) {
                next[i] = j;
            }
            seen.insert(*k, i as u64);
        }
        Belady {
            next,
            pos: 0,
            latest: HashMap::new(),
            cached: HashMap::new(),
            order: BTreeSet::new(),
        }
    }
}

impl Policy for Belady {
    fn name(&self) -> &'static str {
        "belady"
    }
    fn on_request(&mut self, key: ExpertKey) {
        let nu = self.next.get(self.pos).copied().unwrap_or(u64::MAX);
        self.pos += 1;
        self.latest.insert(key, nu);
        if let Some(old) = self.cached.insert(key, nu) {
            self.order.remove(&(Reverse(old), key));
            self.order.insert((Reverse(nu), key));
        } else {
            self.cached.remove(&key);
        }
    }
    fn on_insert(&mut self, key: ExpertKey) {
        let nu = self.latest.get(&key).copied().unwrap_or(u64::MAX);
        if let Some(old) = self.cached.insert(key, nu) {
            self.order.remove(&(Reverse(old), key));
        }
        self.order.insert((Reverse(nu), key));
    }
    fn on_remove(&mut self, key: ExpertKey) {
        if let Some(old) = self.cached.remove(&key) {
            self.order.remove(&(Reverse(old), key));
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.order.iter().map(|e| e.1).find(|&k| evictable(k))
    }
}

/// Replays with [`Horizon`]: the next `horizon` requests known exactly (a token makes
/// MoE layers x top-k requests).
pub fn simulate_horizon_requests(
    trace: &RoutingTrace,
    budget: u64,
    horizon: u64,
) -> Result<SimResult, CacheError> {
    simulate(
        trace,
        budget,
        Box::new(Horizon::new(&requests(trace), horizon)),
    )
}

/// A yardstick between `next` and Belady: Belady's rule for the experts requested within
/// the next `horizon` requests (known exactly, e.g. the next tokens' routing), `next`'s rule
/// (decayed selection rates) for the rest, which go first. With `horizon` = 0 it is `next`;
/// with the whole trace, Belady. How its misses fall with the horizon says how far ahead a
/// policy would have to know the routing to come close to the optimum.
pub struct Horizon {
    belady: Belady,
    inner: NextUse,
    horizon: u64,
}

impl Horizon {
    pub fn new(reqs: &[ExpertKey], horizon: u64) -> Horizon {
        Horizon {
            belady: Belady::new(reqs),
            inner: NextUse::new(PolicyKind::DEFAULT_NEXT_HALF_LIFE),
            horizon,
        }
    }
}

impl Policy for Horizon {
    fn name(&self) -> &'static str {
        "horizon"
    }
    fn on_request(&mut self, key: ExpertKey) {
        self.belady.on_request(key);
        self.inner.on_request(key);
    }
    fn on_insert(&mut self, key: ExpertKey) {
        self.belady.on_insert(key);
        self.inner.on_insert(key);
    }
    fn on_remove(&mut self, key: ExpertKey) {
        self.belady.on_remove(key);
        self.inner.on_remove(key);
    }
    fn on_token_end(&mut self) {
        self.inner.on_token_end();
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        let (Reverse(nu), far) = self
            .belady
            .order
            .iter()
            .copied()
            .find(|&(_, k)| evictable(k))?;
        let limit = (self.belady.pos as u64).saturating_add(self.horizon);
        if nu < limit {
            // Every evictable expert is requested within the horizon: Belady's choice.
            return Some(far);
        }
        let latest = &self.belady.latest;
        self.inner
            .victim(&mut |k| evictable(k) && latest.get(&k).is_none_or(|&n| n >= limit))
            .or(Some(far))
    }
}

/// The `sluice cache-sim` table.
pub fn format_report(
    trace: &RoutingTrace,
    budget: u64,
    results: &[SimResult],
    belady: Option<&SimResult>,
) -> String {
    format_report_with(trace, budget, results, None, belady)
}

/// [`format_report`] with the hindsight-rate yardstick row ([`simulate_oracle_rate`]).
pub fn format_report_with(
    trace: &RoutingTrace,
    budget: u64,
    results: &[SimResult],
    oracle: Option<&SimResult>,
    belady: Option<&SimResult>,
) -> String {
    let gb = |b: u64| b as f64 / 1e9;
    let total = trace.header.total_expert_bytes();
    let (sizes, _) = size_classes(trace);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "trace: {} ({} tokens, {} MoE layers, {} experts, top-{}), routed experts {:.3} GB",
        if trace.header.model.is_empty() {
            "?"
        } else {
            &trace.header.model
        },
        trace.n_tokens(),
        trace.header.moe_layers().len(),
        trace.header.n_expert,
        trace.header.top_k,
        gb(total)
    );
    let _ = writeln!(
        s,
        "budget: {:.3} GB ({:.1}% of routed experts), min {:.3} GB",
        gb(budget),
        if total == 0 {
            0.0
        } else {
            100.0 * budget as f64 / total as f64
        },
        gb(min_trace_budget(trace))
    );
    let _ = writeln!(
        s,
        "{:<10} {:>12} {:>9} {:>11} {:>14}",
        "policy", "misses", "hit rate", "GB read", "vs belady"
    );
    let mut row = |r: &SimResult, vs: String| {
        let _ = writeln!(
            s,
            "{:<10} {:>12} {:>8.2}% {:>11.3} {:>14}",
            r.policy,
            r.misses,
            100.0 * r.hit_rate(),
            gb(r.bytes_read),
            vs
        );
    };
    for r in results {
        let vs = match belady {
            Some(b) if b.misses > 0 => format!(
                "+{} (x{:.2})",
                r.misses.saturating_sub(b.misses),
                r.misses as f64 / b.misses as f64
            ),
            Some(b) => format!("+{}", r.misses.saturating_sub(b.misses)),
            None => "-".into(),
        };
        row(r, vs);
    }
    if let Some(o) = oracle {
        let vs = match belady {
            Some(b) if b.misses > 0 => format!("x{:.2}", o.misses as f64 / b.misses as f64),
            _ => "-".into(),
        };
        row(o, vs);
    }
    if let Some(b) = belady {
        row(b, "optimum".into());
    }
    if sizes.len() > 1 && belady.is_some() {
        let _ = writeln!(
            s,
            "note: {} expert sizes; with mixed sizes Belady's rule is a heuristic, not a strict bound",
            sizes.len()
        );
    }
    if oracle.is_some() {
        let _ = writeln!(
            s,
            "note: oracle-rate = expected next use with selection rates counted over the whole trace in hindsight (a yardstick: the best a rate-based online policy can do on independent requests)"
        );
    }
    let _ = writeln!(
        s,
        "note: prefetching is not modelled; prefill batches are replayed token by token"
    );
    s
}
