//! Request fields whose feature is not implemented are answered 400 naming the field,
//! never silently ignored (issue 35 item 15): completions `logprobs` / `suffix` /
//! `best_of`, chat `top_logprobs` without `logprobs`, Anthropic `thinking` / an assistant
//! prefill. Before, each of these was answered 200 as if it had not been sent. (Anthropic
//! `tools` are served since issue 33: `tests/agents.rs`.)

mod common;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsupported_fields_are_400_naming_them() {
    let mut s = start(config(), fixture(), false).await;
    let user = json!([{"role": "user", "content": "a b"}]);
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "a b", "max_tokens": 2, "logprobs": 2}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a b", "max_tokens": 2, "suffix": " end"}),
            "suffix",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a b", "max_tokens": 2, "best_of": 3}),
            "best_of",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": user, "max_tokens": 2, "top_logprobs": 3}),
            "top_logprobs",
        ),
        (
            "/v1/messages",
            json!({"messages": user, "max_tokens": 2,
                   "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            "thinking",
        ),
        (
            "/v1/messages",
            json!({"messages": [{"role": "user", "content": "a b"},
                                {"role": "assistant", "content": "c"}], "max_tokens": 2}),
            "prefill",
        ),
    ];
    // Every case checked, the wrong ones listed together.
    let mut wrong = Vec::new();
    for (path, body, field) in cases {
        let (st, v) = s.post(path, &body).await;
        let msg = v["error"]["message"].as_str().unwrap_or("").to_string();
        let shape = path != "/v1/messages" || v["type"] == "error";
        if st != 400 || !msg.contains(field) || !shape {
            wrong.push(format!("{path} {body}: {st} {v}"));
        }
    }
    assert!(wrong.is_empty(), "not refused:\n{}", wrong.join("\n"));
    // Values asking for nothing are still served.
    let (st, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "a b", "max_tokens": 2, "logprobs": null, "suffix": "", "best_of": 1}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = s
        .post(
            "/v1/messages",
            &json!({"messages": user, "max_tokens": 2, "tools": [], "thinking": {"type": "disabled"}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    s.stop();
}
