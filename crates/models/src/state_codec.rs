//! Byte form of a sequence snapshot (for a prefix cache kept on disk).
//!
//! Owns: [`Enc`] / [`Dec`], the little-endian writer and the bounded reader the state
//! types encode themselves with, and [`Snapshot::encode`] / [`SeqState::decode_snapshot`].
//! A snapshot is decoded *into a fresh state of the same model* (`Model::new_state`): every
//! part's count and every fixed-size array (recurrent states, convolution histories) must
//! match the fresh state's, every length is checked against the bytes left before
//! anything is allocated, and the KV rows must match the position count, so bytes from
//! another model, or damaged bytes, give an error, never a panic or a huge allocation.
//! What is not owned here: the file around the bytes (version, model identity, checksum,
//! crash-safe writes: the server's `prefix_disk`).

use crate::state::{SeqState, Snapshot};

/// Why encoded snapshot bytes were refused (one line, says what did not match).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

fn bad(what: impl Into<String>) -> DecodeError {
    DecodeError(what.into())
}

/// Appends little-endian values to a byte vector.
pub struct Enc<'a>(pub &'a mut Vec<u8>);

impl Enc<'_> {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A length-prefixed f32 array.
    pub fn f32s(&mut self, v: &[f32]) {
        self.u64(v.len() as u64);
        self.0.reserve(v.len() * 4);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
    /// A length-prefixed array of values already rounded to f16 precision, stored as f16
    /// (half the bytes; exact, since each value is an f16's).
    pub fn f16s(&mut self, v: &[f32]) {
        use half::slice::HalfFloatSliceExt;
        self.u64(v.len() as u64);
        let mut buf = [half::f16::ZERO; 256];
        for c in v.chunks(256) {
            let b = &mut buf[..c.len()];
            b.convert_from_f32_slice(c);
            for h in b.iter() {
                self.0.extend_from_slice(&h.to_bits().to_le_bytes());
            }
        }
    }
    /// A length-prefixed u32 array.
    pub fn u32s(&mut self, v: &[u32]) {
        self.u64(v.len() as u64);
        for x in v {
            self.0.extend_from_slice(&x.to_le_bytes());
        }
    }
}

/// Reads what [`Enc`] wrote; every length is checked against the bytes left.
pub struct Dec<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8]) -> Dec<'a> {
        Dec { buf, at: 0 }
    }

    fn left(&self) -> usize {
        self.buf.len() - self.at
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], DecodeError> {
        if n > self.left() {
            return Err(bad(format!(
                "{what}: {n} bytes needed at offset {}, {} left",
                self.at,
                self.left()
            )));
        }
        let s = &self.buf[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    pub fn u8(&mut self, what: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, what)?[0])
    }

    pub fn u64(&mut self, what: &str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    /// A count of `size`-byte items that must fit in the bytes left.
    fn count(&mut self, size: usize, what: &str) -> Result<usize, DecodeError> {
        let n = self.u64(what)?;
        if n > (self.left() / size) as u64 {
            return Err(bad(format!(
                "{what}: {n} values do not fit in the {} bytes left",
                self.left()
            )));
        }
        Ok(n as usize)
    }

    pub fn f32s(&mut self, what: &str) -> Result<Vec<f32>, DecodeError> {
        let n = self.count(4, what)?;
        let b = self.take(n * 4, what)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    /// What [`Enc::f16s`] wrote, as f32 values.
    pub fn f16s(&mut self, what: &str) -> Result<Vec<f32>, DecodeError> {
        use half::slice::HalfFloatSliceExt;
        let n = self.count(2, what)?;
        let b = self.take(n * 2, what)?;
        let h: Vec<half::f16> = b
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let mut out = vec![0.0f32; n];
        h.convert_to_f32_slice(&mut out);
        Ok(out)
    }

    pub fn u32s(&mut self, what: &str) -> Result<Vec<u32>, DecodeError> {
        let n = self.count(4, what)?;
        let b = self.take(n * 4, what)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect())
    }

    /// A length-prefixed f32 array into `dst`: when `dst` is not empty (a fixed-size
    /// array of the fresh state) the length must equal its length.
    pub fn f32s_into(&mut self, dst: &mut Vec<f32>, what: &str) -> Result<(), DecodeError> {
        let v = self.f32s(what)?;
        if !dst.is_empty() && v.len() != dst.len() {
            return Err(bad(format!(
                "{what}: {} values, this model's state has {}",
                v.len(),
                dst.len()
            )));
        }
        *dst = v;
        Ok(())
    }

    /// Fail unless every byte was read.
    pub fn finish(&self) -> Result<(), DecodeError> {
        if self.left() != 0 {
            return Err(bad(format!("{} bytes left over", self.left())));
        }
        Ok(())
    }
}

/// Part tags: which parts a snapshot has.
const HAS_EXTRA: u8 = 1;

impl Snapshot {
    /// Append every value the snapshot holds to `out`. Returns false (and leaves `out` as
    /// it was) when a part cannot be written: a device backend's copy of the sequence
    /// (`--gpu`) or an architecture state without a byte form.
    pub fn encode(&self, out: &mut Vec<u8>) -> bool {
        if self.device.is_some() {
            return false;
        }
        let start = out.len();
        let mut e = Enc(out);
        e.u8(if self.extra.is_some() { HAS_EXTRA } else { 0 });
        self.kv.encode(&mut e);
        if let Some(x) = &self.extra {
            if !x.encode(&mut e) {
                out.truncate(start);
                return false;
            }
        }
        true
    }
}

impl SeqState {
    /// Replace this state (a fresh one of the model the bytes were written for, made with
    /// the context and KV precision to run with) by the snapshot [`Snapshot::encode`]
    /// wrote. On error the state is cleared.
    pub fn decode_snapshot(&mut self, bytes: &[u8]) -> Result<(), DecodeError> {
        let r = self.decode_inner(bytes);
        if r.is_err() {
            self.clear();
        }
        r
    }

    fn decode_inner(&mut self, bytes: &[u8]) -> Result<(), DecodeError> {
        if self.device.is_some() {
            return Err(bad(
                "a device backend's state cannot be restored from bytes",
            ));
        }
        let mut d = Dec::new(bytes);
        let parts = d.u8("parts")?;
        let has_extra = parts & HAS_EXTRA != 0;
        if parts & !HAS_EXTRA != 0 || has_extra != self.extra.is_some() {
            return Err(bad(format!(
                "parts {parts:#x}: this model's state {} architecture state",
                if self.extra.is_some() {
                    "has"
                } else {
                    "has no"
                }
            )));
        }
        self.kv.decode(&mut d)?;
        if let Some(x) = &mut self.extra {
            x.decode(&mut d)?;
        }
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvCache;

    fn filled(n_layer: usize, k_dim: usize, v_dim: usize, n: usize) -> KvCache {
        let mut kv = KvCache::new(n_layer, k_dim, v_dim, 16);
        for il in 0..n_layer {
            // Values that f16 rounding changes (and a subnormal-range one).
            let k: Vec<f32> = (0..n * k_dim)
                .map(|i| (i as f32 * 0.1234 + il as f32).sin() * 1000.0 + 1e-6)
                .collect();
            let v: Vec<f32> = (0..n * v_dim)
                .map(|i| -(i as f32) / 3.0 - il as f32)
                .collect();
            kv.append(il, &k, &v);
        }
        kv.advance(n);
        kv
    }

    #[test]
    fn kv_snapshot_round_trips_and_refuses_another_shape() {
        let st = SeqState::new(filled(2, 3, 4, 5));
        let mut bytes = Vec::new();
        assert!(st.snapshot().encode(&mut bytes));
        let mut fresh = SeqState::new(KvCache::new(2, 3, 4, 16));
        fresh.decode_snapshot(&bytes).unwrap();
        assert_eq!(fresh.len(), 5);
        for il in 0..2 {
            assert_eq!(fresh.kv.layer(il), st.kv.layer(il));
        }
        // Another layer count, another row size, a shorter context: refused, state clear.
        for mut other in [
            SeqState::new(KvCache::new(3, 3, 4, 16)),
            SeqState::new(KvCache::new(2, 2, 4, 16)),
            SeqState::new(KvCache::new(2, 3, 4, 4)),
        ] {
            assert!(other.decode_snapshot(&bytes).is_err());
            assert_eq!(other.len(), 0);
        }
        // Every truncation is refused without a panic.
        for cut in 0..bytes.len() {
            let mut f = SeqState::new(KvCache::new(2, 3, 4, 16));
            assert!(f.decode_snapshot(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        // Another KV precision is refused.
        let mut f32_kv = KvCache::new(2, 3, 4, 16);
        f32_kv.set_f16(false);
        assert!(SeqState::new(f32_kv).decode_snapshot(&bytes).is_err());
        // A huge length is refused before allocating.
        let mut huge = bytes.clone();
        huge[1 + 8 * 4 + 1..1 + 8 * 4 + 9].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut f = SeqState::new(KvCache::new(2, 3, 4, 16));
        assert!(f.decode_snapshot(&huge).is_err());
    }

    #[test]
    fn f32_kv_rows_round_trip_bit_for_bit() {
        let mut kv = KvCache::new(1, 5, 5, 16);
        kv.set_f16(false);
        let k: Vec<f32> = (0..15).map(|i| (i as f32 * 0.777).cos() / 7.0).collect();
        kv.append(0, &k, &k);
        kv.advance(3);
        let st = SeqState::new(kv);
        let mut bytes = Vec::new();
        assert!(st.snapshot().encode(&mut bytes));
        let mut fresh_kv = KvCache::new(1, 5, 5, 16);
        fresh_kv.set_f16(false);
        let mut fresh = SeqState::new(fresh_kv);
        fresh.decode_snapshot(&bytes).unwrap();
        let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(fresh.kv.layer(0).0), bits(&k));
        assert_eq!(bits(fresh.kv.layer(0).1), bits(&k));
    }
}
