//! The writer (round trips on hand-built files, streaming, error cases) and the range and
//! metadata queries, with expected values computed by hand from the byte layout.

mod common;

use common::{small_valid, Bytes};
use sluice_gguf::{
    GgmlType, GgufError, GgufFile, GgufWriter, MetaArray, MetaType, MetaValue, TensorSpec,
};

fn rewrite(bytes: &[u8]) -> Vec<u8> {
    let f = GgufFile::parse(bytes, "in.gguf".as_ref()).unwrap();
    let mut src = std::io::Cursor::new(bytes);
    GgufWriter::rewrite(&f, &mut src, Vec::new(), "out.gguf".as_ref()).unwrap()
}

#[test]
fn rewrite_of_small_file_is_byte_identical() {
    let b = small_valid();
    assert_eq!(rewrite(&b), b);
}

#[test]
fn rewrite_keeps_version_2() {
    let mut b = small_valid();
    b[4] = 2;
    assert_eq!(rewrite(&b), b);
}

#[test]
fn rewrite_with_every_value_type_and_custom_alignment() {
    let b = Bytes::header(3, 1, 15)
        .str("u8")
        .u32(0)
        .u8(0xfe)
        .str("i8")
        .u32(1)
        .u8(0x80)
        .str("u16")
        .u32(2)
        .raw(&0xbeefu16.to_le_bytes())
        .str("i16")
        .u32(3)
        .raw(&(-2i16).to_le_bytes())
        .kv_u32("u32", 7)
        .str("i32")
        .u32(5)
        .raw(&(-7i32).to_le_bytes())
        .str("f32")
        .u32(6)
        .raw(&f32::NAN.to_le_bytes())
        .str("bool")
        .u32(7)
        .u8(1)
        .kv_str("str", "héllo")
        .str("u64")
        .u32(10)
        .u64(u64::MAX)
        .str("i64")
        .u32(11)
        .raw(&i64::MIN.to_le_bytes())
        .str("f64")
        .u32(12)
        .raw(&(-0.0f64).to_le_bytes())
        .str("nested")
        .u32(9)
        .u32(9)
        .u64(2)
        .u32(4)
        .u64(1)
        .u32(5)
        .u32(8)
        .u64(0)
        .str("empty")
        .u32(9)
        .u32(8)
        .u64(0)
        .kv_u32("general.alignment", 64)
        .tensor("q", &[64, 2], 8, 0) // Q8_0: 2 blocks of 34 bytes per row
        .pad(64)
        .raw(&[7u8; 136])
        .pad(64);
    let f = GgufFile::parse(&b.0, "x".as_ref()).unwrap();
    assert_eq!(f.get("u8"), Some(&MetaValue::U8(0xfe)));
    assert_eq!(f.get("i8"), Some(&MetaValue::I8(-128)));
    assert_eq!(f.get("u16"), Some(&MetaValue::U16(0xbeef)));
    assert_eq!(f.get("i16"), Some(&MetaValue::I16(-2)));
    assert_eq!(f.get("i32"), Some(&MetaValue::I32(-7)));
    assert!(f.get("f32").unwrap().as_f32().unwrap().is_nan());
    assert!(f.get_bool("bool").unwrap());
    assert_eq!(f.get_str("str").unwrap(), "héllo");
    assert_eq!(f.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(f.get("i64").unwrap().as_i64(), Some(i64::MIN));
    assert_eq!(f.get("f64"), Some(&MetaValue::F64(-0.0)));
    let nested = f.get("nested").unwrap().as_array().unwrap();
    assert_eq!(nested.elem_type, MetaType::Array);
    assert_eq!(
        nested.values[0],
        MetaValue::Array(MetaArray {
            elem_type: MetaType::U32,
            values: vec![MetaValue::U32(5)]
        })
    );
    assert_eq!(
        nested.values[1],
        MetaValue::Array(MetaArray {
            elem_type: MetaType::String,
            values: vec![]
        })
    );
    assert_eq!(f.alignment, 64);
    assert_eq!(f.tensors[0].n_bytes, 136);
    assert_eq!(rewrite(&b.0), b.0);
}

#[test]
fn writer_streams_in_chunks_and_pads() {
    let meta = vec![(
        "general.architecture".to_string(),
        MetaValue::Str("t".into()),
    )];
    let specs = [
        TensorSpec::new("a", &[3], GgmlType::F32), // 12 bytes, padded to 32
        TensorSpec::new("b", &[32, 2], GgmlType::Q4_0), // 2 rows x 18 bytes = 36, padded to 64
    ];
    let mut w = GgufWriter::new(Vec::new(), "w.gguf".as_ref(), &meta, &specs).unwrap();
    let layout = w.layout().clone();
    assert_eq!(layout.tensors[0].offset, 0);
    assert_eq!(layout.tensors[1].offset, 32);
    assert_eq!(layout.file_size, layout.data_offset + 96);
    w.write_tensor("a", &[1u8; 12]).unwrap();
    for _ in 0..6 {
        w.write_data(&[2u8; 6]).unwrap();
    }
    assert!(w.next_tensor().is_none());
    let out = w.finish().unwrap();
    assert_eq!(out.len() as u64, layout.file_size);
    let f = GgufFile::parse(&out, "w.gguf".as_ref()).unwrap();
    assert_eq!(f.tensors, layout.tensors);
    let d = f.data_offset as usize;
    assert_eq!(&out[d..d + 12], &[1u8; 12]);
    assert!(out[d + 12..d + 32].iter().all(|&x| x == 0));
    assert_eq!(&out[d + 32..d + 68], &[2u8; 36]);
    assert!(out[d + 68..].iter().all(|&x| x == 0));
    // Independent check of the header start.
    assert_eq!(&out[..4], b"GGUF");
    assert_eq!(u32::from_le_bytes(out[4..8].try_into().unwrap()), 3);
    assert_eq!(u64::from_le_bytes(out[8..16].try_into().unwrap()), 2);
    assert_eq!(u64::from_le_bytes(out[16..24].try_into().unwrap()), 1);
}

#[test]
fn writer_rejects_wrong_sizes_order_and_early_finish() {
    let specs = [
        TensorSpec::new("a", &[4], GgmlType::F32),
        TensorSpec::new("b", &[4], GgmlType::F32),
    ];
    let mut w = GgufWriter::new(Vec::new(), "w.gguf".as_ref(), &[], &specs).unwrap();
    assert!(matches!(
        w.write_tensor("a", &[0; 15]),
        Err(GgufError::WriteSize {
            expected: 16,
            found: 15,
            ..
        })
    ));
    assert!(matches!(
        w.write_tensor("b", &[0; 16]),
        Err(GgufError::WriteOrder { .. })
    ));
    assert!(matches!(
        w.write_data(&[0; 17]),
        Err(GgufError::WriteSize {
            expected: 16,
            found: 17,
            ..
        })
    ));
    w.write_tensor("a", &[0; 16]).unwrap();
    let mut short = std::io::Cursor::new(vec![0u8; 10]);
    assert!(matches!(
        w.copy_tensor("b", &mut short),
        Err(GgufError::WriteSize {
            expected: 16,
            found: 10,
            ..
        })
    ));
    assert!(matches!(
        w.finish(),
        Err(GgufError::WriteIncomplete {
            expected: 2,
            found: 1,
            ..
        })
    ));
}

#[test]
fn writer_rejects_what_the_reader_rejects() {
    let dup = [
        TensorSpec::new("a", &[4], GgmlType::F32),
        TensorSpec::new("a", &[4], GgmlType::F32),
    ];
    assert!(matches!(
        GgufWriter::new(Vec::new(), "w".as_ref(), &[], &dup),
        Err(GgufError::DuplicateTensor { .. })
    ));
    let bad_row = [TensorSpec::new("q", &[31], GgmlType::Q8_0)];
    assert!(matches!(
        GgufWriter::new(Vec::new(), "w".as_ref(), &[], &bad_row),
        Err(GgufError::RowNotBlockMultiple { .. })
    ));
    let k = |s: &str| (s.to_string(), MetaValue::U32(1));
    assert!(matches!(
        GgufWriter::new(Vec::new(), "w".as_ref(), &[k("x"), k("x")], &[]),
        Err(GgufError::DuplicateKey { .. })
    ));
    let mixed = MetaValue::Array(MetaArray {
        elem_type: MetaType::U32,
        values: vec![MetaValue::U8(1)],
    });
    assert!(matches!(
        GgufWriter::new(Vec::new(), "w".as_ref(), &[("m".into(), mixed)], &[]),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        GgufWriter::with_version(Vec::new(), "w".as_ref(), 1, &[], &[]),
        Err(GgufError::WriteVersion { found: 1, .. })
    ));
}

/// A file with a stacked expert tensor [cols=32, rows=3, n_expert=4] in Q8_0 (34 bytes/row).
fn experts_file() -> GgufFile {
    let b = Bytes::header(3, 2, 0)
        .tensor("norm", &[8], 0, 0) // 32 bytes
        .tensor("blk.0.ffn_up_exps.weight", &[32, 3, 4], 8, 32) // 12 rows x 34 = 408 bytes
        .pad(32)
        .zeros(32 + 416);
    GgufFile::parse(&b.0, "e.gguf".as_ref()).unwrap()
}

#[test]
fn expert_range_is_rows_times_row_bytes() {
    let f = experts_file();
    let t = f.tensor("blk.0.ffn_up_exps.weight").unwrap();
    let base = f.data_offset + 32;
    assert_eq!(f.tensor_range(t), base..base + 408);
    assert_eq!(f.expert_range(t, 0).unwrap(), base..base + 102);
    assert_eq!(f.expert_range(t, 3).unwrap(), base + 306..base + 408);
    assert!(matches!(
        f.expert_range(t, 4),
        Err(GgufError::ExpertOutOfRange {
            expert: 4,
            n_expert: 4,
            ..
        })
    ));
    let norm = f.tensor("norm").unwrap();
    assert!(matches!(
        f.expert_range(norm, 0),
        Err(GgufError::NotStacked { n_dims: 1, .. })
    ));
}

#[test]
fn rows_range_is_row_bytes_times_rows() {
    let f = experts_file();
    let t = f.tensor("blk.0.ffn_up_exps.weight").unwrap();
    assert_eq!((t.n_rows(), t.row_bytes(), t.n_elements()), (12, 34, 384));
    let base = f.data_offset + 32;
    assert_eq!(f.rows_range(t, 2..5).unwrap(), base + 68..base + 170);
    assert_eq!(f.rows_range(t, 12..12).unwrap(), base + 408..base + 408);
    assert!(matches!(
        f.rows_range(t, 11..13),
        Err(GgufError::RowsOutOfRange { n_rows: 12, .. })
    ));
    let norm = f.tensor("norm").unwrap();
    assert_eq!(
        f.rows_range(norm, 0..1).unwrap(),
        f.data_offset..f.data_offset + 32
    );
}

#[test]
fn typed_getters_report_missing_and_wrong_types() {
    let f = GgufFile::parse(&small_valid(), "g.gguf".as_ref()).unwrap();
    assert_eq!(f.architecture().unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 2);
    let e = f.get_u32("nope").unwrap_err();
    assert!(matches!(e, GgufError::MissingKey { ref key, .. } if key == "nope"));
    assert_eq!(
        e.to_string(),
        "g.gguf: key \"nope\": expected present, found missing"
    );
    assert!(matches!(
        f.get_str("llama.block_count"),
        Err(GgufError::WrongType {
            expected: "string",
            ..
        })
    ));
    assert!(matches!(
        f.get_f32("general.architecture"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_bool("tokenizer.ggml.tokens"),
        Err(GgufError::WrongType { .. })
    ));
    let toks = f.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
    assert_eq!(
        toks.values,
        vec![
            MetaValue::Str("a".into()),
            MetaValue::Str("bc".into()),
            MetaValue::Str(String::new())
        ]
    );
}
