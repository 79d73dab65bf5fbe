//! Eviction policies for the expert cache.
//!
//! Owns: the [`Policy`] trait and its implementations: [`Lru`], [`Lfu`] (ds4's "route
//! hotness": selection counts halved every N tokens, LRU on ties), [`Lru2`] (evict the
//! entry whose second-to-last request is oldest; entries requested once go first) and
//! [`NextUse`] (evict the expert whose expected next request is farthest, from its decayed
//! selection rate and where its layer is in the layer cycle); the [`PolicyKind`] names,
//! which also build the default, [`super::xlayer::CrossLayer`] (`xl`: `NextUse` with the
//! next selection predicted from the sets already seen).
//! Policies only order keys; the cache decides what is evictable (never pinned, in-flight
//! or resident entries) and passes that in as a filter. Belady's optimum needs the future
//! and lives in the simulator.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use thiserror::Error;

use super::key::ExpertKey;

/// An eviction policy. The cache calls it under its lock, in request order.
pub trait Policy: Send {
    /// Name as accepted by `--cache-policy`.
    fn name(&self) -> &'static str;
    /// `key` was requested (a hit, a miss, or a read already in flight).
    fn on_request(&mut self, key: ExpertKey);
    /// `key` now holds cached data (its read landed). Never called for resident entries.
    fn on_insert(&mut self, key: ExpertKey);
    /// `key` left the cache (evicted).
    fn on_remove(&mut self, key: ExpertKey);
    /// One token (all layers) finished: the decay clock.
    fn on_token_end(&mut self) {}
    /// A saved popularity profile says `key` was selected `weight` times per token on
    /// average (0..=1) before this run: start its statistics from that (`--preload-profile`).
    fn seed(&mut self, _key: ExpertKey, _weight: f64) {}
    /// The key to evict next among cached keys for which `evictable` returns true.
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey>;
}

/// Policy chosen by name (`--cache-policy lru|lfu|lfu:N|lru2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    Lru,
    /// Counts halve every `half_life` tokens.
    Lfu {
        half_life: u32,
    },
    Lru2,
    /// Expected next use; selection rates decay with a half-life of `half_life` tokens.
    NextUse {
        half_life: u32,
    },
    /// Expected next use with the next selection predicted from the layer's previous set
    /// and, for the next `lags` layers, from the current token's sets
    /// ([`super::xlayer::CrossLayer`]).
    CrossLayer {
        lags: u32,
    },
}

impl Default for PolicyKind {
    /// Expected next use with predicted next selections (`xl`: closest to Belady in 34 of
    /// the 36 rows of the recorded traces' cache-sim table, tests/fixtures/routing/README.md).
    fn default() -> PolicyKind {
        PolicyKind::CrossLayer {
            lags: Self::DEFAULT_XL_LAGS,
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

impl std::str::FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<PolicyKind, UnknownPolicy> {
        PolicyKind::from_name(s)
    }
}

#[derive(Debug, Error, PartialEq)]
#[error("unknown cache policy {0:?} (expected next, next:N, xl, xl:J, lru, lfu, lfu:N with N tokens per halving, or lru2)")]
pub struct UnknownPolicy(pub String);

impl PolicyKind {
    /// ds4's halving period.
    pub const DEFAULT_HALF_LIFE: u32 = 16;
    /// Half-life of [`NextUse`]'s selection rates, in tokens.
    pub const DEFAULT_NEXT_HALF_LIFE: u32 = 64;
    /// Layers ahead [`super::xlayer::CrossLayer`] predicts from the current token's sets.
    pub const DEFAULT_XL_LAGS: u32 = 2;

    pub fn from_name(name: &str) -> Result<PolicyKind, UnknownPolicy> {
        let n = name.trim().to_ascii_lowercase();
        match n.as_str() {
            "lru" => Ok(PolicyKind::Lru),
            "lfu" => Ok(PolicyKind::Lfu {
                half_life: Self::DEFAULT_HALF_LIFE,
            }),
            "lru2" | "lru-2" => Ok(PolicyKind::Lru2),
            "next" => Ok(PolicyKind::NextUse {
                half_life: Self::DEFAULT_NEXT_HALF_LIFE,
            }),
            "xl" => Ok(PolicyKind::CrossLayer {
                lags: Self::DEFAULT_XL_LAGS,
            }),
            _ => {
                if let Some(Ok(j)) = n.strip_prefix("xl:").map(str::parse::<u32>) {
                    if j <= 16 {
                        return Ok(PolicyKind::CrossLayer { lags: j });
                    }
                }
                let num = |p: &str| match n.strip_prefix(p).map(str::parse::<u32>) {
                    Some(Ok(h)) if h > 0 => Some(h),
                    _ => None,
                };
                if let Some(h) = num("lfu:") {
                    Ok(PolicyKind::Lfu { half_life: h })
                } else if let Some(h) = num("next:") {
                    Ok(PolicyKind::NextUse { half_life: h })
                } else {
                    Err(UnknownPolicy(name.to_string()))
                }
            }
        }
    }

    /// Display name (round-trips through `from_name`).
    pub fn label(&self) -> String {
        match self {
            PolicyKind::Lru => "lru".into(),
            PolicyKind::Lfu { half_life } if *half_life == Self::DEFAULT_HALF_LIFE => "lfu".into(),
            PolicyKind::Lfu { half_life } => format!("lfu:{half_life}"),
            PolicyKind::Lru2 => "lru2".into(),
            PolicyKind::NextUse { half_life } if *half_life == Self::DEFAULT_NEXT_HALF_LIFE => {
                "next".into()
            }
            PolicyKind::NextUse { half_life } => format!("next:{half_life}"),
            PolicyKind::CrossLayer { lags } if *lags == Self::DEFAULT_XL_LAGS => "xl".into(),
            PolicyKind::CrossLayer { lags } => format!("xl:{lags}"),
        }
    }

    pub fn build(&self) -> Box<dyn Policy> {
        match *self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Lfu { half_life } => Box::new(Lfu::new(half_life)),
            PolicyKind::Lru2 => Box::new(Lru2::default()),
            PolicyKind::NextUse { half_life } => Box::new(NextUse::new(half_life)),
            PolicyKind::CrossLayer { lags } => {
                Box::new(super::xlayer::CrossLayer::new(super::xlayer::XlConfig {
                    lags: lags as usize,
                    ..Default::default()
                }))
            }
        }
    }
}

/// Least recently used: evicts the cached key whose last request (or insert) is oldest.
#[derive(Default)]
pub struct Lru {
    tick: u64,
    at: HashMap<ExpertKey, u64>,
    order: BTreeMap<u64, ExpertKey>,
}

impl Lru {
    fn touch(&mut self, key: ExpertKey) {
        self.tick += 1;
        if let Some(old) = self.at.insert(key, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, key);
    }
}

impl Policy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_request(&mut self, key: ExpertKey) {
        if self.at.contains_key(&key) {
            self.touch(key);
        }
    }
    fn on_insert(&mut self, key: ExpertKey) {
        self.touch(key);
    }
    fn on_remove(&mut self, key: ExpertKey) {
        if let Some(t) = self.at.remove(&key) {
            self.order.remove(&t);
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.order.values().copied().find(|&k| evictable(k))
    }
}

/// LFU with decay ("route hotness"): every request counts one selection, whether or not the
/// expert is cached; all counts halve (rounding down) every `half_life` tokens. Evicts the
/// cached key with the lowest count, the least recently requested among equal counts.
pub struct Lfu {
    half_life: u32,
    tokens: u32,
    tick: u64,
    /// Selection counts of every key seen (cached or not) and their last request tick.
    hist: HashMap<ExpertKey, (u32, u64)>,
    /// Cached keys ordered by (count, last tick).
    order: BTreeSet<(u32, u64, ExpertKey)>,
    cached: HashMap<ExpertKey, (u32, u64)>,
}

impl Lfu {
    pub fn new(half_life: u32) -> Lfu {
        Lfu {
            half_life: half_life.max(1),
            tokens: 0,
            tick: 0,
            hist: HashMap::new(),
            order: BTreeSet::new(),
            cached: HashMap::new(),
        }
    }

    /// Current (decayed) count of `key`.
    pub fn count(&self, key: ExpertKey) -> u32 {
        self.hist.get(&key).map_or(0, |h| h.0)
    }

    fn reorder(&mut self, key: ExpertKey) {
        if let Some(old) = self.cached.get_mut(&key) {
            self.order.remove(&(old.0, old.1, key));
            let h = self.hist.get(&key).copied().unwrap_or((0, 0));
            *old = h;
            self.order.insert((h.0, h.1, key));
        }
    }
}

impl Policy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }
    fn on_request(&mut self, key: ExpertKey) {
        self.tick += 1;
        let h = self.hist.entry(key).or_insert((0, 0));
        h.0 = h.0.saturating_add(1);
        h.1 = self.tick;
        self.reorder(key);
    }
    fn on_insert(&mut self, key: ExpertKey) {
        let h = *self.hist.entry(key).or_insert((0, self.tick));
        if let Some(old) = self.cached.insert(key, h) {
            self.order.remove(&(old.0, old.1, key));
        }
        self.order.insert((h.0, h.1, key));
    }
    fn on_remove(&mut self, key: ExpertKey) {
        if let Some(old) = self.cached.remove(&key) {
            self.order.remove(&(old.0, old.1, key));
        }
    }
    fn seed(&mut self, key: ExpertKey, weight: f64) {
        // The count a key selected at this rate would have reached over one half-life.
        let c = (weight.clamp(0.0, 1.0) * f64::from(self.half_life) * 2.0).round() as u32;
        let h = self.hist.entry(key).or_insert((0, 0));
        h.0 = h.0.max(c);
        self.reorder(key);
    }
    fn on_token_end(&mut self) {
        self.tokens += 1;
        if self.tokens < self.half_life {
            return;
        }
        self.tokens = 0;
        let cached = &self.cached;
        self.hist.retain(|k, h| {
            h.0 /= 2;
            h.0 > 0 || cached.contains_key(k)
        });
        self.order.clear();
        for (k, c) in self.cached.iter_mut() {
            *c = self.hist[k];
            self.order.insert((c.0, c.1, *k));
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.order.iter().map(|e| e.2).find(|&k| evictable(k))
    }
}

/// LRU-2: evicts the cached key whose second-to-last request is oldest; keys requested only
/// once (no second-to-last request) go first, least recently used among them. Keeps the
/// last two request times of every key seen (bounded by layers x experts).
#[derive(Default)]
pub struct Lru2 {
    tick: u64,
    /// (second-to-last, last) request tick; 0 = none.
    hist: HashMap<ExpertKey, (u64, u64)>,
    order: BTreeSet<(u64, u64, ExpertKey)>,
    cached: HashMap<ExpertKey, (u64, u64)>,
}

impl Policy for Lru2 {
    fn name(&self) -> &'static str {
        "lru2"
    }
    fn on_request(&mut self, key: ExpertKey) {
        self.tick += 1;
        let h = self.hist.entry(key).or_insert((0, 0));
        *h = (h.1, self.tick);
        let h = *h;
        if let Some(old) = self.cached.insert(key, h) {
            self.order.remove(&(old.0, old.1, key));
            self.order.insert((h.0, h.1, key));
        } else {
            self.cached.remove(&key);
        }
    }
    fn on_insert(&mut self, key: ExpertKey) {
        let h = *self.hist.entry(key).or_insert((0, self.tick));
        if let Some(old) = self.cached.insert(key, h) {
            self.order.remove(&(old.0, old.1, key));
        }
        self.order.insert((h.0, h.1, key));
    }
    fn on_remove(&mut self, key: ExpertKey) {
        if let Some(old) = self.cached.remove(&key) {
            self.order.remove(&(old.0, old.1, key));
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        self.order.iter().map(|e| e.2).find(|&k| evictable(k))
    }
}

/// Expected next use: evicts the cached expert whose next request is expected farthest in
/// the future, the online estimate of Belady's rule.
///
/// Decode visits the MoE layers in a fixed cycle, so an expert of layer `L` can next be
/// requested only when the cycle reaches `L` again: after `d(L)` layer visits (1 for the
/// next layer, `N` for the layer just run), then every `N`. If it is selected at a visit
/// of its layer with probability `p`, its next request is expected after
/// `d(L) + N (1 - p) / p` layer visits. `p` is its selection count over its layer's
/// visits, both decayed with a half-life of `half_life` tokens (a request made `h` tokens
/// ago weighs `2^(-h / half_life)`). Among equal expectations the least recently requested
/// goes first. A batch (prefill) counts as one visit of each layer, as the cache sees it.
///
/// Decay is kept lazily: a request adds `2^(t / half_life)` at token `t`, so relative order
/// never changes between requests; all weights are rescaled when they grow large.
pub struct NextUse {
    half_life: f64,
    tokens: u64,
    tick: u64,
    /// Weight a request gets now.
    w: f64,
    /// Layer ordinals in cycle order (learned from the requests).
    layers: Vec<u32>,
    /// Per layer ordinal: decayed visit weight, and the ordered cached keys
    /// (decayed count bits, last tick, expert).
    visits: Vec<f64>,
    order: Vec<BTreeSet<(u64, u64, u32)>>,
    /// Every key seen: (decayed count, last request tick).
    hist: HashMap<ExpertKey, (f64, u64)>,
    /// Cached keys: the entry of `order` they are filed under.
    cached: HashMap<ExpertKey, (u64, u64)>,
    /// Ordinal of the layer requested last, and whether its current visit is counted.
    cur: usize,
    cur_layer: Option<u32>,
    /// Rates fixed by [`NextUse::frozen`]: requests do not change them.
    frozen: bool,
}

impl NextUse {
    /// Tokens of evidence a seeded (profile) rate counts as.
    pub const SEED_TOKENS: f64 = 4.0;

    /// A reference policy for the simulator: the same rule with every key's selection rate
    /// fixed in advance (e.g. counted over the whole trace in hindsight), never updated.
    /// With independent requests this is the best any online policy can do (A0); it needs
    /// the future, so it is a yardstick, not an option of the engine.
    pub fn frozen(rates: impl IntoIterator<Item = (ExpertKey, f64)>) -> NextUse {
        let mut p = NextUse::new(1);
        for (k, r) in rates {
            let o = p.ordinal(k.layer);
            p.visits[o] = 1.0;
            p.hist.insert(k, (r, 0));
        }
        p.frozen = true;
        p
    }

    pub fn new(half_life: u32) -> NextUse {
        NextUse {
            frozen: false,
            half_life: f64::from(half_life.max(1)),
            tokens: 0,
            tick: 0,
            w: 1.0,
            layers: Vec::new(),
            visits: Vec::new(),
            order: Vec::new(),
            hist: HashMap::new(),
            cached: HashMap::new(),
            cur: 0,
            cur_layer: None,
        }
    }

    fn ordinal(&mut self, layer: u32) -> usize {
        match self.layers.binary_search(&layer) {
            Ok(i) => i,
            Err(i) => {
                self.layers.insert(i, layer);
                self.visits.insert(i, 0.0);
                self.order.insert(i, BTreeSet::new());
                if self.cur_layer.is_some() && self.cur >= i {
                    self.cur += 1;
                }
                i
            }
        }
    }

    fn file(&mut self, key: ExpertKey) {
        let h = self.hist.get(&key).copied().unwrap_or((0.0, 0));
        let entry = (h.0.to_bits(), h.1);
        let o = self.ordinal(key.layer);
        if let Some(old) = self.cached.insert(key, entry) {
            self.order[o].remove(&(old.0, old.1, key.expert));
        }
        self.order[o].insert((entry.0, entry.1, key.expert));
    }

    /// Divide every weight by the current request weight (order is unchanged).
    fn rescale(&mut self) {
        let w = self.w;
        for h in self.hist.values_mut() {
            h.0 /= w;
        }
        for v in &mut self.visits {
            *v /= w;
        }
        self.hist.retain(|_, h| h.0 > 1e-30);
        self.w = 1.0;
        let keys: Vec<ExpertKey> = self.cached.keys().copied().collect();
        for o in &mut self.order {
            o.clear();
        }
        self.cached.clear();
        for k in keys {
            self.hist.entry(k).or_insert((0.0, 0));
            self.file(k);
        }
    }
}

impl Policy for NextUse {
    fn name(&self) -> &'static str {
        if self.frozen {
            "oracle-rate"
        } else {
            "next"
        }
    }
    fn on_request(&mut self, key: ExpertKey) {
        self.tick += 1;
        let o = self.ordinal(key.layer);
        if self.cur_layer != Some(key.layer) {
            self.cur_layer = Some(key.layer);
            self.cur = o;
            if !self.frozen {
                self.visits[o] += self.w;
            }
        }
        if self.frozen {
            return;
        }
        let w = self.w;
        let tick = self.tick;
        let h = self.hist.entry(key).or_insert((0.0, 0));
        h.0 += w;
        h.1 = tick;
        if self.cached.contains_key(&key) {
            self.file(key);
        }
    }
    fn on_insert(&mut self, key: ExpertKey) {
        let tick = self.tick;
        self.hist.entry(key).or_insert((0.0, tick));
        self.file(key);
    }
    fn on_remove(&mut self, key: ExpertKey) {
        if let Some(old) = self.cached.remove(&key) {
            if let Ok(o) = self.layers.binary_search(&key.layer) {
                self.order[o].remove(&(old.0, old.1, key.expert));
            }
        }
    }
    fn on_token_end(&mut self) {
        if self.frozen {
            return;
        }
        self.tokens += 1;
        self.w *= (2f64).powf(1.0 / self.half_life);
        if self.w > 1e200 {
            self.rescale();
        }
    }
    fn seed(&mut self, key: ExpertKey, weight: f64) {
        // As if the profile's rate had been seen over a few visits: a weak prior that this
        // run's own requests soon outweigh (on the recorded 30B-A3B traces 4 tokens beat
        // 0, 16 and 64: a profile from other text is only roughly right).
        let o = self.ordinal(key.layer);
        let visits = Self::SEED_TOKENS * self.w;
        if self.visits[o] < visits {
            self.visits[o] = visits;
        }
        let c = weight.clamp(0.0, 1.0) * visits;
        let h = self.hist.entry(key).or_insert((0.0, 0));
        h.0 = h.0.max(c);
        if self.cached.contains_key(&key) {
            self.file(key);
        }
    }
    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        let n = self.layers.len() as f64;
        // (expected visits to the next request, -last tick, key): the largest wins.
        let mut best: Option<(f64, u64, ExpertKey)> = None;
        for (o, set) in self.order.iter().enumerate() {
            let layer = self.layers[o];
            let Some(&(c, t, e)) = set
                .iter()
                .find(|&&(_, _, e)| evictable(ExpertKey::new(layer, e)))
            else {
                continue;
            };
            let d = ((o + self.layers.len() - self.cur - 1) % self.layers.len()) as f64 + 1.0;
            let c = f64::from_bits(c);
            let v = self.visits[o].max(c);
            let expect = if c <= 0.0 {
                f64::INFINITY
            } else {
                d + n * (v / c - 1.0)
            };
            let better = match best {
                None => true,
                Some((bx, bt, _)) => expect > bx || (expect == bx && t < bt),
            };
            if better {
                best = Some((expect, t, ExpertKey::new(layer, e)));
            }
        }
        best.map(|b| b.2)
    }
}
