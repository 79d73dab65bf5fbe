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

    /// Append the cache's shape, positions and rows (a snapshot's byte form).
    pub(crate) fn encode(&self, e: &mut crate::state_codec::Enc<'_>) {
        for n in [self.k.len(), self.k_dim, self.v_dim, self.len] {
            e.u64(n as u64);
        }
        e.u8(self.f16 as u8);
        for (k, v) in self.k.iter().zip(&self.v) {
            // Rows kept at f16 precision are stored as f16 (exact, half the bytes).
            if self.f16 {
                e.f16s(k);
                e.f16s(v);
            } else {
                e.f32s(k);
                e.f32s(v);
            }
        }
    }

    /// Read what [`KvCache::encode`] wrote into this (fresh) cache: the layer count, row
    /// sizes and KV precision must be this cache's, the positions must fit its context,
    /// and every layer must hold a row per position (or none). The context stays this one's.
    pub(crate) fn decode(
        &mut self,
        d: &mut crate::state_codec::Dec<'_>,
    ) -> Result<(), crate::state_codec::DecodeError> {
        use crate::state_codec::DecodeError;
        let mut shape = [0u64; 4];
        for (s, what) in
            shape
                .iter_mut()
                .zip(["kv layers", "kv key size", "kv value size", "kv positions"])
        {
            *s = d.u64(what)?;
        }
        let [n_layer, k_dim, v_dim, len] = shape;
        let want = [self.k.len(), self.k_dim, self.v_dim];
        if [n_layer, k_dim, v_dim] != want.map(|n| n as u64) {
            return Err(DecodeError(format!(
                "kv cache shape (layers, key, value) {:?}, this model's is {want:?}",
                [n_layer, k_dim, v_dim]
            )));
        }
        if len > self.n_ctx as u64 {
            return Err(DecodeError(format!(
                "{len} positions, the context holds {}",
                self.n_ctx
            )));
        }
        let len = len as usize;
        let f16 = d.u8("kv precision")? != 0;
        if f16 != self.f16 {
            return Err(DecodeError(format!(
                "kv precision {}, this sequence's is {}",
                if f16 { "f16" } else { "f32" },
                if self.f16 { "f16" } else { "f32" }
            )));
        }
        for il in 0..self.k.len() {
            let (k, v) = if f16 {
                (d.f16s("kv keys")?, d.f16s("kv values")?)
            } else {
                (d.f32s("kv keys")?, d.f32s("kv values")?)
            };
            // A layer holds a row per position, or none (a layer whose attention keeps its
            // state elsewhere, e.g. qwen4exp's DeltaNet layers).
            let rows = |n: usize, dim: usize| n == len * dim || n == 0;
            if !rows(k.len(), self.k_dim) || !rows(v.len(), self.v_dim) {
                return Err(DecodeError(format!(
                    "layer {il}: {} key and {} value floats for {len} positions",
                    k.len(),
                    v.len()
                )));
            }
            self.k[il] = k;
            self.v[il] = v;
        }
        self.len = len;
        Ok(())
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
