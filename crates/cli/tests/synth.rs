//! `sluice synth` end to end: the file `sluice inspect --json` sees (tensor count and expert
//! bytes computed by hand from the dims and Q6_K's 210-byte blocks of 256), `sluice run` on
//! it, and the refusal of a file larger than the free space (nothing left behind).

mod common;

use common::{sluice, tmp_dir};

use std::process::Output;

use serde_json::Value;

fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "stdout: {}\nstderr: {}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn synth_inspect_and_run() {
    let dir = tmp_dir("inspect");
    let file = dir.join("m.gguf");
    let f = file.to_str().unwrap();
    let o = sluice(&[
        "synth",
        "-o",
        f,
        "--layers",
        "3",
        "--hidden",
        "256",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--expert-ff",
        "512",
        "--quant",
        "Q6_K",
        "--seed",
        "5",
    ]);
    ok(&o);
    let o = sluice(&["inspect", "--json", f]);
    ok(&o);
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    // token_embd, 12 per layer, output_norm, output.
    assert_eq!(v["tensors"].as_array().unwrap().len(), 2 + 12 * 3 + 1);
    assert_eq!(v["architecture"], "qwen3moe");
    // Per layer: gate and up [256, 512, 4] = 2048 rows x 1 block; down [512, 256, 4] =
    // 1024 rows x 2 blocks; 210 bytes a block.
    let per_layer = (2 * 2048 + 1024 * 2) * 210;
    assert_eq!(v["roles"]["routed_experts"]["bytes"], 3 * per_layer);
    assert_eq!(v["experts"]["one_expert_bytes"], per_layer / 4);
    assert_eq!(v["experts"]["count"], 4);
    assert_eq!(v["experts"]["layers"], 3);
    assert_eq!(
        v["file_size"].as_u64().unwrap(),
        std::fs::metadata(&file).unwrap().len()
    );
    let o = sluice(&["run", "-m", f, "-p", "the cat", "-n", "4"]);
    ok(&o);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn synth_refuses_a_file_larger_than_the_free_space() {
    let dir = tmp_dir("nospace");
    let file = dir.join("huge.gguf");
    let o = sluice(&[
        "synth",
        "-o",
        file.to_str().unwrap(),
        "--preset",
        "qwen3-235b-a22b",
        "--layers",
        "20000",
        "--quant",
        "F32",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not enough free space"), "{err}");
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        0,
        "files left in {dir:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
