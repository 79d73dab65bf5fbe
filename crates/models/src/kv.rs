//! The key/value cache of one sequence.
//!
//! Owns: per-layer K and V rows for every position evaluated so far (f32 storage, rounded
//! to f16 precision by default like llama.cpp's F16 cache), and the context limit.
//! Rows are appended by the forward pass and read by attention.

use crate::ModelError as EngineError;

/// Keys and values of one sequence, `[n_layer][pos][n_head_kv * head_dim]`.
#[derive(Clone)]
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    k_dim: usize,
    v_dim: usize,
    n_ctx: usize,
    len: usize,
    /// Round keys and values to f16 precision (llama.cpp's default KV type).
    f16: bool,
}

impl KvCache {
    /// An empty cache for `n_layer` layers holding up to `n_ctx` positions. Memory grows
    /// with use; nothing is reserved for positions never reached.
    pub fn new(n_layer: usize, k_dim: usize, v_dim: usize, n_ctx: usize) -> KvCache {
        KvCache {
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
            k_dim,
            v_dim,
            n_ctx,
            len: 0,
            f16: true,
        }
    }

    /// Keep keys and values at f16 precision (the default, as llama.cpp does) or full f32.
    /// Rows are stored as f32 either way; f16 only rounds them.
    pub fn set_f16(&mut self, on: bool) {
        self.f16 = on;
    }

    /// Whether rows are kept at f16 precision.
    pub fn f16(&self) -> bool {
        self.f16
    }

    /// Positions evaluated so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions this cache accepts.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Forget every position (start a new sequence).
    pub fn clear(&mut self) {
        for l in self.k.iter_mut().chain(self.v.iter_mut()) {
            l.clear();
        }
        self.len = 0;
    }

    /// Drop positions from `len` on (e.g. to re-evaluate a shorter prefix).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            for l in self.k.iter_mut() {
                l.truncate(len * self.k_dim);
            }
            for l in self.v.iter_mut() {
                l.truncate(len * self.v_dim);
            }
            self.len = len;
        }
    }

    /// Fail unless `n` more positions fit.
    pub fn check_room(&self, n: usize) -> Result<(), EngineError> {
        if self.len + n > self.n_ctx {
            return Err(EngineError::ContextFull {
                needed: self.len + n,
                n_ctx: self.n_ctx,
            });
        }
        Ok(())
    }

    /// Append `k` and `v` rows (several positions) to layer `il`.
    pub(crate) fn append(&mut self, il: usize, k: &[f32], v: &[f32]) {
        if self.f16 {
            round_f16_extend(&mut self.k[il], k);
            round_f16_extend(&mut self.v[il], v);
        } else {
            self.k[il].extend_from_slice(k);
            self.v[il].extend_from_slice(v);
        }
    }

    /// Record that `n` positions were appended to every layer.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    pub(crate) fn layer(&self, il: usize) -> (&[f32], &[f32]) {
        (&self.k[il], &self.v[il])
    }
}

/// Append `src` rounded through f16 (round to nearest even) to `dst`, converted in slices
/// (half's slice conversions use F16C where the CPU has it: same bits as element-wise
/// `f16::from_f32(x).to_f32()`, several values per instruction).
fn round_f16_extend(dst: &mut Vec<f32>, src: &[f32]) {
    use half::slice::HalfFloatSliceExt;
    const BLOCK: usize = 256;
    let mut buf = [half::f16::ZERO; BLOCK];
    let start = dst.len();
    dst.resize(start + src.len(), 0.0);
    for (s, d) in src.chunks(BLOCK).zip(dst[start..].chunks_mut(BLOCK)) {
        let b = &mut buf[..s.len()];
        b.convert_from_f32_slice(s);
        b.convert_to_f32_slice(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_f16_rounding_matches_the_element_wise_conversion() {
        // Random bit patterns (every exponent: subnormals, overflow to inf, ties) plus
        // values at f16's rounding boundaries, across several blocks and a ragged tail.
        let mut x = 0x1234_5678u32;
        let mut src: Vec<f32> = (0..70_001)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                f32::from_bits(x)
            })
            .collect();
        src.extend([
            0.0,
            -0.0,
            65504.0,
            65520.0,
            6.0e-8,
            2.98e-8,
            f32::INFINITY,
            1.0 + 1.0 / 2048.0,
        ]);
        let mut got = vec![7.0f32];
        round_f16_extend(&mut got, &src);
        assert_eq!(got.len(), src.len() + 1);
        assert_eq!(got[0], 7.0);
        for (&s, &g) in src.iter().zip(&got[1..]) {
            let want = half::f16::from_f32(s).to_f32();
            if want.is_nan() {
                assert!(g.is_nan(), "{s:e}: {g:e}");
            } else {
                assert_eq!(want.to_bits(), g.to_bits(), "{s:e}");
            }
        }
    }
}
