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

/// `tests/fixtures/dump_tensor/` (tools/fixtures/gen_dump_tensor.py): real Gemma rows and the
/// gguf package's dequantization of them.
fn dump_fixture_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/dump_tensor")
}

/// A little-endian f32 C-order `.npy` file: (shape, values); panics on anything else.
fn read_npy_f32(path: &Path) -> (Vec<u64>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00", "{}", path.display());
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    assert_eq!((10 + hlen) % 64, 0, "header not 64-aligned");
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(header.ends_with('\n'), "{header:?}");
    assert!(header.contains("'descr': '<f4'"), "{header:?}");
    assert!(header.contains("'fortran_order': False"), "{header:?}");
    let shape_txt = header.split("'shape': (").nth(1).unwrap();
    let shape_txt = &shape_txt[..shape_txt.find(')').unwrap()];
    let shape: Vec<u64> = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    let data = &b[10 + hlen..];
    let vals: Vec<f32> = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(vals.len() as u64, shape.iter().product::<u64>());
    (shape, vals)
}

#[test]
fn dump_tensor_equals_gguf_package_dequantize() {
    let fx = dump_fixture_dir();
    let gguf = fx.join("rows.gguf");
    let manifest: Value =
        serde_json::from_slice(&std::fs::read(fx.join("manifest.json")).unwrap()).unwrap();
    let dir = tmp_dir("dump");
    let mut types = Vec::new();
    for m in manifest.as_array().unwrap() {
        let name = m["name"].as_str().unwrap();
        let out_path = dir.join(format!("{name}.npy"));
        let out = sluice(&[
            "inspect",
            gguf.to_str().unwrap(),
            "--dump-tensor",
            name,
            "--output",
            out_path.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (shape, got) = read_npy_f32(&out_path);
        let (want_shape, want) = read_npy_f32(&fx.join(m["expected"].as_str().unwrap()));
        assert_eq!(shape, want_shape, "{name}");
        let manifest_shape: Vec<u64> = m["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(shape, manifest_shape, "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name}[{i}]: {g} vs {w}");
        }
        types.push(m["type"].as_str().unwrap().to_string());
    }
    // The fixture covers the Q4_K_M file's types, a 3-D tensor (logical shape reversed) and
    // real rows of llama-quantize's output in the newer formats.
    for ty in [
        "Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32", "F16", "Q2_K", "Q3_K", "Q5_K", "Q4_0", "IQ4_NL",
        "IQ2_XXS", "IQ3_XXS", "IQ3_S",
    ] {
        assert!(types.iter().any(|t| t == ty), "fixture lacks {ty}");
    }
    // No temp file left next to the outputs.
    for e in std::fs::read_dir(&dir).unwrap() {
        let n = e.unwrap().file_name();
        assert!(
            !n.to_string_lossy().contains(".tmp."),
            "temp file left: {n:?}"
        );
    }
}

#[test]
fn dump_tensor_errors() {
    let gguf = dump_fixture_dir().join("rows.gguf");
    let gguf = gguf.to_str().unwrap();
    let dir = tmp_dir("dump-err");
    let out_path = dir.join("x.npy");
    let out_s = out_path.to_str().unwrap();
    let run = |name: &str| {
        let out = sluice(&["inspect", gguf, "--dump-tensor", name, "--output", out_s]);
        assert!(!out.status.success(), "{name} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = run("blk.0.attn_k.weigth");
    assert!(e.contains("no tensor named 'blk.0.attn_k.weigth'"), "{e}");
    assert!(e.contains("did you mean 'blk.0.attn_k.weight'"), "{e}");
    let e = run("ffn_down");
    assert!(e.contains("'blk.0.ffn_down.weight'"), "{e}");
    let e = run("zzz");
    assert!(
        e.contains("no tensor named 'zzz'") && e.contains("sluice inspect"),
        "{e}"
    );
    let e = run("synthetic.i32");
    assert!(
        e.contains("type I32") && e.contains("cannot dequantize"),
        "{e}"
    );
    assert!(
        !out_path.exists(),
        "an output was written for a failed dump"
    );
    // --dump-tensor without --output is a usage error.
    let out = sluice(&["inspect", gguf, "--dump-tensor", "output_norm.weight"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--output"));
}
