//! Unit tests on small hand-made vocabularies; expected ids are worked out by hand from
//! the algorithms' definitions (the llama.cpp corpora are in tests/tokenizer_corpus.rs).

use super::*;

/// SPM vocab: 0 <unk>, 1 <s>, 2 </s>, 3..259 <0x00>..<0xFF>, then pieces with scores.
fn spm_vocab() -> Tokenizer {
    let mut tokens = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0f32; 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (t, s) in [
        ("▁", -1.0),
        ("a", -1.0),
        ("b", -1.0),
        ("ab", -2.0),
        ("▁a", -3.0),
        ("▁ab", -2.5),
        ("<ctl>", 0.0),
    ] {
        tokens.push(t.to_string());
        types.push(if t == "<ctl>" { 3 } else { 1 });
        scores.push(s);
    }
    let data = VocabData {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        ..Default::default()
    };
    Tokenizer::from_vocab(data, "test").unwrap()
}

const SP: u32 = 259; // "▁"
const A: u32 = 260;
const B: u32 = 261;
const AB: u32 = 262;
const SP_AB: u32 = 264;
const CTL: u32 = 265;

#[test]
fn spm_merges_by_score_and_prefixes_space() {
    let t = spm_vocab();
    // "▁ab": "ab" (-2) beats "▁a" (-3); then "▁"+"ab" -> "▁ab" (-2.5).
    assert_eq!(t.encode("ab", false, false), vec![SP_AB]);
    assert_eq!(t.encode("ab", true, false), vec![1, SP_AB]);
    // "ba" -> "▁" "b" "a": "▁b" and "ba" are not tokens.
    assert_eq!(t.encode("ba", false, false), vec![SP, B, A]);
    // 'c' (0x63) is not a piece: byte fallback <0x63> = 3 + 0x63.
    assert_eq!(t.encode("c", false, false), vec![SP, 3 + 0x63]);
    assert_eq!(t.decode(&[SP_AB, SP, B]), "ab b");
    assert_eq!(t.decode(&[AB]), "ab");
}

#[test]
fn spm_special_tokens_parse_only_when_asked() {
    let t = spm_vocab();
    // The text after a special token gets the space prefix again.
    assert_eq!(t.encode("<ctl>ab", false, true), vec![CTL, SP_AB]);
    assert_eq!(t.encode("b<ctl>ab", false, true), vec![SP, B, CTL, SP_AB]);
    // Without parse_special the text is tokenized as text: bytes for '<', 'c', 't', 'l', '>'.
    let ids = t.encode("<ctl>", false, false);
    assert_eq!(
        ids,
        vec![
            SP,
            3 + b'<' as u32,
            3 + b'c' as u32,
            3 + b't' as u32,
            3 + b'l' as u32,
            3 + b'>' as u32
        ]
    );
    // Control tokens are hidden when decoding, shown in the piece.
    assert_eq!(t.decode(&[CTL, AB]), "ab");
    assert_eq!(t.token_to_piece(CTL), b"<ctl>".to_vec());
    assert!(t.is_eog(2));
    assert_eq!((t.bos(), t.eos()), (Some(1), Some(2)));
}

#[test]
fn stream_decoder_waits_for_whole_characters() {
    let t = spm_vocab();
    // "é" = C3 A9 as two byte tokens, then "a".
    let mut d = t.stream_decoder();
    assert_eq!(d.push(3 + 0xC3), "");
    assert_eq!(d.pending_bytes(), &[0xC3]);
    assert_eq!(d.push(3 + 0xA9), "é");
    assert_eq!(d.push(A), "a");
    assert_eq!(d.push(CTL), "");
    // A stray continuation byte can never complete: replaced at once.
    assert_eq!(d.push(3 + 0xA9), "\u{FFFD}");
    assert_eq!(d.push(3 + 0xE2), "");
    assert_eq!(d.finish(), "\u{FFFD}");
}

/// Byte-level BPE vocab over "Ġ", "h", "i", "hi", "Ġhi" with merges "h i", "Ġ hi".
fn bpe_vocab(pre: &str) -> Tokenizer {
    let tokens: Vec<String> = ["Ġ", "h", "i", "hi", "Ġhi", "!", "<|end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let data = VocabData {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        token_types: Some(vec![1, 1, 1, 1, 1, 1, 3]),
        tokens,
        merges: vec!["h i".into(), "Ġ hi".into()],
        ..Default::default()
    };
    Tokenizer::from_vocab(data, "test").unwrap()
}

#[test]
fn bpe_merges_by_rank_within_words() {
    let t = bpe_vocab("qwen2");
    // Words: "hi", " hi", "!" -> [hi] [Ġhi] [!]
    assert_eq!(t.encode("hi hi!", false, false), vec![3, 4, 5]);
    // "ih": no merge -> i, h.
    assert_eq!(t.encode("ih", false, false), vec![2, 1]);
    assert_eq!(t.decode(&[3, 4, 5]), "hi hi!");
    assert_eq!(t.encode("hi<|end|>", false, true), vec![3, 6]);
    assert!(t.is_eog(6));
    assert_eq!(t.eot(), Some(6));
}

#[test]
fn clean_spaces_matches_llama_cpp_passes() {
    assert_eq!(clean_up_spaces(b"a , b ."), b"a, b.".to_vec());
    assert_eq!(clean_up_spaces(b"it 's a ' b"), b"it's a'b".to_vec());
    assert_eq!(clean_up_spaces(b"we 're i 'd"), b"we're i 'd".to_vec());
}

#[test]
fn unsupported_inputs_are_errors() {
    let data = VocabData {
        model: "t5".into(),
        tokens: vec!["a".into()],
        ..Default::default()
    };
    let e = Tokenizer::from_vocab(data, "x.gguf").unwrap_err();
    assert!(e.to_string().contains("x.gguf"), "{e}");
    let data = VocabData {
        model: "gpt2".into(),
        pre: Some("nope".into()),
        tokens: vec!["a".into()],
        ..Default::default()
    };
    assert!(matches!(
        Tokenizer::from_vocab(data, "x"),
        Err(TokenizerError::UnsupportedPre { .. })
    ));
    let data = VocabData {
        model: "llama".into(),
        tokens: vec!["a".into()],
        scores: Some(vec![]),
        ..Default::default()
    };
    assert!(matches!(
        Tokenizer::from_vocab(data, "x"),
        Err(TokenizerError::LengthMismatch { .. })
    ));
}

#[test]
fn glm_pre_tokenizer_splits_like_llama3_and_never_adds_bos() {
    let tokens: Vec<String> = ["Ġ", "h", "i", "hi", "Ġhi", "!", "<|end|>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for pre in ["glm4", "glm5"] {
        let data = VocabData {
            model: "gpt2".into(),
            pre: Some(pre.into()),
            token_types: Some(vec![1, 1, 1, 1, 1, 1, 3]),
            tokens: tokens.clone(),
            merges: vec!["h i".into(), "Ġ hi".into()],
            add_bos: Some(true),
            ..Default::default()
        };
        let t = Tokenizer::from_vocab(data, "test").unwrap();
        // llama.cpp: special_bos_id = NULL for glm4/glm5 even when the file asks for a BOS.
        assert_eq!(t.encode("hi hi!", true, false), vec![3, 4, 5], "{pre}");
    }
}
