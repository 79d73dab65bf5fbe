//! Choosing the next token from logits: repetition/frequency/presence penalties over the
//! last N tokens (llama.cpp semantics), then top-k, top-p, min-p, temperature and a seeded
//! draw (llama.cpp's default chain order). Temperature <= 0 means greedy (argmax, ties to
//! the lowest id). The RNG is a self-contained xoshiro256** seeded through splitmix64, so a
//! seed gives the same sequence on every platform.

/// Sampling settings. Defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05,
/// no repetition penalty (1.0) over the last 64 tokens, seed 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerConfig {
    /// <= 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    /// >= 1: off.
    pub top_p: f32,
    /// <= 0: off.
    pub min_p: f32,
    /// 1.0: off. Positive logits of recent tokens are divided by it, negative multiplied.
    pub repeat_penalty: f32,
    /// Subtracted once per occurrence of a recent token (0: off).
    pub frequency_penalty: f32,
    /// Subtracted once for any recent token (0: off).
    pub presence_penalty: f32,
    /// How many of the last tokens of `history` the penalties look at (0: none).
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Greedy decoding (argmax), no penalties.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        }
    }

    /// The one check `run`'s flags and the server's request fields both go through: a
    /// setting outside its range is refused with a message naming it. A repeat penalty of
    /// 0 (or below) would divide logits by zero or flip their sign, so it must be > 0.
    pub fn validate(&self) -> Result<(), String> {
        let p = self.repeat_penalty;
        if !p.is_finite() || p <= 0.0 {
            return Err(format!("repeat_penalty must be greater than 0 (got {p})"));
        }
        for (name, v) in [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !v.is_finite() {
                return Err(format!("{name} must be a finite number (got {v})"));
            }
        }
        Ok(())
    }
}

/// xoshiro256** (Blackman & Vigna), seeded with splitmix64.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A stateful sampler (the RNG advances with each draw).
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        Sampler {
            rng: Rng::new(cfg.seed),
            cfg,
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token. `history` is the tokens so far (prompt and generated), for
    /// the penalties. Empty `logits` yields 0.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let mut logits = logits.to_vec();
        self.apply_penalties(&mut logits, history);
        if self.cfg.temperature <= 0.0 || self.cfg.top_k == 1 {
            return argmax(&logits);
        }
        let cands = self.filtered(&logits);
        if cands.is_empty() {
            return argmax(&logits);
        }
        let u = self.rng.next_f64();
        let mut acc = 0.0f64;
        for &(id, p) in &cands {
            acc += p as f64;
            if u < acc {
                return id;
            }
        }
        cands[cands.len() - 1].0
    }

    /// The distribution the next draw uses, after penalties, top-k, top-p, min-p and
    /// temperature: (id, probability) by descending probability (ties by id). Greedy
    /// settings give the argmax with probability 1.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let mut logits = logits.to_vec();
        self.apply_penalties(&mut logits, history);
        if logits.is_empty() {
            return Vec::new();
        }
        if self.cfg.temperature <= 0.0 || self.cfg.top_k == 1 {
            return vec![(argmax(&logits), 1.0)];
        }
        self.filtered(&logits)
    }

    fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        let c = &self.cfg;
        if c.repeat_last_n == 0
            || (c.repeat_penalty == 1.0 && c.frequency_penalty == 0.0 && c.presence_penalty == 0.0)
        {
            return;
        }
        let recent = &history[history.len().saturating_sub(c.repeat_last_n)..];
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in recent {
            *counts.entry(t).or_insert(0) += 1;
        }
        for (&t, &n) in &counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if *l <= 0.0 {
                *l *= c.repeat_penalty;
            } else {
                *l /= c.repeat_penalty;
            }
            *l -= n as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }

    /// top-k -> top-p -> min-p on the untempered distribution, then temperature; returns
    /// normalized probabilities, highest first.
    fn filtered(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let c = &self.cfg;
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, l))
            .collect();
        if cands.is_empty() {
            return cands;
        }
        if c.top_k > 0 && c.top_k < cands.len() {
            cands.select_nth_unstable_by(c.top_k - 1, by_logit);
            cands.truncate(c.top_k);
        }
        cands.sort_unstable_by(by_logit);

        let probs = |cands: &[(u32, f32)], temp: f32| -> Vec<f32> {
            let max = cands[0].1;
            let e: Vec<f64> = cands
                .iter()
                // `l == max` first so that infinite logits give weight 1, not NaN.
                .map(|&(_, l)| {
                    if l == max {
                        1.0
                    } else {
                        (((l - max) / temp) as f64).exp()
                    }
                })
                .collect();
            let sum: f64 = e.iter().sum();
            e.iter().map(|&x| (x / sum) as f32).collect()
        };
        if c.top_p < 1.0 {
            let p = probs(&cands, 1.0);
            let mut cum = 0.0f32;
            let mut keep = cands.len();
            for (i, &pi) in p.iter().enumerate() {
                cum += pi;
                if cum >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep.max(1));
        }
        if c.min_p > 0.0 {
            let p = probs(&cands, 1.0);
            let thresh = p[0] * c.min_p;
            let keep = p.iter().take_while(|&&pi| pi >= thresh).count();
            cands.truncate(keep.max(1));
        }
        let p = probs(&cands, c.temperature);
        cands.iter().zip(p).map(|(&(id, _), p)| (id, p)).collect()
    }
}

/// Index of the largest logit; ties go to the lowest id; NaN is never chosen.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if !v.is_nan() && (!found || v > best_v) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            ..SamplerConfig::default()
        }
    }

    /// ln of a hand-chosen distribution: softmax gives it back exactly.
    fn ln(p: &[f32]) -> Vec<f32> {
        p.iter().map(|x| x.ln()).collect()
    }

    #[test]
    fn greedy_is_argmax_with_ties_to_lowest_id() {
        let logits = [0.1, 3.0, -2.0, 3.0, f32::NAN];
        assert_eq!(argmax(&logits), 1);
        assert_eq!(
            Sampler::new(SamplerConfig::greedy()).sample(&logits, &[]),
            1
        );
        // temperature 0 and top-k 1 are greedy whatever the seed.
        for seed in 0..20 {
            assert_eq!(
                Sampler::new(cfg(0.0, 0, 1.0, 0.0, seed)).sample(&logits, &[]),
                1
            );
            assert_eq!(
                Sampler::new(cfg(1.5, 1, 1.0, 0.0, seed)).sample(&logits, &[]),
                1
            );
        }
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits = ln(&[0.2, 0.2, 0.2, 0.2, 0.2]);
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0, 1.0, 0.0, seed));
            (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        // A uniform distribution over 5 tokens: 50 draws reach more than one token.
        assert!(run(7).iter().any(|&t| t != run(7)[0]));
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // 0.5 < 0.7 <= 0.5 + 0.3: keep {0, 1}, renormalized to 0.625 / 0.375.
        let s = Sampler::new(cfg(1.0, 0, 0.7, 0.0, 1));
        let d = s.distribution(&ln(&[0.5, 0.3, 0.15, 0.05]), &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!(
            (d[0].1 - 0.625).abs() < 1e-5 && (d[1].1 - 0.375).abs() < 1e-5,
            "{d:?}"
        );
        let mut s = Sampler::new(cfg(1.0, 0, 0.7, 0.0, 3));
        let logits = ln(&[0.5, 0.3, 0.15, 0.05]);
        let draws: Vec<u32> = (0..200).map(|_| s.sample(&logits, &[])).collect();
        assert!(draws.iter().all(|&t| t <= 1));
        assert!(draws.contains(&0) && draws.contains(&1));
    }

    #[test]
    fn min_p_drops_tokens_below_fraction_of_max() {
        // threshold 0.25 * 0.5 = 0.125: 0.15 stays, 0.05 goes; probabilities / 0.95.
        let s = Sampler::new(cfg(1.0, 0, 1.0, 0.25, 1));
        let d = s.distribution(&ln(&[0.05, 0.5, 0.15, 0.3]), &[]);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        for (&(_, p), want) in d.iter().zip([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95]) {
            assert!((p - want).abs() < 1e-5, "{d:?}");
        }
    }

    #[test]
    fn top_k_and_temperature() {
        // top-k 2 of [0.1, 0.6, 0.3] keeps {1, 2} -> 0.6/0.9, 0.3/0.9.
        let s = Sampler::new(cfg(1.0, 2, 1.0, 0.0, 1));
        let d = s.distribution(&ln(&[0.1, 0.6, 0.3]), &[]);
        assert_eq!((d[0].0, d[1].0), (1, 2));
        assert!((d[0].1 - 2.0 / 3.0).abs() < 1e-5);
        // temperature 0.5 squares the ratios: 0.36 : 0.09 -> 0.8 / 0.2.
        let s = Sampler::new(cfg(0.5, 2, 1.0, 0.0, 1));
        let d = s.distribution(&ln(&[0.1, 0.6, 0.3]), &[]);
        assert!((d[0].1 - 0.8).abs() < 1e-5, "{d:?}");
    }

    #[test]
    fn infinite_and_nan_logits_do_not_break_sampling() {
        let mut s = Sampler::new(cfg(1.0, 0, 0.9, 0.05, 5));
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, f32::INFINITY, f32::NAN, 1.0], &[]), 1);
        }
        assert_eq!(s.sample(&[], &[]), 0);
        assert_eq!(s.sample(&[f32::NAN, f32::NAN], &[]), 0);
    }

    #[test]
    fn validate_refuses_non_positive_repeat_penalty() {
        for p in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let c = SamplerConfig {
                repeat_penalty: p,
                ..Default::default()
            };
            let e = c.validate().unwrap_err();
            assert!(e.contains("repeat_penalty"), "{e}");
        }
        assert!(SamplerConfig::default().validate().is_ok());
        let c = SamplerConfig {
            repeat_penalty: 0.5,
            ..SamplerConfig::greedy()
        };
        assert!(c.validate().is_ok());
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            repeat_last_n: 2,
            ..SamplerConfig::greedy()
        };
        let s = Sampler::new(c);
        // history's last 2 = [0, 1]: 2.0 -> 1.0, -1.0 -> -2.0; token 2 (1.5) now wins.
        assert_eq!(
            s.distribution(&[2.0, -1.0, 1.5], &[2, 0, 1]),
            vec![(2, 1.0)]
        );
        // Token 2 is outside the window of 2, so only 0 and 1 are penalized.
        let c = SamplerConfig {
            repeat_penalty: 2.0,
            repeat_last_n: 2,
            ..SamplerConfig::greedy()
        };
        assert_eq!(Sampler::new(c).sample(&[2.0, -1.0, 1.9], &[2, 0, 1]), 2);
        assert_eq!(Sampler::new(c).sample(&[2.0, -1.0, 0.9], &[2, 0, 1]), 0);
    }
}
