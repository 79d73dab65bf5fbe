//! llama.cpp's tokenizer corpus: `models/ggml-vocab-*.gguf` with `.gguf.inp` (cases split by
//! `\n__ggml_vocab_test__\n`) and `.gguf.out` (expected ids per case, one line each), produced
//! by llama.cpp with add_special = false and parse_special = false (tests/test-tokenizer-0.cpp).
//! The llama.cpp source dir comes from env SLUICE_LLAMA_CPP (tools/get-llama-cpp.sh).

use sluice_engine::tokenizer::Tokenizer;
use sluice_gguf::GgufFile;
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
