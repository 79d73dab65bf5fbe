//! `--prefix-cache-dir`: a conversation cached by one server process is reused by the next
//! one on the same directory (cached tokens reported, greedy text equal to the engine's
//! own uncached generation), on tiny fixtures of every kind of sequence state (KV rows,
//! MLA latents + DSA keys, DeepSeek V4's compressed state, Qwen3.8-Flash-Next's and
//! GLM-5.3-Flash's recurrent states) and on the real Gemma when `SLUICE_GEMMA` is set;
//! damaged, truncated and foreign files are ignored (same text, nothing reused); the
//! directory's size bound holds.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};

fn chat_body(msgs: &[(&str, &str)], max_tokens: u64) -> Value {
    let m: Vec<Value> = msgs
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    json!({"model": "tiny", "messages": m, "max_tokens": max_tokens, "temperature": 0})
}

fn fixture_at(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

/// A fresh scratch directory for one test (removed by [`Scratch`]'s drop).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d =
            std::env::temp_dir().join(format!("sluice-prefix-disk-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cache files in `dir`, sorted by name.
fn cache_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.retain(|p| p.extension().and_then(|e| e.to_str()) == Some("slpc"));
    v.sort();
    v
}

fn dir_bytes(dir: &Path) -> u64 {
    cache_files(dir)
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum()
}

fn disk_config(dir: &Path, bound: u64) -> sluice_server::ServerConfig {
    let mut cfg = config();
    cfg.parallel = 1;
    cfg.prefix_cache_dir = Some(dir.to_path_buf());
    cfg.prefix_cache_disk = bound;
    cfg
}

const TURN1: [(&str, &str); 2] = [
    ("system", "You are a helpful assistant."),
    ("user", "Tell me a story about a fox"),
];

/// One chat request: (content, prompt tokens, cached tokens).
async fn chat(s: &Server, msgs: &[(&str, &str)]) -> (String, u64, u64) {
    let (status, v) = s.post("/v1/chat/completions", &chat_body(msgs, 8)).await;
    assert_eq!(status, 200, "{v}");
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

/// Turn 1 on a server over `dir`, then (`extend`) turn 2 and turn 1 again on a restarted
/// one: the second process reuses the first one's snapshot with the engine's greedy text.
async fn restart_reuses(path: PathBuf, name: &str, extend: bool) {
    let scratch = Scratch::new(name);
    let dir = &scratch.0;
    let mut a = start(disk_config(dir, 1 << 30), path.clone(), false).await;
    let (text1, p1, cached1) = chat(&a, &TURN1).await;
    assert_eq!(cached1, 0, "{name}: nothing cached yet");
    a.stop();
    assert_eq!(cache_files(dir).len(), 1, "{name}: one snapshot written");
    let prompt1 = chat_tokens(&path, &TURN1);
    assert_eq!(text1, reference(&path, &prompt1, 8), "{name}: turn 1");

    let mut b = start(disk_config(dir, 1 << 30), path.clone(), false).await;
    let (again, p1b, cached) = chat(&b, &TURN1).await;
    assert_eq!(p1b, p1);
    assert_eq!(cached, p1 - 1, "{name}: the restarted server reused turn 1");
    assert_eq!(
        again, text1,
        "{name}: same greedy text from the restored state"
    );
    if extend {
        let turn2 = [
            TURN1[0],
            TURN1[1],
            ("assistant", text1.as_str()),
            ("user", "And then?"),
        ];
        // A third process, so the snapshot comes from disk again, not from b's RAM.
        b.stop();
        let mut c = start(disk_config(dir, 1 << 30), path.clone(), false).await;
        let (text2, _, cached2) = chat(&c, &turn2).await;
        assert!(
            cached2 >= p1 - 1,
            "{name}: turn 2 reused {cached2} of turn 1's {p1} tokens"
        );
        let prompt2 = chat_tokens(&path, &turn2);
        assert_eq!(text2, reference(&path, &prompt2, 8), "{name}: turn 2");
        c.stop();
    } else {
        b.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_kv_snapshot_qwen3moe() {
    restart_reuses(fixture(), "qwen3moe", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_mla_and_indexer_state_glm_dsa() {
    restart_reuses(fixture_at("glm_dsa/a-f32.gguf"), "glm_dsa", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_compressed_state_deepseek4() {
    restart_reuses(fixture_at("deepseek4/a-f32.gguf"), "deepseek4", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_recurrent_state_qwen4exp() {
    restart_reuses(fixture_at("qwen4exp/a-f32.gguf"), "qwen4exp", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_recurrent_state_glm5next() {
    restart_reuses(fixture_at("glm5next/a-f32.gguf"), "glm5next", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reuses_gemma() {
    let Some(path) = std::env::var_os("SLUICE_GEMMA").map(PathBuf::from) else {
        assert!(
            std::env::var("SLUICE_REQUIRE_MODELS").as_deref() != Ok("1"),
            "SLUICE_GEMMA is unset and SLUICE_REQUIRE_MODELS=1"
        );
        eprintln!("skipped: SLUICE_GEMMA is unset (tools/get-gemma.sh)");
        return;
    };
    restart_reuses(path, "gemma", true).await;
}

/// Write turn 1's snapshot of `path` into `dir`; returns the file.
async fn write_one(path: &Path, dir: &Path) -> PathBuf {
    let mut a = start(disk_config(dir, 1 << 30), path.to_path_buf(), false).await;
    chat(&a, &TURN1).await;
    a.stop();
    let files = cache_files(dir);
    assert_eq!(files.len(), 1);
    files[0].clone()
}

/// A restarted server over `dir` computes turn 1 afresh: nothing reused, the engine's text.
async fn computes_afresh(path: &Path, dir: &Path, what: &str) {
    let mut s = start(disk_config(dir, 1 << 30), path.to_path_buf(), false).await;
    let (text, _, cached) = chat(&s, &TURN1).await;
    s.stop();
    assert_eq!(cached, 0, "{what}: nothing reused");
    let prompt = chat_tokens(path, &TURN1);
    assert_eq!(text, reference(path, &prompt, 8), "{what}: same text");
}

fn crc_fix(bytes: &mut [u8]) {
    let n = bytes.len();
    let crc = crc32fast::hash(&bytes[..n - 4]);
    bytes[n - 4..].copy_from_slice(&crc.to_le_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_truncated_and_foreign_files_are_ignored() {
    let path = fixture();
    let scratch = Scratch::new("damaged");
    let dir = &scratch.0;
    let file = write_one(&path, dir).await;
    let good = std::fs::read(&file).unwrap();
    let n = good.len();

    // A flipped bit in the snapshot's bytes: the checksum refuses it and it is removed.
    let mut bad = good.clone();
    bad[n - 100] ^= 0x10;
    std::fs::write(&file, &bad).unwrap();
    computes_afresh(&path, dir, "flipped bit").await;
    // The damaged file was removed; the run above wrote a good one in its place.
    assert_eq!(std::fs::read(&file).unwrap(), good);

    // Truncated: in the snapshot, and inside the header.
    for cut in [n - 1, n / 2, 20] {
        std::fs::write(&file, &good[..cut]).unwrap();
        computes_afresh(&path, dir, &format!("truncated to {cut}")).await;
        assert_eq!(std::fs::read(&file).unwrap(), good);
    }

    // Another format version (checksum valid): ignored.
    let mut v2 = good.clone();
    v2[8] = 2;
    crc_fix(&mut v2);
    std::fs::write(&file, &v2).unwrap();
    computes_afresh(&path, dir, "format version 2").await;

    // Another architecture's snapshot (MLA state) behind this file's header and tokens,
    // sizes and checksum made valid: the state does not match this model's, so it is
    // refused, never restored.
    let scratch2 = Scratch::new("damaged-other");
    let mla =
        std::fs::read(write_one(&fixture_at("glm_dsa/a-f32.gguf"), &scratch2.0).await).unwrap();
    let n_mla = u64::from_le_bytes(mla[24..32].try_into().unwrap()) as usize;
    let n_good = u64::from_le_bytes(good[24..32].try_into().unwrap()) as usize;
    let payload = &mla[40 + 4 * n_mla..mla.len() - 4];
    let mut spliced = good[..40 + 4 * n_good].to_vec();
    spliced[32..40].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    spliced.extend_from_slice(payload);
    spliced.extend_from_slice(&[0; 4]);
    crc_fix(&mut spliced);
    std::fs::write(&file, &spliced).unwrap();
    computes_afresh(&path, dir, "another architecture's state under this id").await;
    assert_eq!(std::fs::read(&file).unwrap(), good);

    // Another file of the same shape (f32 weights): its snapshot has another model id, so
    // it is ignored, and kept (it is that model's).
    let scratch3 = Scratch::new("damaged-f32");
    let other_file = write_one(&fixture_at("qwen3moe/a-f32.gguf"), &scratch3.0).await;
    for f in cache_files(dir) {
        std::fs::remove_file(f).unwrap();
    }
    let kept = dir.join(other_file.file_name().unwrap());
    std::fs::copy(&other_file, &kept).unwrap();
    computes_afresh(&path, dir, "another model's file").await;
    assert!(kept.exists(), "another model's file is left alone");
    assert_eq!(
        cache_files(dir).len(),
        2,
        "its own snapshot written beside it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directory_size_bound_holds() {
    let path = fixture();
    let scratch = Scratch::new("bound");
    let dir = &scratch.0;
    let one = std::fs::metadata(write_one(&path, dir).await)
        .unwrap()
        .len();
    // Room for two snapshots of about this size, not three.
    let bound = one * 5 / 2;
    let mut s = start(disk_config(dir, bound), path.clone(), false).await;
    let questions = [
        "Tell me a story about a cat",
        "Tell me a story about a dog",
        "Tell me a story about an owl",
        "Tell me a story about a bee",
    ];
    for (i, q) in questions.iter().enumerate() {
        chat(&s, &[TURN1[0], ("user", q)]).await;
        // The worker writes after answering: wait (bounded) until this one is on disk.
        s.wait_metric("sluice_prefix_disk_writes_total", |v| v >= (i + 1) as f64)
            .await;
        assert!(dir_bytes(dir) <= bound, "after {} conversations", i + 1);
    }
    s.stop();
    let files = cache_files(dir);
    assert!(
        dir_bytes(dir) <= bound,
        "{} bytes in the directory, bound {bound}",
        dir_bytes(dir)
    );
    assert_eq!(files.len(), 2, "two snapshots fit: {files:?}");
    // The newest conversation survived: a restart reuses it.
    let mut s = start(disk_config(dir, bound), path.clone(), false).await;
    let (_, p, cached) = chat(&s, &[TURN1[0], ("user", questions[3])]).await;
    assert_eq!(cached, p - 1);
    s.stop();
    // A smaller bound at start shrinks the directory at once.
    let s = start(disk_config(dir, one * 3 / 2), path.clone(), false).await;
    assert!(dir_bytes(dir) <= one * 3 / 2);
    assert_eq!(cache_files(dir).len(), 1);
    drop(s);
}
