//! The tiny qwen3moe fixtures (tests/fixtures/qwen3moe, made by
//! tools/fixtures/make_qwen3moe.py) and small comparison helpers, shared by the engine's
//! integration tests.

use std::path::{Path, PathBuf};

/// Path of a file in the qwen3moe fixture directory.
pub fn qwen3moe_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3moe")
        .join(name)
}

/// The fixture's token ids (tokens.json).
#[allow(dead_code)]
pub fn qwen3moe_tokens() -> Vec<u32> {
    let text = std::fs::read_to_string(qwen3moe_fixture("tokens.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Whether two logit vectors are equal bit for bit.
#[allow(dead_code)]
pub fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}
