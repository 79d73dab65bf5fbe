//! llama.cpp's tokenizer corpus: `models/ggml-vocab-*.gguf` with `.gguf.inp` (cases split by
//! `\n__ggml_vocab_test__\n`) and `.gguf.out` (expected ids per case, one line each), produced
//! by llama.cpp with add_special = false and parse_special = false (tests/test-tokenizer-0.cpp).
//! The llama.cpp source dir comes from env SLUICE_LLAMA_CPP (tools/get-llama-cpp.sh).

use sluice_gguf::GgufFile;
use sluice_text::tokenizer::Tokenizer;
use std::path::PathBuf;

fn llama_cpp_dir() -> Option<PathBuf> {
    match std::env::var_os("SLUICE_LLAMA_CPP") {
        Some(d) => Some(PathBuf::from(d)),
        None if std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1") => {
            panic!("SLUICE_LLAMA_CPP is not set (and SLUICE_REQUIRE_MODELS=1)")
        }
        None => {
            eprintln!("note: SLUICE_LLAMA_CPP not set; skipping llama.cpp tokenizer corpus");
            None
        }
    }
}

fn read_cases(dir: &std::path::Path, name: &str) -> (Tokenizer, Vec<(String, Vec<u32>)>) {
    let base = dir.join("models").join(format!("ggml-vocab-{name}.gguf"));
    // These vocab-only files end right after the header, before the (empty) data section's
    // alignment padding, which sluice-gguf rejects as truncated; pad them to parse.
    let mut bytes = std::fs::read(&base).unwrap_or_else(|e| panic!("{}: {e}", base.display()));
    bytes.resize(bytes.len().next_multiple_of(64), 0);
    let f = GgufFile::parse(&bytes, &base).unwrap_or_else(|e| panic!("{e}"));
    let tok = Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{e}"));
    let inp = std::fs::read_to_string(base.with_extension("gguf.inp")).expect("read .inp");
    let out = std::fs::read_to_string(base.with_extension("gguf.out")).expect("read .out");
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs: Vec<String> = inp.split(sep).map(str::to_string).collect();
    // test-tokenizer-0.cpp stops at the end of the text: a trailing separator adds no case.
    if inp.ends_with(sep) {
        inputs.pop();
    }
    let outputs: Vec<Vec<u32>> = out
        .lines()
        .map(|l| {
            l.split_whitespace()
                .map(|t| t.parse().expect("id"))
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out case counts differ"
    );
    (tok, inputs.into_iter().zip(outputs).collect())
}

/// Checks every case; returns the number checked.
fn check(name: &str, spm_prefix: bool) -> usize {
    let Some(dir) = llama_cpp_dir() else {
        return 0;
    };
    let (tok, cases) = read_cases(&dir, name);
    let mut failures = Vec::new();
    for (text, want) in &cases {
        let got = tok.encode(text, false, false);
        if &got != want {
            failures.push(format!("{text:?}\n  want {want:?}\n  got  {got:?}"));
            continue;
        }
        // Byte-fallback / byte-level vocabs are lossless: the pieces give the text back
        // (SentencePiece adds one leading space, removed on decode).
        let mut bytes: Vec<u8> = got.iter().flat_map(|&id| tok.token_to_piece(id)).collect();
        if spm_prefix && bytes.first() == Some(&b' ') {
            bytes.remove(0);
        }
        if bytes != text.as_bytes() {
            failures.push(format!(
                "{text:?}: pieces give back {:?}",
                String::from_utf8_lossy(&bytes)
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases fail:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    eprintln!("{name}: {} cases pass", cases.len());
    cases.len()
}

#[test]
fn corpus_qwen2() {
    check("qwen2", false);
}

#[test]
fn corpus_llama_spm() {
    check("llama-spm", true);
}

#[test]
fn corpus_gemma_4() {
    check("gemma-4", false);
}

#[test]
fn corpus_llama_bpe() {
    check("llama-bpe", false);
}

#[test]
fn corpus_gpt_2() {
    check("gpt-2", false);
}

#[test]
fn corpus_phi_3() {
    check("phi-3", true);
}

#[test]
fn corpus_command_r() {
    check("command-r", false);
}

#[test]
fn corpus_starcoder() {
    check("starcoder", false);
}

#[test]
fn corpus_mpt() {
    check("mpt", false);
}

#[test]
fn corpus_qwen35() {
    check("qwen35", false);
}

#[test]
fn corpus_refact() {
    check("refact", false);
}

/// Larger real texts (llama.cpp's README and C++ sources: markdown, code, Unicode tables)
/// through lossless vocabs: the pieces must give the text back exactly.
#[test]
fn large_texts_round_trip() {
    let Some(dir) = llama_cpp_dir() else {
        return;
    };
    let texts: Vec<String> = ["README.md", "src/unicode.cpp", "src/llama-vocab.cpp"]
        .iter()
        .map(|p| std::fs::read_to_string(dir.join(p)).unwrap())
        // A literal U+2581 decodes as a space in SentencePiece-style vocabs (it is their
        // escaped space, in llama.cpp too), so it cannot round-trip: leave it out.
        .map(|t| {
            t.chars()
                .filter(|&c| c != '\u{2581}')
                .take(60_000)
                .collect()
        })
        .collect();
    for (name, spm) in [
        ("qwen2", false),
        ("llama-bpe", false),
        ("gemma-4", false),
        ("llama-spm", true),
    ] {
        let (tok, _) = read_cases(&dir, name);
        for text in &texts {
            for parse_special in [false, true] {
                let ids = tok.encode(text, false, parse_special);
                assert!(ids.iter().all(|&i| (i as usize) < tok.n_vocab()));
                let mut bytes: Vec<u8> =
                    ids.iter().flat_map(|&id| tok.token_to_piece(id)).collect();
                if spm && bytes.first() == Some(&b' ') {
                    bytes.remove(0);
                }
                if bytes != text.as_bytes() {
                    let at = bytes
                        .iter()
                        .zip(text.as_bytes())
                        .position(|(a, b)| a != b)
                        .unwrap_or(0);
                    let lo = at.saturating_sub(40);
                    panic!(
                        "{name}: round trip differs at byte {at}: {:?} vs {:?}",
                        String::from_utf8_lossy(&bytes[lo..(at + 40).min(bytes.len())]),
                        String::from_utf8_lossy(&text.as_bytes()[lo..(at + 40).min(text.len())])
                    );
                }
            }
        }
    }
}
