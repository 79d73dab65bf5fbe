//! `Tokenizer::from_gguf` on small GGUF files written in memory: typed errors that name the
//! file and key for missing or mistyped metadata, and a minimal valid BPE vocab whose ids
//! are worked out by hand.

use sluice_gguf::{GgufFile, GgufWriter, MetaArray, MetaType, MetaValue};
use sluice_text::tokenizer::{Tokenizer, TokenizerError};
use std::path::Path;

fn strs(v: &[&str]) -> MetaValue {
    MetaValue::Array(MetaArray {
        elem_type: MetaType::String,
        values: v.iter().map(|s| MetaValue::Str(s.to_string())).collect(),
    })
}

fn file(meta: Vec<(&str, MetaValue)>) -> GgufFile {
    let meta: Vec<(String, MetaValue)> =
        meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    let path = Path::new("mem.gguf");
    let w = GgufWriter::new(Vec::new(), path, &meta, &[]).unwrap();
    let mut bytes = w.finish().unwrap();
    bytes.resize(bytes.len().next_multiple_of(64), 0);
    GgufFile::parse(&bytes, path).unwrap()
}

#[test]
fn missing_and_mistyped_keys_are_named() {
    let f = file(vec![("tokenizer.ggml.tokens", strs(&["a"]))]);
    let e = Tokenizer::from_gguf(&f).unwrap_err();
    assert!(
        matches!(
            e,
            TokenizerError::MissingKey {
                key: "tokenizer.ggml.model",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("mem.gguf"), "{e}");

    let f = file(vec![
        ("tokenizer.ggml.model", MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", MetaValue::U32(3)),
    ]);
    let e = Tokenizer::from_gguf(&f).unwrap_err();
    assert!(
        matches!(
            e,
            TokenizerError::WrongType {
                key: "tokenizer.ggml.tokens",
                ..
            }
        ),
        "{e}"
    );

    let f = file(vec![
        ("tokenizer.ggml.model", MetaValue::Str("t5".into())),
        ("tokenizer.ggml.tokens", strs(&["a"])),
    ]);
    assert!(matches!(
        Tokenizer::from_gguf(&f),
        Err(TokenizerError::UnsupportedModel { .. })
    ));
}

#[test]
fn minimal_bpe_vocab() {
    let f = file(vec![
        ("tokenizer.ggml.model", MetaValue::Str("gpt2".into())),
        ("tokenizer.ggml.pre", MetaValue::Str("gpt-2".into())),
        (
            "tokenizer.ggml.tokens",
            strs(&["a", "b", "ab", "Ġ", "Ġab", "<|endoftext|>"]),
        ),
        ("tokenizer.ggml.merges", strs(&["a b", "Ġ ab"])),
        (
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray {
                elem_type: MetaType::I32,
                values: [1, 1, 1, 1, 1, 3]
                    .iter()
                    .map(|&t| MetaValue::I32(t))
                    .collect(),
            }),
        ),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(5)),
        // Out of range: ignored (llama.cpp keeps the default, here also out of range).
        ("tokenizer.ggml.bos_token_id", MetaValue::U32(99)),
    ]);
    let tok = Tokenizer::from_gguf(&f).unwrap();
    // Words "ab", " ab", " ba": [ab] [Ġab] [Ġ b a] ("Ġb" and "ba" are no merges).
    assert_eq!(tok.encode("ab ab ba", false, false), vec![2, 4, 3, 1, 0]);
    assert_eq!(tok.decode(&[2, 4, 3, 1, 0]), "ab ab ba");
    assert_eq!((tok.bos(), tok.eos()), (None, Some(5)));
    assert!(tok.is_eog(5));
    assert_eq!(tok.encode("a<|endoftext|>", false, true), vec![0, 5]);
}
