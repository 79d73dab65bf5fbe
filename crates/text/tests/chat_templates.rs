//! Real chat templates rendered with minijinja: Qwen2's from llama.cpp's qwen2 vocab GGUF and
//! Qwen3's (llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja), both in the llama.cpp source
//! dir from env SLUICE_LLAMA_CPP. Expected texts are written from the documented ChatML
//! format (`<|im_start|>{role}\n{content}<|im_end|>\n`), not from a renderer.

use sluice_gguf::GgufFile;
use sluice_text::chat::{ChatMessage, ChatTemplate};
use sluice_text::tokenizer::Tokenizer;
use std::path::PathBuf;

fn llama_cpp_dir() -> Option<PathBuf> {
    match std::env::var_os("SLUICE_LLAMA_CPP") {
        Some(d) => Some(PathBuf::from(d)),
        None if std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1") => {
            panic!("SLUICE_LLAMA_CPP is not set (and SLUICE_REQUIRE_MODELS=1)")
        }
        None => {
            eprintln!("note: SLUICE_LLAMA_CPP not set; skipping real chat templates");
            None
        }
    }
}

fn two_turns() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "Hello"),
        ChatMessage::new("assistant", "Hi there"),
        ChatMessage::new("user", "How are you?"),
    ]
}

#[test]
fn qwen2_gguf_template() {
    let Some(dir) = llama_cpp_dir() else {
        return;
    };
    let path = dir.join("models/ggml-vocab-qwen2.gguf");
    // Vocab-only file: pad past the empty data section's alignment (see tokenizer_corpus.rs).
    let mut bytes = std::fs::read(&path).unwrap();
    bytes.resize(bytes.len().next_multiple_of(64), 0);
    let f = GgufFile::parse(&bytes, &path).unwrap();
    let tok = Tokenizer::from_gguf(&f).unwrap();
    let t = ChatTemplate::from_gguf(&f, &tok);
    // Qwen2's template adds a default system turn when there is none.
    let want = "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
                <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n\
                <|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render(&two_turns(), true).unwrap(), want);
    // The control texts become single ids.
    let ids = t.encode_prompt(&tok, &two_turns(), true).unwrap();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&i| i == im_start).count(), 5);
    assert!(tok.is_eog(tok.token_id("<|im_end|>").unwrap()));
}

#[test]
fn qwen3_template() {
    let Some(dir) = llama_cpp_dir() else {
        return;
    };
    let src = std::fs::read_to_string(dir.join("models/templates/Qwen-Qwen3-0.6B.jinja")).unwrap();
    let t = ChatTemplate::new(&src, "Qwen3-0.6B", "", "<|im_end|>");
    let want = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there<|im_end|>\n\
                <|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(t.render(&two_turns(), true).unwrap(), want);
    let mut with_system = vec![ChatMessage::new("system", "Be brief.")];
    with_system.extend(two_turns());
    let want_sys = format!("<|im_start|>system\nBe brief.<|im_end|>\n{want}");
    assert_eq!(t.render(&with_system, true).unwrap(), want_sys);
    // Without the generation prompt the text ends after the last user turn.
    let no_gen = t.render(&two_turns(), false).unwrap();
    assert_eq!(no_gen, want.trim_end_matches("<|im_start|>assistant\n"));
}
