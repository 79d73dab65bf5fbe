//! Cross-layer expected next use: the [`CrossLayer`] eviction policy (`--cache-policy xl`).
//!
//! Owns: the online, decayed co-occurrence counts of routed experts (which experts a layer
//! visit selects given the sets of the visits before it: the same token's earlier layers,
//! and the same layer at the previous token), the next-visit predictions made from them,
//! and the eviction rule that uses those predictions in place of the plain selection rate
//! of [`super::policy::NextUse`]. Everything is learned from the requests seen so far.

use std::collections::BTreeSet;

use super::key::ExpertKey;
use super::policy::Policy;

/// Sets larger than this (a prefill batch's union) neither teach nor predict anything: a
/// union of many tokens says little about one token, and it bounds the cost of a visit.
pub const MAX_SOURCE: usize = 16;

/// Tuning of [`CrossLayer`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct XlConfig {
    /// Half-life of the selection rates, in tokens.
    pub half_life: u32,
    /// Half-life of the co-occurrence counts, in tokens.
    pub pair_half_life: u32,
    /// Layers ahead whose next visit is predicted from the current token's sets.
    pub lags: usize,
    /// Weight of the marginal rate as a prior of every conditional estimate, in
    /// observations.
    pub prior: f64,
    /// Predict every layer's next visit from its own previous visit too.
    pub temporal: bool,
    /// Sources of the cross-layer prediction: 0 = the current (partly known) visit, 1 = the
    /// last complete visit, 2 = both.
    pub source: u8,
}

impl Default for XlConfig {
    fn default() -> XlConfig {
        XlConfig {
            half_life: 64,
            pair_half_life: 256,
            lags: 2,
            prior: 1.0,
            temporal: true,
            source: 0,
        }
    }
}

/// Decayed co-occurrence counts from a source visit's set to a target visit's set.
#[derive(Default)]
struct Pairs {
    /// `m[a * n + b]`: weight of visits where `a` was in the source set and `b` in the target.
    m: Vec<f32>,
    /// `src[a]`: weight of visits where `a` was in the source set.
    src: Vec<f32>,
}

impl Pairs {
    fn resize(&mut self, old: usize, n: usize) {
        let mut m = vec![0f32; n * n];
        for a in 0..old {
            m[a * n..a * n + old].copy_from_slice(&self.m[a * old..(a + 1) * old]);
        }
        self.m = m;
        self.src.resize(n, 0.0);
    }

    fn add(&mut self, n: usize, from: &[u32], to: &[u32], w: f32) {
        for &a in from {
            let a = a as usize;
            self.src[a] += w;
            let row = &mut self.m[a * n..(a + 1) * n];
            for &b in to {
                row[b as usize] += w;
            }
        }
    }

    /// Mean over `from` of P(b in target | a in source), each smoothed towards `pb` with
    /// `prior` observations (already in the pair weights' units).
    fn predict(&self, n: usize, from: &[u32], b: usize, pb: f64, prior: f64) -> f64 {
        if from.is_empty() {
            return pb;
        }
        let mut s = 0.0;
        for &a in from {
            let a = a as usize;
            s += (f64::from(self.m[a * n + b]) + prior * pb) / (f64::from(self.src[a]) + prior);
        }
        s / from.len() as f64
    }

    fn scale(&mut self, by: f32) {
        self.m.iter_mut().for_each(|x| *x *= by);
        self.src.iter_mut().for_each(|x| *x *= by);
    }
}

/// One MoE layer's statistics, indexed by expert.
struct Layer {
    id: u32,
    /// Decayed visits of this layer (rate units).
    visits: f64,
    /// Decayed selections and last request tick of every expert.
    count: Vec<f64>,
    last: Vec<u64>,
    /// The set its last complete visit selected.
    prev: Vec<u32>,
    /// Predicted probability of selection at the next visit (from `prev` through
    /// `temporal`), per expert.
    tq: Vec<f64>,
    /// Its previous visit's set -> this visit's set.
    temporal: Pairs,
    /// `cross[j - 1]`: the set of the layer `j` visits earlier in the cycle -> this visit.
    cross: Vec<Pairs>,
    /// Cached experts, by (extra cycles to the next request, reversed tick, expert): the
    /// last entry goes first.
    order: BTreeSet<(u64, u64, u32)>,
    /// Per expert: its entry in `order` while cached.
    filed: Vec<Option<(u64, u64)>>,
}

/// Expected next use with cross-layer and token-to-token prediction.
///
/// Like [`super::policy::NextUse`], the victim is the cached expert whose next request is
/// expected farthest: after `d` layer visits to the next visit of its layer, it is selected
/// there with probability `q`, and otherwise after `N / p` more visits on average (`p` its
/// decayed selection rate, `N` the layers of the cycle): `E = d + N (1 - q) / p`. `NextUse`
/// has `q = p`. Here `q` is predicted:
/// - for every layer, from the set its previous visit selected: the mean over that set's
///   experts `a` of the decayed P(`b` next visit | `a` this visit);
/// - for the next `lags` layers of the current token, also from the sets already selected
///   in this token (the current visit, partly known, `d` layers before; or the last complete
///   one): the mean over that set of the decayed P(`b` at this layer | `a` there), combined
///   with the first estimate as independent evidence (odds multiplied, over the prior odds).
///
/// Cost per request: a few map and ordered-set updates; per layer visit, `k^2 (lags + 1)`
/// counter updates and `k n` for the next-visit prediction; per victim, the cached experts
/// of the next `lags` layers times `k`, plus one ordered-set look per layer. Memory:
/// `lags + 1` tables of `n x n` f32 per layer (48 layers of 128 experts, lags 2: 9.4 MiB;
/// 61 of 256: 48 MiB). Sets of more than [`MAX_SOURCE`] experts (prefill batches) are not
/// learned from nor predicted from.
pub struct CrossLayer {
    cfg: XlConfig,
    /// Weight factors per token of rates and of pairs (`2^(1 / half_life)`).
    step: f64,
    pair_step: f64,
    /// Weight a request (rates) and a visit (pairs) get now.
    w: f64,
    wp: f64,
    tick: u64,
    /// Experts per layer in the dense tables (grows with the largest id seen).
    n: usize,
    layers: Vec<Layer>,
    cur: usize,
    cur_layer: Option<u32>,
    /// Experts requested in the current visit so far.
    cur_set: Vec<u32>,
    /// Scratch row for the next-visit prediction.
    acc: Vec<f64>,
}

impl CrossLayer {
    pub fn new(cfg: XlConfig) -> CrossLayer {
        CrossLayer {
            step: (2f64).powf(1.0 / f64::from(cfg.half_life.max(1))),
            pair_step: (2f64).powf(1.0 / f64::from(cfg.pair_half_life.max(1))),
            cfg,
            w: 1.0,
            wp: 1.0,
            tick: 0,
            n: 0,
            layers: Vec::new(),
            cur: 0,
            cur_layer: None,
            cur_set: Vec::new(),
            acc: Vec::new(),
        }
    }

    fn ensure(&mut self, e: u32) {
        let need = e as usize + 1;
        if need <= self.n {
            return;
        }
        let n = need.next_power_of_two().max(8);
        let old = self.n;
        for l in &mut self.layers {
            Self::resize_layer(l, old, n);
        }
        self.n = n;
    }

    fn resize_layer(l: &mut Layer, old: usize, n: usize) {
        l.count.resize(n, 0.0);
        l.last.resize(n, 0);
        l.tq.resize(n, 0.0);
        l.filed.resize(n, None);
        l.temporal.resize(old, n);
        for c in &mut l.cross {
            c.resize(old, n);
        }
    }

    fn ordinal(&mut self, layer: u32) -> usize {
        match self.layers.binary_search_by_key(&layer, |l| l.id) {
            Ok(i) => i,
            Err(i) => {
                let mut l = Layer {
                    id: layer,
                    visits: 0.0,
                    count: Vec::new(),
                    last: Vec::new(),
                    prev: Vec::new(),
                    tq: Vec::new(),
                    temporal: Pairs::default(),
                    cross: (0..self.cfg.lags + usize::from(self.cfg.source != 0))
                        .map(|_| Pairs::default())
                        .collect(),
                    order: BTreeSet::new(),
                    filed: Vec::new(),
                };
                Self::resize_layer(&mut l, 0, self.n);
                self.layers.insert(i, l);
                if self.cur_layer.is_some() && self.cur >= i {
                    self.cur += 1;
                }
                i
            }
        }
    }

    /// Marginal selection rate of expert `e` of layer ordinal `o`.
    fn rate(&self, o: usize, e: usize) -> f64 {
        let l = &self.layers[o];
        let c = l.count[e];
        if c <= 0.0 {
            0.0
        } else {
            c / l.visits.max(c)
        }
    }

    /// Filed value of a cached expert: extra cycles to its next request, `(1 - q) / p`
    /// (infinite for an expert never selected).
    fn extra(&self, o: usize, e: usize) -> f64 {
        let p = self.rate(o, e);
        if p <= 0.0 {
            f64::INFINITY
        } else {
            (1.0 - self.layers[o].tq[e].clamp(0.0, 1.0)) / p
        }
    }

    /// (Re)files expert `e` of ordinal `o` as cached.
    fn file(&mut self, o: usize, e: u32) {
        let i = e as usize;
        let entry = (
            self.extra(o, i).to_bits(),
            u64::MAX - self.layers[o].last[i],
        );
        let l = &mut self.layers[o];
        if let Some(old) = l.filed[i].replace(entry) {
            l.order.remove(&(old.0, old.1, e));
        }
        l.order.insert((entry.0, entry.1, e));
    }

    fn refile_layer(&mut self, o: usize) {
        let keys: Vec<u32> = self.layers[o].order.iter().map(|x| x.2).collect();
        for e in keys {
            self.file(o, e);
        }
    }

    /// The current visit (of ordinal `cur`) is complete: learn from its set and predict
    /// the layer's next visit.
    fn complete_visit(&mut self) {
        if self.cur_layer.take().is_none() {
            return;
        }
        let o = self.cur;
        let n = self.n;
        let set = std::mem::take(&mut self.cur_set);
        let nl = self.layers.len();
        let wp = self.wp as f32;
        let small = |s: &[u32]| !s.is_empty() && s.len() <= MAX_SOURCE;
        if small(&set) {
            for j in 1..=self.layers[o].cross.len() {
                if j >= nl {
                    break;
                }
                let s = (o + nl - j) % nl;
                let from = std::mem::take(&mut self.layers[s].prev);
                if small(&from) {
                    self.layers[o].cross[j - 1].add(n, &from, &set, wp);
                }
                self.layers[s].prev = from;
            }
            let prev = std::mem::take(&mut self.layers[o].prev);
            if small(&prev) {
                self.layers[o].temporal.add(n, &prev, &set, wp);
            }
        }
        // tq[b] = mean over a in set of (m[a][b] + prior p_b) / (src[a] + prior), i.e.
        // `Pairs::predict` for every b at once.
        let prior = self.cfg.prior * self.wp;
        let mut acc = std::mem::take(&mut self.acc);
        acc.clear();
        acc.resize(n, 0.0);
        let learn = self.cfg.temporal && small(&set);
        let mut inv_sum = 0.0;
        if learn {
            let t = &self.layers[o].temporal;
            for &a in &set {
                let a = a as usize;
                let inv = 1.0 / (f64::from(t.src[a]) + prior);
                inv_sum += inv;
                for (x, &m) in acc.iter_mut().zip(&t.m[a * n..(a + 1) * n]) {
                    *x += f64::from(m) * inv;
                }
            }
        }
        for (b, &x) in acc.iter().enumerate() {
            let pb = self.rate(o, b);
            self.layers[o].tq[b] = if learn {
                (x + prior * pb * inv_sum) / set.len() as f64
            } else {
                pb
            };
        }
        self.acc = acc;
        self.layers[o].prev = set;
        self.refile_layer(o);
        self.cur_set = Vec::with_capacity(self.layers[o].prev.len());
    }

    /// Predicted probability that expert `b` of ordinal `o` (`d` visits ahead, `d <=
    /// lags`) is selected at its next visit, from this token's known sets.
    fn window_q(&self, o: usize, d: usize, b: usize) -> f64 {
        let nl = self.layers.len();
        let l = &self.layers[o];
        let pb = self.rate(o, b);
        let prior = self.cfg.prior * self.wp;
        let mut est = [0.0; 3];
        let mut m = 0;
        if self.cfg.source != 1 && !self.cur_set.is_empty() && self.cur_set.len() <= MAX_SOURCE {
            est[m] = l.cross[d - 1].predict(self.n, &self.cur_set, b, pb, prior);
            m += 1;
        }
        let s = (self.cur + nl - 1) % nl;
        if self.cfg.source != 0 && d < nl && self.layers[s].prev.len() <= MAX_SOURCE {
            est[m] = l.cross[d].predict(self.n, &self.layers[s].prev, b, pb, prior);
            m += 1;
        }
        if self.cfg.temporal {
            est[m] = l.tq[b];
            m += 1;
        }
        combine(pb, &est[..m])
    }

    fn rescale(&mut self) {
        if self.w > 1e150 {
            let w = self.w;
            for l in &mut self.layers {
                l.visits /= w;
                l.count.iter_mut().for_each(|c| *c /= w);
            }
            self.w = 1.0;
            for o in 0..self.layers.len() {
                self.refile_layer(o);
            }
        }
        if self.wp > 1e30 {
            let by = (1.0 / self.wp) as f32;
            for l in &mut self.layers {
                l.temporal.scale(by);
                l.cross.iter_mut().for_each(|c| c.scale(by));
            }
            self.wp = 1.0;
        }
    }
}

/// Combines independent estimates of one probability whose prior is `p`: odds multiply,
/// divided by the prior odds once per extra estimate. No estimate gives `p`.
pub fn combine(p: f64, est: &[f64]) -> f64 {
    const LO: f64 = 1e-6;
    let odds = |x: f64| {
        let x = x.clamp(LO, 1.0 - LO);
        x / (1.0 - x)
    };
    let Some((&first, rest)) = est.split_first() else {
        return p;
    };
    let prior = odds(p);
    let o = rest
        .iter()
        .fold(odds(first), |acc, &e| acc * odds(e) / prior);
    o / (1.0 + o)
}

impl Policy for CrossLayer {
    fn name(&self) -> &'static str {
        "xl"
    }

    fn on_request(&mut self, key: ExpertKey) {
        self.tick += 1;
        self.ensure(key.expert);
        let o = self.ordinal(key.layer);
        if self.cur_layer != Some(key.layer) {
            self.complete_visit();
            self.cur = o;
            self.cur_layer = Some(key.layer);
            self.layers[o].visits += self.w;
        }
        let e = key.expert as usize;
        let (w, tick) = (self.w, self.tick);
        let l = &mut self.layers[o];
        l.count[e] += w;
        l.last[e] = tick;
        if !self.cur_set.contains(&key.expert) {
            self.cur_set.push(key.expert);
        }
        // A cached expert requested now is refiled when this visit completes (it is in
        // use, so not evictable, until then).
    }

    fn on_insert(&mut self, key: ExpertKey) {
        self.ensure(key.expert);
        let o = self.ordinal(key.layer);
        self.file(o, key.expert);
    }

    fn seed(&mut self, key: ExpertKey, weight: f64) {
        // As `NextUse`: a weak prior of a few tokens that this run's requests soon outweigh.
        self.ensure(key.expert);
        let o = self.ordinal(key.layer);
        let visits = super::policy::NextUse::SEED_TOKENS * self.w;
        let e = key.expert as usize;
        let l = &mut self.layers[o];
        l.visits = l.visits.max(visits);
        l.count[e] = l.count[e].max(weight.clamp(0.0, 1.0) * visits);
        if l.tq[e] <= 0.0 {
            l.tq[e] = weight.clamp(0.0, 1.0);
        }
        if l.filed[e].is_some() {
            self.file(o, key.expert);
        }
    }

    fn on_remove(&mut self, key: ExpertKey) {
        if let Ok(o) = self.layers.binary_search_by_key(&key.layer, |l| l.id) {
            let l = &mut self.layers[o];
            if let Some(old) = l.filed.get_mut(key.expert as usize).and_then(Option::take) {
                l.order.remove(&(old.0, old.1, key.expert));
            }
        }
    }

    fn on_token_end(&mut self) {
        if self.layers.len() == 1 {
            self.complete_visit();
        }
        self.w *= self.step;
        self.wp *= self.pair_step;
        self.rescale();
    }

    fn victim(&mut self, evictable: &mut dyn FnMut(ExpertKey) -> bool) -> Option<ExpertKey> {
        let nl = self.layers.len();
        let n = nl as f64;
        let window = |d: usize| d <= self.cfg.lags && d < nl && self.cur_layer.is_some();
        // (expected visits to the next request, -last tick, key): the largest wins.
        let mut best: Option<(f64, u64, ExpertKey)> = None;
        let consider = |best: &mut Option<(f64, u64, ExpertKey)>, x: f64, t: u64, k| {
            let better = match *best {
                None => true,
                Some((bx, bt, _)) => x > bx || (x == bx && t < bt),
            };
            if better {
                *best = Some((x, t, k));
            }
        };
        // Layers outside the window: their order is by expected next use.
        for (o, l) in self.layers.iter().enumerate() {
            let d = (o + nl - self.cur - 1) % nl + 1;
            if window(d) {
                continue;
            }
            if let Some(&(f, rt, e)) = l
                .order
                .iter()
                .rev()
                .find(|&&(_, _, e)| evictable(ExpertKey::new(l.id, e)))
            {
                let x = d as f64 + n * f64::from_bits(f);
                consider(&mut best, x, u64::MAX - rt, ExpertKey::new(l.id, e));
            }
        }
        // The window's layers: every cached expert, skipping those that cannot beat the
        // best so far even if surely not selected (q = 0).
        for (o, l) in self.layers.iter().enumerate() {
            let d = (o + nl - self.cur - 1) % nl + 1;
            if !window(d) {
                continue;
            }
            for &(_, rt, e) in &l.order {
                let p = self.rate(o, e as usize);
                if p > 0.0 && best.is_some_and(|b| d as f64 + n / p < b.0) {
                    continue;
                }
                let k = ExpertKey::new(l.id, e);
                if !evictable(k) {
                    continue;
                }
                let x = if p <= 0.0 {
                    f64::INFINITY
                } else {
                    d as f64 + n * (1.0 - self.window_q(o, d, e as usize)) / p
                };
                consider(&mut best, x, u64::MAX - rt, k);
            }
        }
        best.map(|b| b.2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_multiplies_odds_over_the_prior() {
        // No estimate: the prior. One estimate: itself.
        assert_eq!(combine(0.3, &[]), 0.3);
        assert!((combine(0.5, &[0.8]) - 0.8).abs() < 1e-12);
        // Prior 1/2 (odds 1): 0.8 and 0.8 are odds 4 x 4 = 16, i.e. 16/17.
        assert!((combine(0.5, &[0.8, 0.8]) - 16.0 / 17.0).abs() < 1e-12);
        // Odds 3 and 1/3 cancel: back to the prior's 1/2.
        assert!((combine(0.5, &[0.75, 0.25]) - 0.5).abs() < 1e-12);
        // Prior 0.2 (odds 1/4): two estimates of 1/2 (odds 1 each) give odds 4, i.e. 0.8.
        assert!((combine(0.2, &[0.5, 0.5]) - 0.8).abs() < 1e-12);
    }

    #[test]
    fn pairs_predict_the_smoothed_mean_conditional() {
        // 4 experts. Visit 1: source {0, 1} -> target {2}; visit 2: source {0} -> {3}.
        // src = [2, 1, 0, 0]; m[0][2] = 1, m[0][3] = 1, m[1][2] = 1.
        let mut p = Pairs::default();
        p.resize(0, 4);
        p.add(4, &[0, 1], &[2], 1.0);
        p.add(4, &[0], &[3], 1.0);
        // b = 2, marginal 0.5, prior 1: a = 0: (1 + 0.5) / (2 + 1) = 0.5;
        // a = 1: (1 + 0.5) / (1 + 1) = 0.75; mean 0.625.
        assert!((p.predict(4, &[0, 1], 2, 0.5, 1.0) - 0.625).abs() < 1e-12);
        // b = 3: a = 0: 1.5 / 3 = 0.5; a = 1: 0.5 / 2 = 0.25; mean 0.375.
        assert!((p.predict(4, &[0, 1], 3, 0.5, 1.0) - 0.375).abs() < 1e-12);
        // No source set: the marginal.
        assert_eq!(p.predict(4, &[], 3, 0.5, 1.0), 0.5);
        // Growing keeps the counts where they were.
        p.resize(4, 8);
        assert!((p.predict(8, &[0, 1], 2, 0.5, 1.0) - 0.625).abs() < 1e-12);
        assert_eq!(p.src[..4], [2.0, 1.0, 0.0, 0.0]);
    }
}
