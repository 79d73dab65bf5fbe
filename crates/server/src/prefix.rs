//! Session snapshots kept for prefix reuse, within a RAM budget.
//!
//! Owns: [`PrefixCache`]. A worker snapshots its sequence right before the last prompt
//! token (the prompt ends at a message boundary: the assistant turn opener), keyed by the
//! tokens the snapshot holds. A later request whose prompt extends those tokens restores
//! the snapshot and evaluates only the rest. Restoring a snapshot (rather than truncating
//! a live sequence) is what keeps this correct for architectures whose state cannot be
//! truncated. Least recently used entries go first when the budget is exceeded.

use std::sync::Arc;

use sluice_engine::Snapshot;

struct Entry {
    tokens: Arc<Vec<u32>>,
    snap: Arc<Snapshot>,
    bytes: u64,
    last_used: u64,
}

/// Snapshots keyed by the token prefix they hold.
pub struct PrefixCache {
    budget: u64,
    bytes: u64,
    clock: u64,
    entries: Vec<Entry>,
}

/// A snapshot found for a prompt.
pub struct Found {
    pub tokens: Arc<Vec<u32>>,
    pub snap: Arc<Snapshot>,
}

impl PrefixCache {
    pub fn new(budget: u64) -> PrefixCache {
        PrefixCache {
            budget,
            bytes: 0,
            clock: 0,
            entries: Vec::new(),
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether a snapshot of `bytes` could be kept at all.
    pub fn fits(&self, bytes: u64) -> bool {
        bytes > 0 && bytes <= self.budget
    }

    /// The longest snapshot whose tokens are a prefix of `prompt` (at most `max_len` long).
    pub fn lookup(&mut self, prompt: &[u32], max_len: usize) -> Option<Found> {
        self.clock += 1;
        let clock = self.clock;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.tokens.len() <= max_len && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len())?;
        best.last_used = clock;
        Some(Found {
            tokens: best.tokens.clone(),
            snap: best.snap.clone(),
        })
    }

    /// Whether exactly these tokens are already kept.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens.as_slice() == tokens)
    }

    /// Keep a snapshot of `tokens`; evicts least recently used entries to make room.
    pub fn insert(&mut self, tokens: Vec<u32>, snap: impl Into<Arc<Snapshot>>, bytes: u64) {
        if !self.fits(bytes) || self.contains(&tokens) {
            return;
        }
        // A snapshot whose tokens are a prefix of the new one is now redundant for
        // lookups that reach the new one, but shorter conversations may still need it:
        // keep it and let LRU decide.
        while self.bytes + bytes > self.budget && !self.entries.is_empty() {
            let (i, _) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .expect("not empty");
            let e = self.entries.swap_remove(i);
            self.bytes -= e.bytes;
        }
        self.clock += 1;
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens: Arc::new(tokens),
            snap: snap.into(),
            bytes,
            last_used: self.clock,
        });
    }
}
