//! ExpertCache and policies: the budget invariant under random workloads, pinning, slot
//! reuse, and LRU / LFU / LRU-2 on hand-worked sequences.

use proptest::prelude::*;
use sluice_tier::{
    CacheConfig, CacheError, ExpertCache, ExpertKey, Lfu, Lookup, Lru2, Pinned, Policy, PolicyKind,
    Reservation, SlotMemory,
};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

fn key(l: u32, e: u32) -> ExpertKey {
    ExpertKey::new(l, e)
}

fn cache(budget: u64, sizes: &[usize], top_k: usize, p: PolicyKind) -> ExpertCache<Vec<u8>> {
    ExpertCache::new(
        CacheConfig {
            budget,
            slot_sizes: sizes.to_vec(),
            top_k,
            n_layer: 4,
        },
        p.build(),
    )
    .unwrap()
}

/// Requests `k` like the engine does: hit, or reserve + fill; drops the pin at once.
fn request(c: &ExpertCache<Vec<u8>>, k: ExpertKey) -> bool {
    match c.lookup(k) {
        Lookup::Hit(_) => true,
        _ => {
            let r = c.reserve(k, 0).unwrap();
            c.fill(r.ticket, r.buf, &[]).unwrap();
            false
        }
    }
}

/// The byte pattern a test writes into the slot of `k` (so reuse of a pinned slot shows).
fn pattern(k: ExpertKey, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (k.layer as usize * 31 + k.expert as usize * 7 + i) as u8)
        .collect()
}

#[test]
fn budget_below_minimum_names_the_minimum() {
    let err = ExpertCache::<Vec<u8>>::new(
        CacheConfig {
            budget: 1000,
            slot_sizes: vec![100, 300],
            top_k: 4,
            n_layer: 1,
        },
        PolicyKind::Lru.build(),
    )
    .err()
    .unwrap();
    // 4 experts x 300 bytes (the largest class) = 1200.
    assert_eq!(
        err,
        CacheError::BudgetBelowMinimum {
            budget: 1000,
            min: 1200,
            top_k: 4,
            slot_bytes: 300
        }
    );
    assert!(err.to_string().contains("at least 1200"), "{err}");
}

#[test]
fn lru_hand_sequence() {
    // 3 slots of 10 bytes. Requests A B C A D B C:
    // A miss, B miss, C miss -> [A B C]; A hit (recency order B C A);
    // D miss evicts B -> [C A D]; B miss evicts C -> [A D B]; C miss evicts A -> [D B C].
    let c = cache(30, &[10], 1, PolicyKind::Lru);
    let (a, b, cc, d) = (key(0, 0), key(0, 1), key(0, 2), key(0, 3));
    let hits: Vec<bool> = [a, b, cc, a, d, b, cc]
        .iter()
        .map(|&k| request(&c, k))
        .collect();
    assert_eq!(hits, [false, false, false, true, false, false, false]);
    assert!(!c.contains(a) && c.contains(d) && c.contains(b) && c.contains(cc));
    let s = c.stats();
    assert_eq!((s.total.hits, s.total.misses, s.total.evictions), (1, 6, 3));
    assert_eq!(s.slot_allocations, 3, "3 slots reused for 6 misses");
    assert_eq!(s.bytes_cached, 30);
    assert_eq!(s.per_layer[0].misses, 6);
}

#[test]
fn lfu_hand_sequence_differs_from_lru() {
    // 2 slots. Requests A A B C B C, counts never decay (half-life 1000 tokens):
    // A miss (A=1), A hit (A=2), B miss (B=1) -> [A B]; C miss (C=1): lowest count is
    // B (1 < 2) -> evict B; B miss (B=2): A=2, C=1 -> evict C; C miss (C=2): A=2 and
    // B=2 tie, A was requested longer ago -> evict A. Final [B C]; 5 misses.
    // LRU on the same sequence: C evicts A (A last used 2nd, B 3rd) -> [B C]; B hit;
    // C hit: 4 misses, 2 hits.
    let lfu = cache(20, &[10], 1, PolicyKind::Lfu { half_life: 1000 });
    let lru = cache(20, &[10], 1, PolicyKind::Lru);
    let (a, b, cc) = (key(1, 0), key(1, 1), key(1, 2));
    let seq = [a, a, b, cc, b, cc];
    let h_lfu: Vec<bool> = seq.iter().map(|&k| request(&lfu, k)).collect();
    let h_lru: Vec<bool> = seq.iter().map(|&k| request(&lru, k)).collect();
    assert_eq!(h_lfu, [false, true, false, false, false, false]);
    assert_eq!(h_lru, [false, true, false, false, true, true]);
    assert!(!lfu.contains(a) && lfu.contains(b) && lfu.contains(cc));
}

#[test]
fn lfu_decay_lets_a_new_hot_expert_win() {
    // Policy level. A requested 4 times, B twice. No decay: victim = B (2 < 4).
    // Half-life 1 token: 2 token ends halve A 4 -> 2 -> 1 (B not yet requested), then
    // B requested twice = 2: victim = A (1 < 2).
    for (half_life, expect_a) in [(1000, false), (1, true)] {
        let mut p = Lfu::new(half_life);
        let (a, b) = (key(0, 0), key(0, 1));
        for _ in 0..4 {
            p.on_request(a);
        }
        p.on_insert(a);
        p.on_token_end();
        p.on_token_end();
        p.on_request(b);
        p.on_insert(b);
        p.on_request(b);
        let v = p.victim(&mut |_| true).unwrap();
        assert_eq!(v == a, expect_a, "half_life {half_life}");
        if half_life == 1 {
            assert_eq!((p.count(a), p.count(b)), (1, 2));
        }
    }
}

#[test]
fn lru2_hand_sequence() {
    // Requests at ticks 1..4: A B A C (each inserted after its first request).
    // (second-to-last, last): A (1,3), B (0,2), C (0,4). Victim: no second request wins,
    // B older than C -> B. Then B requested at tick 5: B (2,5); victim C (0,4).
    let mut p = Lru2::default();
    let (a, b, c) = (key(0, 0), key(0, 1), key(0, 2));
    for k in [a, b, a, c] {
        p.on_request(k);
        p.on_insert(k); // re-insert of a cached key is a no-op reorder
    }
    assert_eq!(p.victim(&mut |_| true), Some(b));
    p.on_request(b);
    assert_eq!(p.victim(&mut |_| true), Some(c));
    // The filter is honoured: with C unevictable, A (1,3) beats B (2,5).
    assert_eq!(p.victim(&mut |k| k != c), Some(a));
}

#[test]
fn pinned_slot_is_never_evicted_and_full_pins_give_budget_error() {
    // 2 slots; pin both, a third reserve must fail naming need and pinned bytes.
    let c = cache(20, &[10], 2, PolicyKind::Lru);
    let r = c.reserve(key(0, 0), 0).unwrap();
    let p0 = c.fill(r.ticket, r.buf, &[]).unwrap();
    let r = c.reserve(key(0, 1), 0).unwrap();
    let p1 = c.fill(r.ticket, r.buf, &[]).unwrap();
    match c.reserve(key(0, 2), 0) {
        Err(CacheError::BudgetTooSmall {
            need: 10,
            budget: 20,
            pinned: 20,
            in_flight: 0,
            ..
        }) => {}
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("reserve succeeded with every slot pinned"),
    }
    drop(p0);
    let r = c.reserve(key(0, 2), 0).unwrap();
    assert!(!c.contains(key(0, 0)), "the unpinned one was evicted");
    assert!(c.contains(key(0, 1)));
    assert!(matches!(c.lookup(key(0, 2)), Lookup::Pending));
    c.release_failed(r.ticket, Some(r.buf));
    assert!(!c.contains(key(0, 2)));
    drop(p1);
    c.check_invariants().unwrap();
}

#[test]
fn resident_entries_are_outside_the_budget_and_never_evicted() {
    let c = cache(10, &[10], 1, PolicyKind::Lru);
    let r = c.reserve_resident(key(0, 9), 0).unwrap();
    drop(c.fill(r.ticket, r.buf, &[]).unwrap());
    for e in 0..5 {
        request(&c, key(1, e));
    }
    assert!(c.lookup(key(0, 9)).is_hit());
    let s = c.stats();
    assert_eq!((s.resident_bytes, s.resident_entries), (10, 1));
    assert_eq!(s.bytes_allocated, 10);
    assert_eq!(s.total.evictions, 4);
}

#[test]
fn wrong_buffer_is_refused_and_slot_released() {
    let c = cache(20, &[10], 1, PolicyKind::Lru);
    let r = c.reserve(key(0, 0), 0).unwrap();
    let err = c.fill(r.ticket, vec![0u8; 3], &[]).err().unwrap();
    assert_eq!(
        err,
        CacheError::WrongBuffer {
            key: key(0, 0),
            expected: 10,
            found: 3
        }
    );
    assert!(!c.contains(key(0, 0)));
    assert_eq!(c.stats().bytes_allocated, 0);
    c.check_invariants().unwrap();
}

#[test]
fn mixed_classes_release_free_slots_of_another_class() {
    // Budget 40: fill 4 small (10) slots, evict them all; a 40-byte class slot then needs
    // the 4 small slots' memory: they are evicted and released (slot_frees = 4).
    let c = cache(40, &[10, 40], 1, PolicyKind::Lru);
    for e in 0..4 {
        request(&c, key(0, e));
    }
    let r = c.reserve(key(1, 0), 1).unwrap();
    let s = c.stats();
    assert_eq!(s.slot_frees, 4);
    assert_eq!(s.bytes_in_flight, 40);
    assert_eq!(s.bytes_cached, 0);
    c.fill(r.ticket, r.buf, &[]).unwrap();
    c.check_invariants().unwrap();
}

/// Records the slot memory a [`SlotMemory`] hook is told about: address -> length, and
/// every call that would be wrong (a range added twice, or removed when not added).
#[derive(Default)]
struct Ranges {
    live: Mutex<BTreeMap<usize, usize>>,
    errors: Mutex<Vec<String>>,
}

impl SlotMemory for Ranges {
    fn added(&self, addr: usize, len: usize) {
        if self.live.lock().unwrap().insert(addr, len).is_some() {
            self.errors
                .lock()
                .unwrap()
                .push(format!("{addr:#x} added twice"));
        }
    }
    fn removed(&self, addr: usize, len: usize) {
        if self.live.lock().unwrap().remove(&addr) != Some(len) {
            self.errors
                .lock()
                .unwrap()
                .push(format!("{addr:#x}+{len} removed, not added"));
        }
    }
}

/// The slot-memory hook hears of the slots that exist when it is set, of each slot allocated
/// or released later (mixed classes force releases), and of every slot when the cache is
/// dropped; the ranges it holds are always exactly the live slots' buffers.
#[test]
fn slot_memory_hook_sees_every_slot_until_released() {
    let c = cache(40, &[10, 40], 1, PolicyKind::Lru);
    request(&c, key(0, 0));
    request(&c, key(0, 1));
    let h = Arc::new(Ranges::default());
    c.set_slot_memory(h.clone());
    assert_eq!(h.live.lock().unwrap().len(), 2);
    assert!(h.live.lock().unwrap().values().all(|&l| l == 10));
    // The pinned slot's buffer is one of the ranges.
    let Lookup::Hit(p) = c.lookup(key(0, 0)) else {
        panic!("cached")
    };
    let a = p.bytes().as_ptr() as usize;
    assert_eq!(h.live.lock().unwrap().get(&a), Some(&10));
    drop(p);
    request(&c, key(0, 2));
    request(&c, key(0, 3));
    assert_eq!(h.live.lock().unwrap().len(), 4);
    // A 40-byte slot releases the four small ones first.
    let r = c.reserve(key(1, 0), 1).unwrap();
    assert_eq!(c.stats().slot_frees, 4);
    let live: Vec<usize> = h.live.lock().unwrap().values().copied().collect();
    assert_eq!(live, vec![40]);
    assert_eq!(
        h.live.lock().unwrap().keys().next(),
        Some(&(r.buf.as_ptr() as usize))
    );
    c.fill(r.ticket, r.buf, &[]).unwrap();
    drop(c);
    assert!(
        h.live.lock().unwrap().is_empty(),
        "dropped cache left ranges"
    );
    assert!(
        h.errors.lock().unwrap().is_empty(),
        "{:?}",
        h.errors.lock().unwrap()
    );
}

#[derive(Debug, Clone)]
enum Op {
    Lookup(u32, u32),
    Reserve(u32, u32),
    Fill(usize),
    Fail(usize, bool),
    Unpin(usize),
    EndToken,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..3, 0u32..6).prop_map(|(l, e)| Op::Lookup(l, e)),
        4 => (0u32..3, 0u32..6).prop_map(|(l, e)| Op::Reserve(l, e)),
        3 => any::<usize>().prop_map(Op::Fill),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, b)| Op::Fail(i, b)),
        3 => any::<usize>().prop_map(Op::Unpin),
        1 => Just(Op::EndToken),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random lookups / reserves / fills / failures / pins / unpins with tiny budgets and
    /// three size classes: the budget holds after every step, pinned entries stay cached
    /// with their bytes intact, and a BudgetTooSmall only happens when pinned + in-flight
    /// bytes (tracked by the test itself) leave no room.
    #[test]
    fn budget_never_exceeded(ops in prop::collection::vec(op(), 1..200),
                             extra in 0u64..60,
                             policy in 0usize..3) {
        let sizes = [8usize, 16, 24];
        let kind = [PolicyKind::Lru, PolicyKind::Lfu { half_life: 2 }, PolicyKind::Lru2][policy];
        let budget = 2 * 24 + extra; // top_k 2 x largest class, plus a little
        let c = ExpertCache::<Vec<u8>>::new(
            CacheConfig { budget, slot_sizes: sizes.to_vec(), top_k: 2, n_layer: 3 },
            kind.build(),
        ).unwrap();
        let mut pins: Vec<Pinned<Vec<u8>>> = Vec::new();
        let mut pending: Vec<(Reservation<Vec<u8>>, usize)> = Vec::new();
        for op in ops {
            match op {
                Op::Lookup(l, e) => {
                    if let Lookup::Hit(p) = c.lookup(key(l, e)) {
                        pins.push(p);
                    }
                }
                Op::Reserve(l, e) => {
                    let k = key(l, e);
                    let class = l as usize; // one class per layer
                    let present = c.contains(k);
                    match c.reserve(k, class) {
                        Ok(r) => { prop_assert!(!present); pending.push((r, sizes[class])); }
                        Err(CacheError::AlreadyPresent { .. }) => prop_assert!(present),
                        Err(CacheError::BudgetTooSmall { need, pinned, in_flight, .. }) => {
                            let mut keys: Vec<_> = pins.iter().map(|p| (p.key(), p.bytes().len())).collect();
                            keys.sort();
                            keys.dedup();
                            let my_pinned: u64 = keys.iter().map(|k| k.1 as u64).sum();
                            let my_flight: u64 = pending.iter().map(|p| p.1 as u64).sum();
                            prop_assert_eq!(pinned, my_pinned);
                            prop_assert_eq!(in_flight, my_flight);
                            prop_assert!(need + pinned + in_flight > budget);
                        }
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                Op::Fill(i) if !pending.is_empty() => {
                    let (mut r, len) = pending.swap_remove(i % pending.len());
                    let k = r.ticket.key();
                    prop_assert_eq!(r.buf.len(), len);
                    r.buf.copy_from_slice(&pattern(k, len));
                    pins.push(c.fill(r.ticket, r.buf, &[0]).unwrap());
                }
                Op::Fail(i, keep) if !pending.is_empty() => {
                    let (r, _) = pending.swap_remove(i % pending.len());
                    c.release_failed(r.ticket, keep.then_some(r.buf));
                }
                Op::Unpin(i) if !pins.is_empty() => {
                    pins.swap_remove(i % pins.len());
                }
                Op::EndToken => c.end_token(),
                _ => {}
            }
            prop_assert_eq!(c.check_invariants(), Ok(()));
            let s = c.stats();
            prop_assert!(s.bytes_allocated <= budget);
            prop_assert!(s.peak_bytes <= budget && s.peak_allocated <= budget);
            for p in &pins {
                prop_assert!(c.contains(p.key()), "pinned {} was evicted", p.key());
                prop_assert_eq!(p.bytes(), &pattern(p.key(), p.bytes().len())[..]);
            }
        }
    }

    /// One size class, budget for `n` slots, random requests: the cache allocates at most
    /// `n` slots, exactly min(n, distinct keys) of them, however many misses there are.
    #[test]
    fn slots_are_reused(n in 1usize..6, reqs in prop::collection::vec((0u32..2, 0u32..8), 1..300)) {
        let c = cache(10 * n as u64, &[10], 1, PolicyKind::Lru);
        for &(l, e) in &reqs {
            request(&c, key(l, e));
        }
        let mut distinct = reqs.clone();
        distinct.sort();
        distinct.dedup();
        let s = c.stats();
        prop_assert_eq!(s.slot_allocations as usize, n.min(distinct.len()));
        prop_assert_eq!(s.slot_frees, 0);
        prop_assert_eq!(s.total.misses, s.slot_allocations + s.total.evictions);
    }
}
