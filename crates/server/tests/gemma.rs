//! The real Gemma 3 270M through the server (skipped when SLUICE_GEMMA is unset, unless
//! SLUICE_REQUIRE_MODELS=1): greedy chat and completion text equal the engine's own greedy
//! generation for the same tokens, alone and with other requests running, and a second
//! turn reuses the first turn's prefix.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::{json, Value};

fn gemma() -> Option<PathBuf> {
    match std::env::var_os("SLUICE_GEMMA") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            assert!(
                std::env::var("SLUICE_REQUIRE_MODELS").as_deref() != Ok("1"),
                "SLUICE_GEMMA is unset and SLUICE_REQUIRE_MODELS=1"
            );
            eprintln!("skipped: SLUICE_GEMMA is unset (tools/get-gemma.sh)");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemma_greedy_matches_engine() {
    let Some(path) = gemma() else {
        return;
    };
    let mut cfg = config();
    cfg.parallel = 2;
    let mut s = start(cfg, path.clone(), false).await;
    let msgs = [("user", "Why is the sky blue?")];
    let body = json!({"messages": [{"role": "user", "content": msgs[0].1}], "max_tokens": 24, "temperature": 0});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let prompt = chat_tokens(&path, &msgs);
    assert_eq!(text, reference(&path, &prompt, 24));

    let cbody = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0});
    let (_, v) = s.post("/v1/completions", &cbody).await;
    let ctext = v["choices"][0]["text"].as_str().unwrap().to_string();
    let tok = tokenizer(&path);
    assert_eq!(
        ctext,
        reference(&path, &tok.encode("Once upon a time", true, false), 24)
    );

    // Both at once: same text.
    let (a, b) = tokio::join!(
        s.post("/v1/chat/completions", &body),
        s.post("/v1/completions", &cbody)
    );
    assert_eq!(a.1["choices"][0]["message"]["content"], text.as_str());
    assert_eq!(b.1["choices"][0]["text"], ctext.as_str());

    // Second turn: the first turn's prompt is reused.
    let body2 = json!({"messages": [
        {"role": "user", "content": msgs[0].1},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Say it in one sentence."}],
        "max_tokens": 16, "temperature": 0});
    let (_, v2): (u16, Value) = s.post("/v1/chat/completions", &body2).await;
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached as usize >= prompt.len() - 1, "cached {cached}");
    s.stop();
}
