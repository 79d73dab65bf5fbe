//! Shared test helpers: a byte-by-byte GGUF builder (independent of the crate's writer) and
//! the SLUICE_GEMMA lookup.

#![allow(dead_code)]

use std::path::PathBuf;

/// Builds GGUF bytes field by field, so hostile headers can be written exactly.
#[derive(Default, Clone)]
pub struct Bytes(pub Vec<u8>);

impl Bytes {
    pub fn new() -> Self {
        Bytes(Vec::new())
    }
    pub fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn u8(self, v: u8) -> Self {
        self.raw(&[v])
    }
    pub fn u32(self, v: u32) -> Self {
        self.raw(&v.to_le_bytes())
    }
    pub fn u64(self, v: u64) -> Self {
        self.raw(&v.to_le_bytes())
    }
    pub fn str(self, s: &str) -> Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    /// Magic, version, tensor count, key count.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        Bytes::new()
            .raw(b"GGUF")
            .u32(version)
            .u64(n_tensors)
            .u64(n_kv)
    }
    /// A string key/value pair.
    pub fn kv_str(self, key: &str, v: &str) -> Self {
        self.str(key).u32(8).str(v)
    }
    /// A u32 key/value pair.
    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.str(key).u32(4).u32(v)
    }
    /// A tensor info.
    pub fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        let mut b = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            b = b.u64(d);
        }
        b.u32(ty).u64(offset)
    }
    /// Zero padding up to a multiple of `align`.
    pub fn pad(mut self, align: usize) -> Self {
        while !self.0.len().is_multiple_of(align) {
            self.0.push(0);
        }
        self
    }
    pub fn zeros(mut self, n: usize) -> Self {
        self.0.resize(self.0.len() + n, 0);
        self
    }
}

/// A small valid v3 file: two keys, two F32 tensors (4 and 2x8 elements), default alignment.
pub fn small_valid() -> Vec<u8> {
    Bytes::header(3, 2, 3)
        .kv_str("general.architecture", "llama")
        .kv_u32("llama.block_count", 2)
        // an array of 3 strings
        .str("tokenizer.ggml.tokens")
        .u32(9)
        .u32(8)
        .u64(3)
        .str("a")
        .str("bc")
        .str("")
        .tensor("a", &[4], 0, 0)
        .tensor("b", &[8, 2], 0, 32)
        .pad(32)
        .raw(&[1u8; 16])
        .zeros(16)
        .raw(&[2u8; 64])
        .0
}

/// The real Gemma 3 270M file from env SLUICE_GEMMA (None + a note when unset, unless
/// SLUICE_REQUIRE_MODELS=1).
pub fn gemma() -> Option<PathBuf> {
    match std::env::var_os("SLUICE_GEMMA") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            if std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1") {
                panic!("SLUICE_GEMMA is unset but SLUICE_REQUIRE_MODELS=1");
            }
            eprintln!("note: SLUICE_GEMMA unset, skipping the real-model test");
            None
        }
    }
}
