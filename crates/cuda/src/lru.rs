//! The byte-budgeted least-recently-used bookkeeping both VRAM expert caches share (the
//! products-only path's per-matrix cache in `lib.rs`, the whole forward pass's per-unit
//! cache in `forward.rs`).
//!
//! Owns: entries keyed by `K` holding a value of a given byte length, a use clock (one tick
//! per lookup, which the caller advances), the bytes held against a budget, and eviction of
//! the least recently used entries the caller does not protect (what the call in progress
//! uses). Knows nothing of CUDA: the values are device buffers in the backend and plain
//! numbers in the tests below.
//!
//! Scan resistance: [`Lru::insert_cold`] adds an entry at the cold end, below every entry
//! inserted or used the ordinary way, the latest cold insert lowest: a scan (a prefill batch
//! that needs nearly every expert of each layer, one layer after the other) then evicts its
//! own previous layer's entries first and leaves what was there before it alone, instead of
//! flushing the whole cache once per pass.

use std::collections::HashMap;
use std::hash::Hash;

struct Entry<V> {
    value: V,
    len: u64,
    last_use: u64,
}

/// Entries under a byte budget, least recently used evicted first.
pub(crate) struct Lru<K, V> {
    map: HashMap<K, Entry<V>>,
    clock: u64,
    /// The last cold insert's use time (counts down from [`WARM`]).
    cold: u64,
    held: u64,
    budget: u64,
}

/// Where the use clock starts: cold inserts count down from just below it, so every cold
/// entry is older than every entry inserted or used since.
const WARM: u64 = 1 << 62;

impl<K: Eq + Hash + Copy, V> Lru<K, V> {
    pub(crate) fn new(budget: u64) -> Self {
        Lru {
            map: HashMap::new(),
            clock: WARM,
            cold: WARM,
            held: 0,
            budget,
        }
    }

    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes the entries hold.
    pub(crate) fn held(&self) -> u64 {
        self.held
    }

    /// Advance the use clock (one lookup).
    pub(crate) fn tick(&mut self) {
        self.clock += 1;
    }

    /// `k`'s value and byte length, marked as used now (at the clock's current tick).
    pub(crate) fn touch(&mut self, k: &K) -> Option<(&mut V, u64)> {
        let clock = self.clock;
        self.map.get_mut(k).map(|e| {
            e.last_use = clock;
            (&mut e.value, e.len)
        })
    }

    pub(crate) fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k).map(|e| &e.value)
    }

    pub(crate) fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        self.map.get_mut(k).map(|e| &mut e.value)
    }

    pub(crate) fn remove(&mut self, k: &K) -> Option<V> {
        let e = self.map.remove(k)?;
        self.held -= e.len;
        Some(e.value)
    }

    /// Evict least recently used entries that `protected` does not name until `len` more
    /// bytes fit the budget: (entries evicted, whether they fit now).
    pub(crate) fn make_room(&mut self, len: u64, protected: impl Fn(&K) -> bool) -> (u64, bool) {
        let mut evicted = 0;
        while self.held + len > self.budget {
            let victim = self
                .map
                .iter()
                .filter(|(k, _)| !protected(k))
                .min_by_key(|(_, e)| e.last_use)
                .map(|(k, _)| *k);
            let Some(k) = victim else {
                return (evicted, false);
            };
            self.remove(&k);
            evicted += 1;
        }
        (evicted, true)
    }

    /// Add `k` (replacing any entry it had), used now.
    pub(crate) fn insert(&mut self, k: K, value: V, len: u64) {
        let clock = self.clock;
        self.insert_at(k, value, len, clock);
    }

    /// Add `k` (replacing any entry it had) at the cold end: the next to be evicted, before
    /// every other entry, until a [`Lru::touch`] makes it used now.
    pub(crate) fn insert_cold(&mut self, k: K, value: V, len: u64) {
        self.cold -= 1;
        let cold = self.cold;
        self.insert_at(k, value, len, cold);
    }

    fn insert_at(&mut self, k: K, value: V, len: u64, last_use: u64) {
        self.remove(&k);
        self.held += len;
        self.map.insert(
            k,
            Entry {
                value,
                len,
                last_use,
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(budget: u64, keys: &[u32]) -> Lru<u32, u32> {
        let mut c = Lru::new(budget);
        for &k in keys {
            c.tick();
            assert!(c.make_room(10, |_| false).1);
            c.insert(k, k * 100, 10);
        }
        c
    }

    #[test]
    fn evicts_the_least_recently_used_first() {
        let mut c = cache(30, &[1, 2, 3]);
        assert_eq!(c.held(), 30);
        c.tick();
        assert!(c.touch(&1).is_some()); // 2 is now the oldest
        assert_eq!(c.make_room(10, |_| false), (1, true));
        assert!(c.get(&2).is_none() && c.get(&1).is_some() && c.get(&3).is_some());
        assert_eq!(c.held(), 20);
    }

    #[test]
    fn never_evicts_what_is_protected_and_says_when_it_cannot_fit() {
        let mut c = cache(30, &[1, 2, 3]);
        assert_eq!(c.make_room(20, |&k| k != 3), (1, false));
        assert!(c.get(&3).is_none() && c.get(&1).is_some() && c.get(&2).is_some());
        assert_eq!(c.held(), 20);
        assert_eq!(c.make_room(40, |_| false), (2, false));
        assert_eq!(c.held(), 0);
    }

    #[test]
    fn held_bytes_follow_inserts_replacements_and_removals() {
        let mut c = cache(100, &[1, 2]);
        c.insert(1, 7, 25); // replaces key 1's 10 bytes
        assert_eq!(c.held(), 35);
        assert_eq!(c.touch(&1).map(|(v, len)| (*v, len)), Some((7, 25)));
        assert_eq!(c.remove(&2), Some(200));
        assert_eq!(c.held(), 25);
        assert_eq!(c.remove(&2), None);
        assert_eq!(c.budget(), 100);
    }

    #[test]
    fn cold_inserts_go_first_latest_first_and_get_does_not_promote() {
        let mut c = cache(50, &[1, 2, 3]); // warm, 1 the oldest
        c.tick();
        c.insert_cold(4, 400, 10);
        c.tick();
        c.insert_cold(5, 500, 10);
        // A lookup that does not promote leaves 4 and 5 cold.
        c.tick();
        assert_eq!(c.get(&4), Some(&400));
        assert_eq!(c.make_room(10, |_| false), (1, true));
        assert!(c.get(&5).is_none() && c.get(&4).is_some());
        assert_eq!(c.make_room(30, |_| false), (2, true));
        // Then 4 (the other cold one), then the least recently used warm entry.
        assert!(c.get(&4).is_none() && c.get(&1).is_none() && c.get(&2).is_some());
        // A touch makes a cold entry the most recently used.
        c.insert_cold(6, 600, 10);
        c.tick();
        assert!(c.touch(&6).is_some());
        assert_eq!(c.make_room(40, |_| false), (2, true));
        assert!(c.get(&6).is_some() && c.get(&2).is_none() && c.get(&3).is_none());
    }
}
