//! Eviction policies for the expert cache.
//!
//! Owns: the [`Policy`] trait and its implementations: [`Lru`], [`Lfu`] (ds4's "route
//! hotness": selection counts halved every N tokens, LRU on ties) and [`Lru2`] (evict the
//! entry whose second-to-last request is oldest; entries requested once go first).
//! Policies only order keys; the cache decides what is evictable (never pinned, in-flight
//! or resident entries) and passes that in as a filter. Belady's optimum needs the future
//! and lives in the simulator.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use thiserror::Error;

use super::cache::ExpertKey;

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
}

impl Default for PolicyKind {
    /// LFU with ds4's halving period.
    fn default() -> PolicyKind {
        PolicyKind::Lfu {
            half_life: Self::DEFAULT_HALF_LIFE,
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
#[error("unknown cache policy {0:?} (expected lru, lfu, lfu:N with N tokens per halving, or lru2)")]
pub struct UnknownPolicy(pub String);

impl PolicyKind {
    /// ds4's halving period.
    pub const DEFAULT_HALF_LIFE: u32 = 16;

    pub fn from_name(name: &str) -> Result<PolicyKind, UnknownPolicy> {
        let n = name.trim().to_ascii_lowercase();
        match n.as_str() {
            "lru" => Ok(PolicyKind::Lru),
            "lfu" => Ok(PolicyKind::Lfu {
                half_life: Self::DEFAULT_HALF_LIFE,
            }),
            "lru2" | "lru-2" => Ok(PolicyKind::Lru2),
            _ => match n.strip_prefix("lfu:").map(str::parse::<u32>) {
                Some(Ok(h)) if h > 0 => Ok(PolicyKind::Lfu { half_life: h }),
                _ => Err(UnknownPolicy(name.to_string())),
            },
        }
    }

    /// Display name (round-trips through `from_name`).
    pub fn label(&self) -> String {
        match self {
            PolicyKind::Lru => "lru".into(),
            PolicyKind::Lfu { half_life } if *half_life == Self::DEFAULT_HALF_LIFE => "lfu".into(),
            PolicyKind::Lfu { half_life } => format!("lfu:{half_life}"),
            PolicyKind::Lru2 => "lru2".into(),
        }
    }

    pub fn build(&self) -> Box<dyn Policy> {
        match *self {
            PolicyKind::Lru => Box::new(Lru::default()),
            PolicyKind::Lfu { half_life } => Box::new(Lfu::new(half_life)),
            PolicyKind::Lru2 => Box::new(Lru2::default()),
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
