//! `sluice inspect` end to end: the built binary on generated files (sizes computed by hand
//! from dims and ggml block geometry), a truncated file and a non-GGUF file.

mod common;

use common::{sluice, tmp_dir};
use std::path::Path;
use std::process::Output;

use serde_json::Value;
use sluice_gguf::{GgmlType, GgufWriter, MetaValue, TensorSpec};

/// A tiny MoE-shaped file; returns its path.
fn write_moe(path: &Path) {
    let meta = vec![
        (
            "general.architecture".to_string(),
            MetaValue::Str("tinymoe".into()),
        ),
        ("tinymoe.expert_count".to_string(), MetaValue::U32(8)),
    ];
    let specs = [
        TensorSpec::new("token_embd.weight", &[32, 10], GgmlType::Q8_0), // 10 rows x 34 = 340
        TensorSpec::new("output_norm.weight", &[32], GgmlType::F32),     // 128
        TensorSpec::new("blk.0.ffn_gate_exps.weight", &[32, 4, 8], GgmlType::F32), // 8 x 512
        TensorSpec::new("blk.0.ffn_up_exps.weight", &[32, 4, 8], GgmlType::F32), // 8 x 512
        TensorSpec::new("blk.0.ffn_down_exps.weight", &[16, 32, 8], GgmlType::F32), // 8 x 2048
        TensorSpec::new("per_layer_token_embd.weight", &[64, 10], GgmlType::F16), // 1280
        TensorSpec::new("output.weight", &[256, 2], GgmlType::Q4_K),     // 2 x 144 = 288
    ];
    let out = std::fs::File::create(path).unwrap();
    let mut w = GgufWriter::new(std::io::BufWriter::new(out), path, &meta, &specs).unwrap();
    for s in &specs {
        let n = w.next_tensor().unwrap().n_bytes as usize;
        w.write_tensor(&s.name, &vec![0x11; n]).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn inspect_json_roles_sum_to_tensor_bytes() {
    let dir = tmp_dir("json");
    let path = dir.join("moe.gguf");
    write_moe(&path);
    let out = sluice(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();

    let expected_total = 340 + 128 + 4096 + 4096 + 16384 + 1280 + 288;
    assert_eq!(v["tensor_bytes"], expected_total);
    let tensor_sum: u64 = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(tensor_sum, expected_total);
    let roles = &v["roles"];
    let role_sum: u64 = ["routed_experts", "ple", "embeddings", "resident"]
        .iter()
        .map(|r| roles[r]["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(role_sum, expected_total);
    assert_eq!(roles["routed_experts"]["bytes"], 4096 + 4096 + 16384);
    assert_eq!(roles["ple"]["bytes"], 1280);
    assert_eq!(roles["embeddings"]["bytes"], 340 + 288);
    assert_eq!(roles["resident"]["bytes"], 128);
    let pct_sum: f64 = ["routed_experts", "ple", "embeddings", "resident"]
        .iter()
        .map(|r| roles[r]["percent"].as_f64().unwrap())
        .sum();
    assert!((pct_sum - 100.0).abs() < 1e-9);
    assert_eq!(v["experts"]["count"], 8);
    assert_eq!(v["experts"]["one_expert_bytes"], 512 + 512 + 2048);
    assert_eq!(v["architecture"], "tinymoe");
    assert_eq!(v["file_size"], std::fs::metadata(&path).unwrap().len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inspect_text_abbreviates_long_arrays() {
    let dir = tmp_dir("text");
    let path = dir.join("tok.gguf");
    let tokens: Vec<MetaValue> = (0..1000).map(|i| MetaValue::Str(format!("t{i}"))).collect();
    let meta = vec![(
        "tokenizer.ggml.tokens".to_string(),
        MetaValue::Array(sluice_gguf::MetaArray {
            elem_type: sluice_gguf::MetaType::String,
            values: tokens,
        }),
    )];
    let w = GgufWriter::new(std::fs::File::create(&path).unwrap(), &path, &meta, &[]).unwrap();
    w.finish().unwrap();
    let out = sluice(&["inspect", path.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("tokenizer.ggml.tokens = [1000 strings: \"t0\", \"t1\", \"t2\", ...]"),
        "{text}"
    );
    assert!(text.contains("architecture:  (none)"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn assert_one_line_error(out: &Output, path: &Path) {
    assert!(!out.status.success());
    let err = String::from_utf8(out.stderr.clone()).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.starts_with(&format!("error: {}: ", path.display())),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn inspect_truncated_file_fails_with_one_line() {
    let dir = tmp_dir("trunc");
    let path = dir.join("moe.gguf");
    write_moe(&path);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let out = sluice(&["inspect", path.to_str().unwrap()]);
    assert_one_line_error(&out, &path);
    assert!(String::from_utf8_lossy(&out.stderr).contains("output.weight"));
    std::fs::write(&path, &bytes[..20]).unwrap();
    let out = sluice(&["inspect", path.to_str().unwrap(), "--json"]);
    assert_one_line_error(&out, &path);
    assert!(String::from_utf8_lossy(&out.stderr).contains("truncated"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inspect_non_gguf_file_fails_with_one_line() {
    let dir = tmp_dir("notgguf");
    let path = dir.join("readme.txt");
    std::fs::write(&path, "hello, this is not a model\n").unwrap();
    let out = sluice(&["inspect", path.to_str().unwrap()]);
    assert_one_line_error(&out, &path);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a GGUF file"));
    let missing = dir.join("missing.gguf");
    let out = sluice(&["inspect", missing.to_str().unwrap()]);
    assert_one_line_error(&out, &missing);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inspect_gemma_json_matches_gguf_python_fixture() {
    let Some(path) = std::env::var_os("SLUICE_GEMMA") else {
        if std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1") {
            panic!("SLUICE_GEMMA is unset but SLUICE_REQUIRE_MODELS=1");
        }
        eprintln!("note: SLUICE_GEMMA unset, skipping the real-model test");
        return;
    };
    let fx: Value = serde_json::from_str(include_str!(
        "../../gguf/tests/fixtures/gemma3_270m_metadata.json"
    ))
    .unwrap();
    let out = sluice(&["inspect", path.to_str().unwrap(), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let fx_tensors = fx["tensors"].as_array().unwrap();
    let total: u64 = fx_tensors
        .iter()
        .map(|t| t["n_bytes"].as_u64().unwrap())
        .sum();
    let embd: u64 = fx_tensors
        .iter()
        .filter(|t| t["name"] == "token_embd.weight" || t["name"] == "output.weight")
        .map(|t| t["n_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(v["tensor_bytes"], total);
    assert_eq!(v["roles"]["embeddings"]["bytes"], embd);
    assert_eq!(v["roles"]["routed_experts"]["bytes"], 0);
    assert_eq!(v["roles"]["ple"]["bytes"], 0);
    assert_eq!(v["roles"]["resident"]["bytes"], total - embd);
    assert_eq!(v["experts"], Value::Null);
    assert_eq!(v["architecture"], "gemma3");
    assert_eq!(v["data_offset"], fx["data_offset"]);
    assert_eq!(v["tensors"].as_array().unwrap().len(), 236);
    let tokens = v["metadata"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["key"] == "tokenizer.ggml.tokens")
        .unwrap();
    assert_eq!(tokens["value"]["len"], 262144);
    assert_eq!(tokens["value"]["values"][0], "<pad>");
}
