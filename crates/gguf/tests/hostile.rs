//! Hostile headers built byte by byte: one test per validation limit, each asserting the
//! specific `GgufError` variant, and that every message is one line naming the file.

mod common;

use common::{small_valid, Bytes};
use sluice_gguf::{GgufError, GgufFile};

fn parse(b: &Bytes) -> Result<GgufFile, GgufError> {
    GgufFile::parse(&b.0, "hostile.gguf".as_ref())
}

fn err(b: &Bytes) -> GgufError {
    let e = parse(b).expect_err("hostile file was accepted");
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "multi-line message: {msg}");
    assert!(
        msg.starts_with("hostile.gguf: "),
        "message does not name the file: {msg}"
    );
    e
}

/// A header with no keys and `tensor` as the only tensor info, padded, plus `data` bytes.
fn one_tensor(name: &str, dims: &[u64], ty: u32, offset: u64, data: usize) -> Bytes {
    Bytes::header(3, 1, 0)
        .tensor(name, dims, ty, offset)
        .pad(32)
        .zeros(data)
}

#[test]
fn small_valid_file_is_accepted() {
    let f = GgufFile::parse(&small_valid(), "ok.gguf".as_ref()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.tensors.len(), 2);
    assert_eq!(f.metadata.len(), 3);
    assert_eq!(f.alignment, 32);
}

#[test]
fn bad_magic_says_not_a_gguf_file() {
    let e = err(&Bytes::new().raw(b"GGML").u32(3).u64(0).u64(0));
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    assert!(e.to_string().contains("not a GGUF file"));
}

#[test]
fn file_shorter_than_magic_is_not_a_gguf_file() {
    for b in [&b""[..], b"G", b"GGU"] {
        let e = err(&Bytes::new().raw(b));
        assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    }
}

#[test]
fn version_1_is_unsupported() {
    let e = err(&Bytes::header(1, 0, 0).pad(32));
    assert!(
        matches!(e, GgufError::UnsupportedVersion { found: 1, .. }),
        "{e}"
    );
}

#[test]
fn version_4_is_unsupported() {
    let e = err(&Bytes::header(4, 0, 0).pad(32));
    assert!(
        matches!(e, GgufError::UnsupportedVersion { found: 4, .. }),
        "{e}"
    );
}

#[test]
fn version_2_is_accepted() {
    let mut b = small_valid();
    b[4] = 2;
    assert_eq!(GgufFile::parse(&b, "v2.gguf".as_ref()).unwrap().version, 2);
}

#[test]
fn truncated_counts_report_offset_and_field() {
    let e = err(&Bytes::new().raw(b"GGUF").u32(3).u32(0));
    match e {
        GgufError::Truncated {
            offset,
            ref what,
            needed,
            available,
            ..
        } => {
            assert_eq!((offset, needed, available), (8, 8, 4));
            assert_eq!(what, "tensor count");
        }
        ref e => panic!("{e}"),
    }
}

#[test]
fn tensor_count_above_hard_limit() {
    let e = err(&Bytes::header(3, u64::MAX, 0).zeros(64));
    assert!(
        matches!(
            e,
            GgufError::TooManyTensors {
                found: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn tensor_count_beyond_remaining_bytes() {
    // 64 bytes left hold at most 2 minimal tensor infos (32 bytes each).
    let e = err(&Bytes::header(3, 3, 0).zeros(64));
    assert!(
        matches!(
            e,
            GgufError::TooManyTensors {
                found: 3,
                limit: 2,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn key_count_above_hard_limit() {
    let e = err(&Bytes::header(3, 0, (1 << 20) + 1).zeros(64));
    assert!(matches!(e, GgufError::TooManyKeys { .. }), "{e}");
}

#[test]
fn key_count_beyond_remaining_bytes() {
    // 26 bytes left hold at most 2 minimal key/values (13 bytes each).
    let e = err(&Bytes::header(3, 0, 3).zeros(26));
    assert!(
        matches!(
            e,
            GgufError::TooManyKeys {
                found: 3,
                limit: 2,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn string_length_beyond_remaining_bytes() {
    let e = err(&Bytes::header(3, 0, 1)
        .str("k")
        .u32(8)
        .u64(1000)
        .raw(b"short"));
    assert!(
        matches!(
            e,
            GgufError::StringTooLong {
                found: 1000,
                limit: 5,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn string_length_u64_max_does_not_allocate() {
    let e = err(&Bytes::header(3, 0, 1)
        .str("k")
        .u32(8)
        .u64(u64::MAX)
        .zeros(16));
    assert!(
        matches!(
            e,
            GgufError::StringTooLong {
                found: u64::MAX,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn key_longer_than_name_cap() {
    let key = "k".repeat(70_000);
    let e = err(&Bytes::header(3, 0, 1).kv_u32(&key, 1));
    assert!(
        matches!(
            e,
            GgufError::StringTooLong {
                found: 70_000,
                limit: 65_535,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn array_length_beyond_remaining_bytes() {
    // u32 elements, 8 bytes left: at most 2.
    let e = err(&Bytes::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(4)
        .u64(3)
        .zeros(8));
    assert!(
        matches!(
            e,
            GgufError::ArrayTooLong {
                found: 3,
                limit: 2,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn array_of_strings_length_bounded_by_prefix_size() {
    // String elements need at least 8 bytes each: 16 bytes left hold 2.
    let e = err(&Bytes::header(3, 0, 1)
        .str("a")
        .u32(9)
        .u32(8)
        .u64(3)
        .zeros(16));
    assert!(
        matches!(
            e,
            GgufError::ArrayTooLong {
                found: 3,
                limit: 2,
                ..
            }
        ),
        "{e}"
    );
}

fn nested(depth: u32) -> Bytes {
    let mut b = Bytes::header(3, 0, 1).str("nest").u32(9);
    for _ in 1..depth {
        b = b.u32(9).u64(1); // array of one array
    }
    b.u32(0).u64(0).pad(32) // innermost: empty array of u8
}

#[test]
fn nesting_depth_at_cap_is_accepted() {
    let f = parse(&nested(8)).unwrap();
    let mut v = f.get("nest").unwrap();
    for _ in 1..8 {
        v = &v.as_array().unwrap().values[0];
    }
    assert!(v.as_array().unwrap().values.is_empty());
}

#[test]
fn nesting_depth_above_cap() {
    let e = err(&nested(9));
    assert!(
        matches!(
            e,
            GgufError::NestingTooDeep {
                found: 9,
                limit: 8,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn unknown_metadata_value_type() {
    let e = err(&Bytes::header(3, 0, 1).str("k").u32(13).zeros(8));
    assert!(
        matches!(e, GgufError::UnknownMetaType { found: 13, .. }),
        "{e}"
    );
}

#[test]
fn bool_other_than_0_or_1() {
    let e = err(&Bytes::header(3, 0, 1).str("k").u32(7).u8(2).pad(32));
    assert!(matches!(e, GgufError::InvalidBool { found: 2, .. }), "{e}");
}

#[test]
fn invalid_utf8_key() {
    let b = Bytes::header(3, 0, 1)
        .u64(2)
        .raw(&[0xff, 0xfe])
        .u32(4)
        .u32(1)
        .pad(32);
    let e = err(&b);
    assert!(
        matches!(e, GgufError::InvalidUtf8 { offset: 32, .. }),
        "{e}"
    );
}

#[test]
fn invalid_utf8_string_value() {
    let b = Bytes::header(3, 0, 1)
        .str("k")
        .u32(8)
        .u64(1)
        .raw(&[0x80])
        .pad(32);
    let e = err(&b);
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
}

#[test]
fn invalid_utf8_tensor_name() {
    let b = Bytes::header(3, 1, 0)
        .u64(1)
        .raw(&[0xc0])
        .u32(1)
        .u64(1)
        .u32(0)
        .u64(0)
        .pad(32)
        .zeros(32);
    let e = err(&b);
    assert!(matches!(e, GgufError::InvalidUtf8 { .. }), "{e}");
}

#[test]
fn duplicate_keys() {
    let e = err(&Bytes::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2).pad(32));
    assert!(
        matches!(e, GgufError::DuplicateKey { ref key, .. } if key == "k"),
        "{e}"
    );
}

#[test]
fn alignment_zero() {
    let e = err(&Bytes::header(3, 0, 1)
        .kv_u32("general.alignment", 0)
        .pad(32));
    assert!(matches!(e, GgufError::BadAlignment { .. }), "{e}");
}

#[test]
fn alignment_not_power_of_two() {
    let e = err(&Bytes::header(3, 0, 1)
        .kv_u32("general.alignment", 48)
        .pad(48));
    assert!(matches!(e, GgufError::BadAlignment { .. }), "{e}");
}

#[test]
fn alignment_of_string_type() {
    let e = err(&Bytes::header(3, 0, 1)
        .kv_str("general.alignment", "32")
        .pad(32));
    assert!(matches!(e, GgufError::BadAlignment { .. }), "{e}");
}

#[test]
fn custom_alignment_sets_data_offset() {
    let b = Bytes::header(3, 1, 1)
        .kv_u32("general.alignment", 64)
        .tensor("t", &[16], 0, 0)
        .pad(64)
        .zeros(64);
    let f = parse(&b).unwrap();
    assert_eq!(f.alignment, 64);
    assert_eq!(f.data_offset % 64, 0);
    assert_eq!(f.data_offset, b.0.len() as u64 - 64);
}

#[test]
fn n_dims_zero() {
    let e = err(&Bytes::header(3, 1, 0)
        .str("t")
        .u32(0)
        .u32(0)
        .u64(0)
        .zeros(64));
    assert!(matches!(e, GgufError::BadDimCount { found: 0, .. }), "{e}");
}

#[test]
fn n_dims_five() {
    let e = err(&one_tensor("t", &[1, 1, 1, 1, 1], 0, 0, 32));
    assert!(matches!(e, GgufError::BadDimCount { found: 5, .. }), "{e}");
}

#[test]
fn n_dims_huge_does_not_allocate() {
    let e = err(&Bytes::header(3, 1, 0).str("t").u32(u32::MAX).zeros(64));
    assert!(
        matches!(
            e,
            GgufError::BadDimCount {
                found: u32::MAX,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn zero_dimension() {
    let e = err(&one_tensor("t", &[4, 0], 0, 0, 32));
    assert!(matches!(e, GgufError::ZeroDim { .. }), "{e}");
}

#[test]
fn overflowing_dimension_product() {
    let e = err(&one_tensor("t", &[1 << 32, 1 << 32], 0, 0, 32));
    assert!(matches!(e, GgufError::SizeOverflow { .. }), "{e}");
}

#[test]
fn element_count_above_i64_max() {
    let e = err(&one_tensor("t", &[1 << 62, 4], 24, 0, 32));
    assert!(matches!(e, GgufError::SizeOverflow { .. }), "{e}");
}

#[test]
fn byte_size_overflow() {
    // Fits as an element count (2^62) but F32 bytes are 2^64.
    let e = err(&one_tensor("t", &[1 << 31, 1 << 31], 0, 0, 32));
    assert!(matches!(e, GgufError::SizeOverflow { .. }), "{e}");
}

#[test]
fn row_length_not_a_multiple_of_block_size() {
    let e = err(&one_tensor("t", &[33, 2], 2, 0, 64)); // Q4_0, block 32
    assert!(
        matches!(
            e,
            GgufError::RowNotBlockMultiple {
                row_len: 33,
                block: 32,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn unknown_tensor_type_gives_the_id() {
    let e = err(&one_tensor("t", &[4], 4, 0, 32)); // 4 = retired Q4_2
    assert!(
        matches!(e, GgufError::UnknownTensorType { id: 4, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("found 4"));
}

#[test]
fn tensor_beyond_end_of_file() {
    let e = err(&one_tensor("t", &[16], 0, 0, 63)); // needs 64 bytes
    assert!(
        matches!(e, GgufError::TensorBeyondEof { end, .. } if end % 32 == 0),
        "{e}"
    );
}

#[test]
fn tensor_offset_beyond_end_of_file() {
    let e = err(&one_tensor("t", &[4], 0, u64::MAX - 31, 64));
    assert!(matches!(e, GgufError::TensorBeyondEof { .. }), "{e}");
}

#[test]
fn data_section_beyond_end_of_file() {
    // One tensor whose info ends the file: header of 24 + name "t" (8 + 1) + n_dims (4) +
    // dim (8) + type (4) + offset (8) = 57 bytes; the data section would start at 64.
    let e = err(&Bytes::header(3, 1, 0).tensor("t", &[4], 0, 0));
    assert!(
        matches!(
            e,
            GgufError::DataBeyondEof {
                data_offset: 64,
                file_size: 57,
                ..
            }
        ),
        "{e}"
    );
}

/// Regression: llama.cpp's vocab-only files (`models/ggml-vocab-*.gguf`) have no tensors
/// and end right after the metadata, before the alignment padding. llama.cpp loads them.
#[test]
fn file_without_tensors_may_end_before_data_padding() {
    let f = parse(&Bytes::header(3, 0, 0)).unwrap();
    assert_eq!(f.tensors.len(), 0);
    assert_eq!(f.data_offset, 24);
    assert_eq!(f.file_size, 24);
}

#[test]
fn misaligned_tensor_offset() {
    let e = err(&one_tensor("t", &[4], 0, 16, 64));
    assert!(
        matches!(
            e,
            GgufError::MisalignedTensor {
                offset: 16,
                alignment: 32,
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn overlapping_tensors() {
    let b = Bytes::header(3, 2, 0)
        .tensor("a", &[16], 0, 0) // bytes 0..64
        .tensor("b", &[8], 0, 32) // bytes 32..64
        .pad(32)
        .zeros(64);
    let e = err(&b);
    assert!(
        matches!(e, GgufError::TensorOverlap { ref tensor, ref other, .. } if tensor == "b" && other == "a"),
        "{e}"
    );
}

#[test]
fn duplicate_tensor_names() {
    let b = Bytes::header(3, 2, 0)
        .tensor("a", &[8], 0, 0)
        .tensor("a", &[8], 0, 32)
        .pad(32)
        .zeros(64);
    let e = err(&b);
    assert!(
        matches!(e, GgufError::DuplicateTensor { ref tensor, .. } if tensor == "a"),
        "{e}"
    );
}

#[test]
fn hostile_names_cannot_break_the_line() {
    let e = err(&Bytes::header(3, 0, 2)
        .kv_u32("a\nb", 1)
        .kv_u32("a\nb", 2)
        .pad(32));
    assert!(matches!(e, GgufError::DuplicateKey { .. }));
    assert!(e.to_string().contains("a\\nb"));
}
