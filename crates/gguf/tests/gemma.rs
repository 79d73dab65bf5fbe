//! The real Gemma 3 270M file (env SLUICE_GEMMA) against the `gguf` Python package's reading
//! of it (fixture from tools/fixtures/gguf_metadata.py), and a byte-exact streaming rewrite.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Write};

use serde_json::Value;
use sluice_gguf::{GgufFile, GgufWriter, MetaType, MetaValue};

const FIXTURE: &str = include_str!("fixtures/gemma3_270m_metadata.json");

/// gguf-py's `GGUFValueType` names.
fn py_type_name(t: MetaType) -> &'static str {
    match t {
        MetaType::U8 => "UINT8",
        MetaType::I8 => "INT8",
        MetaType::U16 => "UINT16",
        MetaType::I16 => "INT16",
        MetaType::U32 => "UINT32",
        MetaType::I32 => "INT32",
        MetaType::F32 => "FLOAT32",
        MetaType::Bool => "BOOL",
        MetaType::String => "STRING",
        MetaType::Array => "ARRAY",
        MetaType::U64 => "UINT64",
        MetaType::I64 => "INT64",
        MetaType::F64 => "FLOAT64",
    }
}

fn scalar_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::U8(x) => (*x).into(),
        MetaValue::I8(x) => (*x).into(),
        MetaValue::U16(x) => (*x).into(),
        MetaValue::I16(x) => (*x).into(),
        MetaValue::U32(x) => (*x).into(),
        MetaValue::I32(x) => (*x).into(),
        MetaValue::U64(x) => (*x).into(),
        MetaValue::I64(x) => (*x).into(),
        MetaValue::F32(x) => f64::from(*x).into(),
        MetaValue::F64(x) => (*x).into(),
        MetaValue::Bool(x) => (*x).into(),
        MetaValue::Str(s) => s.as_str().into(),
        MetaValue::Array(_) => panic!("nested array in the Gemma file"),
    }
}

fn fnv1a(strings: &[MetaValue]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for s in strings {
        for &b in s.as_str().unwrap().as_bytes().iter().chain(&[0xffu8]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

#[test]
fn gemma_header_matches_gguf_python_package() {
    let Some(path) = common::gemma() else { return };
    let f = GgufFile::open(&path).unwrap();
    let fx: Value = serde_json::from_str(FIXTURE).unwrap();

    assert_eq!(u64::from(f.version), fx["version"].as_u64().unwrap());
    assert_eq!(f.alignment, fx["alignment"].as_u64().unwrap());
    assert_eq!(f.data_offset, fx["data_offset"].as_u64().unwrap());
    assert_eq!(f.file_size, std::fs::metadata(&path).unwrap().len());
    assert_eq!(f.architecture().unwrap(), "gemma3");

    // Tensors: count, per-type counts (also pinned literally from the brief), every info.
    assert_eq!(f.tensors.len(), 236);
    assert_eq!(f.tensors.len() as u64, fx["tensor_count"].as_u64().unwrap());
    let mut counts = BTreeMap::new();
    for t in &f.tensors {
        *counts.entry(t.ty.name().to_string()).or_insert(0u64) += 1;
    }
    let expected: BTreeMap<String, u64> = [
        ("F32", 109),
        ("Q8_0", 10),
        ("Q5_0", 81),
        ("Q4_K", 27),
        ("Q6_K", 9),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(counts, expected);
    let fx_counts: BTreeMap<String, u64> = fx["type_counts"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_u64().unwrap()))
        .collect();
    assert_eq!(counts, fx_counts);
    let fx_tensors = fx["tensors"].as_array().unwrap();
    for (t, e) in f.tensors.iter().zip(fx_tensors) {
        assert_eq!(t.name, e["name"].as_str().unwrap());
        assert_eq!(t.ty.name(), e["type"].as_str().unwrap(), "{}", t.name);
        let dims: Vec<u64> = e["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "{}", t.name);
        assert_eq!(t.offset, e["offset"].as_u64().unwrap(), "{}", t.name);
        assert_eq!(t.n_bytes, e["n_bytes"].as_u64().unwrap(), "{}", t.name);
    }

    // Metadata: same keys in the same order, same types and values.
    let fx_meta = fx["metadata"].as_array().unwrap();
    assert_eq!(f.metadata.len(), fx_meta.len());
    for ((key, v), e) in f.metadata.iter().zip(fx_meta) {
        assert_eq!(key, e["key"].as_str().unwrap());
        assert_eq!(
            py_type_name(v.meta_type()),
            e["type"].as_str().unwrap(),
            "{key}"
        );
        let Some(a) = v.as_array() else {
            assert_eq!(scalar_json(v), e["value"], "{key}");
            continue;
        };
        assert_eq!(
            py_type_name(a.elem_type),
            e["elem_type"].as_str().unwrap(),
            "{key}"
        );
        assert_eq!(a.values.len() as u64, e["len"].as_u64().unwrap(), "{key}");
        let first: Vec<Value> = a.values.iter().take(16).map(scalar_json).collect();
        assert_eq!(&Value::Array(first), &e["first"], "{key}");
        match a.elem_type {
            MetaType::String => {
                let n: u64 = a
                    .values
                    .iter()
                    .map(|s| s.as_str().unwrap().len() as u64)
                    .sum();
                assert_eq!(n, e["byte_len_sum"].as_u64().unwrap(), "{key}");
                let h: u64 = e["fnv1a64"].as_str().unwrap().parse().unwrap();
                assert_eq!(fnv1a(&a.values), h, "{key}");
            }
            MetaType::F32 | MetaType::F64 => {
                let sum: f64 = a
                    .values
                    .iter()
                    .map(|x| f64::from(x.as_f32().unwrap()))
                    .sum();
                let want = e["sum"].as_f64().unwrap();
                assert!(
                    (sum - want).abs() <= 1e-9 * want.abs().max(1.0),
                    "{key}: {sum} vs {want}"
                );
            }
            _ => {
                let sum: i128 = a
                    .values
                    .iter()
                    .map(|x| match x {
                        MetaValue::Bool(b) => i128::from(*b),
                        x => i128::from(x.as_i64().unwrap()),
                    })
                    .sum();
                let want: i128 = e["sum"].as_str().unwrap().parse().unwrap();
                assert_eq!(sum, want, "{key}");
            }
        }
    }
}

/// A `Write` that compares everything written against a reader of the expected bytes.
struct CompareWriter<R> {
    expected: R,
    pos: u64,
    buf: Vec<u8>,
}

impl<R: Read> Write for CompareWriter<R> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.resize(data.len(), 0);
        self.expected.read_exact(&mut self.buf)?;
        if let Some(i) = self.buf.iter().zip(data).position(|(a, b)| a != b) {
            panic!(
                "rewrite differs from the original at byte {}",
                self.pos + i as u64
            );
        }
        self.pos += data.len() as u64;
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn gemma_rewrite_is_byte_identical() {
    let Some(path) = common::gemma() else { return };
    let f = GgufFile::open(&path).unwrap();
    let mut src = BufReader::new(File::open(&path).unwrap());
    let cmp = CompareWriter {
        expected: BufReader::new(File::open(&path).unwrap()),
        pos: 0,
        buf: Vec::new(),
    };
    let cmp = GgufWriter::rewrite(&f, &mut src, cmp, "rewrite".as_ref()).unwrap();
    assert_eq!(
        cmp.pos, f.file_size,
        "rewrite wrote a different number of bytes"
    );
}
