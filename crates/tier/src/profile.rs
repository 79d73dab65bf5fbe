//! Popularity profiles: how often each routed expert was selected, saved to warm the cache
//! at start (`--preload-profile FILE`).
//!
//! Owns: the text format (below), building a profile from a routing trace
//! ([`Profile::from_trace`]), writing it atomically (`FILE.tmp`, renamed) and reading it
//! with validation ([`Profile::read`]), and the preload order ([`Profile::ranked`]).
//! Filling the cache from a profile is the streaming source's job; seeding a policy's
//! statistics is [`crate::Policy::seed`].
//!
//! Format v1 (text, one record a line, `#` starts a comment):
//! ```text
//! sluice-profile 1
//! model <name, may be empty>
//! shape <n_layer> <n_expert> <top_k> <tokens>
//! <layer> <expert> <rate>        rate = selections per token, 0..=1; one line per
//!                                expert selected at least once
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::cache::ExpertKey;
use crate::trace::RoutingTrace;

#[derive(Debug, Error)]
pub enum ProfileError {
    #[error("popularity profile {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("popularity profile {path}: line {line}: {what}")]
    Parse {
        path: PathBuf,
        line: usize,
        what: String,
    },
    #[error("popularity profile {path} does not fit this model: {what}")]
    Mismatch { path: PathBuf, what: String },
}

/// Selection rates of routed experts.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub model: String,
    pub n_layer: u32,
    pub n_expert: u32,
    pub top_k: u32,
    /// Tokens the rates were counted over.
    pub tokens: u64,
    /// (key, selections per token), in file order.
    pub rates: Vec<(ExpertKey, f64)>,
}

impl Profile {
    /// Counts over `tokens` (a range of the trace's tokens; all of them if `None`).
    pub fn from_trace(trace: &RoutingTrace, tokens: Option<std::ops::Range<usize>>) -> Profile {
        let h = &trace.header;
        let moe = h.moe_layers();
        let k = h.top_k as usize;
        let range = tokens.unwrap_or(0..trace.n_tokens());
        let mut counts: HashMap<ExpertKey, u64> = HashMap::new();
        for t in range.clone() {
            let ids = trace.token(t);
            for (li, &layer) in moe.iter().enumerate() {
                for &e in &ids[li * k..(li + 1) * k] {
                    *counts
                        .entry(ExpertKey::new(layer, u32::from(e)))
                        .or_default() += 1;
                }
            }
        }
        let n = range.len().max(1) as f64;
        let mut rates: Vec<(ExpertKey, f64)> =
            counts.into_iter().map(|(k, c)| (k, c as f64 / n)).collect();
        rates.sort_by_key(|r| r.0);
        Profile {
            model: h.model.clone(),
            n_layer: h.n_layer,
            n_expert: h.n_expert,
            top_k: h.top_k,
            tokens: range.len() as u64,
            rates,
        }
    }

    /// Keys by falling rate (ties by layer, then expert): the preload order.
    pub fn ranked(&self) -> Vec<(ExpertKey, f64)> {
        let mut v = self.rates.clone();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v
    }

    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "sluice-profile 1");
        let _ = writeln!(s, "model {}", self.model.replace('\n', " "));
        let _ = writeln!(
            s,
            "shape {} {} {} {}",
            self.n_layer, self.n_expert, self.top_k, self.tokens
        );
        for (k, r) in &self.rates {
            let _ = writeln!(s, "{} {} {r:.6}", k.layer, k.expert);
        }
        s
    }

    /// Writes under `path.tmp`, then renames.
    pub fn write(&self, path: &Path) -> Result<(), ProfileError> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let r = std::fs::write(&tmp, self.to_text()).and_then(|_| std::fs::rename(&tmp, path));
        r.map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            ProfileError::Io {
                path: path.to_path_buf(),
                source,
            }
        })
    }

    pub fn read(path: &Path) -> Result<Profile, ProfileError> {
        let io = |source| ProfileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut text = String::new();
        std::io::Read::read_to_string(&mut crate::pack::open_regular(path).map_err(io)?, &mut text)
            .map_err(io)?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Profile, ProfileError> {
        let err = |line: usize, what: String| ProfileError::Parse {
            path: path.to_path_buf(),
            line,
            what,
        };
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l.split('#').next().unwrap_or("").trim()))
            .filter(|(_, l)| !l.is_empty());
        match lines.next() {
            Some((_, "sluice-profile 1")) => {}
            Some((n, l)) => {
                return Err(err(
                    n,
                    format!("expected \"sluice-profile 1\", found {l:?}"),
                ))
            }
            None => return Err(err(1, "empty file".into())),
        }
        let (n, l) = lines.next().ok_or_else(|| err(2, "no model line".into()))?;
        let model = l
            .strip_prefix("model")
            .ok_or_else(|| err(n, format!("expected \"model NAME\", found {l:?}")))?
            .trim()
            .to_string();
        let (n, l) = lines.next().ok_or_else(|| err(3, "no shape line".into()))?;
        let f: Vec<u64> = l
            .strip_prefix("shape ")
            .map(|r| {
                r.split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        if f.len() != 4 || f[0] == 0 || f[1] == 0 || f[0] > 4096 || f[1] > 65536 {
            return Err(err(
                n,
                format!("expected \"shape N_LAYER N_EXPERT TOP_K TOKENS\", found {l:?}"),
            ));
        }
        let (n_layer, n_expert) = (f[0] as u32, f[1] as u32);
        let mut rates = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for (n, l) in lines {
            let p: Vec<&str> = l.split_whitespace().collect();
            let parsed = (p.len() == 3)
                .then(|| {
                    Some((
                        p[0].parse::<u32>().ok()?,
                        p[1].parse::<u32>().ok()?,
                        p[2].parse::<f64>().ok()?,
                    ))
                })
                .flatten();
            let Some((layer, expert, rate)) = parsed else {
                return Err(err(
                    n,
                    format!("expected \"LAYER EXPERT RATE\", found {l:?}"),
                ));
            };
            if layer >= n_layer || expert >= n_expert || !(0.0..=1.0).contains(&rate) {
                return Err(err(
                    n,
                    format!("layer {layer} expert {expert} rate {rate} out of range"),
                ));
            }
            if !seen.insert((layer, expert)) {
                return Err(err(
                    n,
                    format!("layer {layer} expert {expert} listed twice"),
                ));
            }
            rates.push((ExpertKey::new(layer, expert), rate));
        }
        Ok(Profile {
            model,
            n_layer,
            n_expert,
            top_k: f[2] as u32,
            tokens: f[3],
            rates,
        })
    }

    /// Refuses a profile made for another shape of model.
    pub fn check(&self, path: &Path, n_layer: u32, n_expert: u32) -> Result<(), ProfileError> {
        if self.n_layer != n_layer || self.n_expert != n_expert {
            return Err(ProfileError::Mismatch {
                path: path.to_path_buf(),
                what: format!(
                    "made for {} layers x {} experts, the model has {n_layer} x {n_expert}",
                    self.n_layer, self.n_expert
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trip_and_errors() {
        let p = Profile {
            model: "m".into(),
            n_layer: 3,
            n_expert: 4,
            top_k: 2,
            tokens: 10,
            rates: vec![
                (ExpertKey::new(1, 0), 0.5),
                (ExpertKey::new(1, 3), 0.9),
                (ExpertKey::new(2, 1), 0.25),
            ],
        };
        let path = Path::new("p.txt");
        let q = Profile::parse(&p.to_text(), path).unwrap();
        assert_eq!(q, p);
        assert_eq!(q.ranked()[0].0, ExpertKey::new(1, 3));
        assert!(q.check(path, 3, 5).is_err());
        for bad in [
            "",
            "sluice-profile 2\n",
            "sluice-profile 1\nmodel m\nshape 3 4\n",
            "sluice-profile 1\nmodel m\nshape 3 4 2 10\n3 0 0.5\n",
            "sluice-profile 1\nmodel m\nshape 3 4 2 10\n1 0 1.5\n",
            "sluice-profile 1\nmodel m\nshape 3 4 2 10\n1 0 0.5\n1 0 0.5\n",
        ] {
            let e = Profile::parse(bad, path).unwrap_err();
            assert!(e.to_string().contains("p.txt"), "{e}");
        }
    }
}
