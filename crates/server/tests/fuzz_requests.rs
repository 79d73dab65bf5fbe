//! Request decoding under hostile input: seeded mutations of valid bodies (bytes flipped,
//! truncated, fields retyped, huge numbers, deep nesting) sent to the live server. Every
//! answer is 200 or a 4xx with an error object; the server stays healthy. Bounded count.

mod common;

use common::*;
use serde_json::{json, Value};

/// splitmix64: a fixed seed gives the same cases on every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn weird(r: &mut Rng) -> Value {
    match r.below(12) {
        0 => Value::Null,
        1 => json!(-1),
        2 => json!(1e308),
        3 => json!(u64::MAX),
        4 => json!("x"),
        5 => json!([]),
        6 => json!({}),
        7 => json!(true),
        8 => json!([{"type": "image_url", "image_url": {"url": "x"}}]),
        9 => json!(0),
        10 => json!("\u{0}\u{ffff}"),
        _ => json!(-0.5),
    }
}

fn mutate(r: &mut Rng, base: &Value) -> Vec<u8> {
    let mut v = base.clone();
    match r.below(6) {
        // Retype a top-level field.
        0 | 1 => {
            if let Some(o) = v.as_object_mut() {
                let keys: Vec<String> = o.keys().cloned().collect();
                let k = &keys[r.below(keys.len())];
                o.insert(k.clone(), weird(r));
            }
        }
        // Retype something inside the first message.
        2 => {
            if let Some(m) = v.pointer_mut("/messages/0") {
                let k = if r.below(2) == 0 { "role" } else { "content" };
                m[k] = weird(r);
            }
        }
        // Deep nesting.
        3 => {
            let depth = 64 + r.below(512);
            let s = "[".repeat(depth) + &"]".repeat(depth);
            return format!(r#"{{"messages": {s}, "prompt": {s}}}"#).into_bytes();
        }
        _ => {}
    }
    let mut b = serde_json::to_vec(&v).unwrap();
    match r.below(4) {
        // Truncate.
        0 if !b.is_empty() => {
            let n = r.below(b.len());
            b.truncate(n);
        }
        // Flip bytes.
        1 => {
            for _ in 0..1 + r.below(4) {
                let i = r.below(b.len());
                b[i] = (r.next() & 0xff) as u8;
            }
        }
        _ => {}
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_requests_never_break_the_server() {
    let mut cfg = config();
    cfg.max_tokens = 4;
    cfg.queue = 64;
    let mut s = start(cfg, fixture(), false).await;
    let bases = [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "stop": ["a"], "stream": false}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "a b", "max_tokens": 2, "top_p": 0.5, "seed": 3, "stream": false}),
        ),
        (
            "/v1/messages",
            json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "system": "s", "stop_sequences": ["x"]}),
        ),
    ];
    let mut r = Rng(0x5eed);
    let mut ok = 0;
    for _ in 0..300 {
        let (path, base) = &bases[r.below(bases.len())];
        let body = mutate(&mut r, base);
        let resp = s
            .client
            .post(s.url(path))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        let st = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap_or("").to_string())
            .unwrap_or_default();
        let text = resp.text().await.unwrap();
        assert!(
            st == 200 || (400..500).contains(&st),
            "{st} for {}: {text}",
            String::from_utf8_lossy(&body)
        );
        if st == 200 {
            ok += 1;
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            let msg = &v["error"]["message"];
            assert!(msg.is_string(), "{text}");
            if *path == "/v1/messages" {
                assert_eq!(v["type"], "error");
            }
        }
        assert!(!ct.is_empty());
    }
    assert!(ok > 0, "some mutations stay valid");
    let h = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(h.status(), 200);
    s.stop();
}
