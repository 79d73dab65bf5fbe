//! The real Gemma 3 270M vocabulary (env SLUICE_GEMMA; tools/get-gemma.sh): ids for a few
//! strings as llama.cpp itself produces them (fixture from tools/fixtures/gemma3_tokens.py),
//! special ids from the file's metadata, the built-in Gemma chat template, and streaming.

use sluice_gguf::GgufFile;
use sluice_text::chat::{ChatMessage, ChatTemplate};
use sluice_text::tokenizer::Tokenizer;

fn gemma() -> Option<(GgufFile, Tokenizer)> {
    let path = match std::env::var_os("SLUICE_GEMMA") {
        Some(p) => std::path::PathBuf::from(p),
        None if std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1") => {
            panic!("SLUICE_GEMMA is not set (and SLUICE_REQUIRE_MODELS=1)")
        }
        None => {
            eprintln!("note: SLUICE_GEMMA not set; skipping Gemma tokenizer tests");
            return None;
        }
    };
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    let tok = Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{e}"));
    Some((f, tok))
}

#[test]
fn gemma3_ids_match_llama_cpp() {
    let Some((_, tok)) = gemma() else {
        return;
    };
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/gemma3_tokens.json")).expect("fixture json");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 8);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let add = c["add_special"].as_bool().unwrap();
        let parse = c["parse_special"].as_bool().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            tok.encode(text, add, parse),
            want,
            "{text:?} add_special={add} parse_special={parse}"
        );
        // Lossless: the pieces (control tokens rendered) give the text back.
        let ids = if add { &want[1..] } else { &want[..] };
        let back: Vec<u8> = ids.iter().flat_map(|&i| tok.token_to_piece(i)).collect();
        assert_eq!(String::from_utf8(back).unwrap(), text);
    }
}

#[test]
fn gemma3_special_tokens_and_template() {
    let Some((f, tok)) = gemma() else {
        return;
    };
    // From the file's metadata (bos_token_id 2, eos_token_id 1) and token list
    // (<start_of_turn> = 105, <end_of_turn> = 106), read with an independent GGUF reader.
    assert_eq!(tok.n_vocab(), 262144);
    assert_eq!((tok.bos(), tok.eos()), (Some(2), Some(1)));
    assert_eq!(tok.eot(), Some(106));
    assert!(tok.is_eog(1) && tok.is_eog(106) && !tok.is_eog(105));
    assert!(tok.add_bos());

    // The file has no chat template: the built-in Gemma one is used.
    assert!(f.get("tokenizer.chat_template").is_none());
    let t = ChatTemplate::from_gguf(&f, &tok);
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
    ];
    let text = t.render(&msgs, true).unwrap();
    assert_eq!(
        text,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = t.encode_prompt(&tok, &msgs, true).unwrap();
    assert_eq!(&ids[..2], &[2, 105], "one BOS, then <start_of_turn>");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
}

#[test]
fn gemma3_stream_decoding_matches_decode() {
    let Some((_, tok)) = gemma() else {
        return;
    };
    let text = "naïve café — 東京 🦙 Ünïcödé, and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑ x².";
    let ids = tok.encode(text, false, false);
    let mut d = tok.stream_decoder();
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(id);
        out.push_str(&piece);
    }
    out.push_str(&d.finish());
    assert_eq!(out, text);
    assert_eq!(tok.decode(&ids), text);
}
