//! Damaged files never panic: every truncation of a small valid file is an error, and random
//! mutations of it parse to `Ok` or `Err` without panicking.

mod common;

use common::small_valid;
use proptest::prelude::*;
use sluice_gguf::{GgufError, GgufFile};

#[test]
fn every_truncation_is_an_error() {
    let full = small_valid();
    assert!(GgufFile::parse(&full, "full.gguf".as_ref()).is_ok());
    for len in 0..full.len() {
        let e = GgufFile::parse(&full[..len], "cut.gguf".as_ref())
            .expect_err(&format!("truncated to {len} bytes was accepted"));
        let msg = e.to_string();
        assert!(
            msg.starts_with("cut.gguf: ") && !msg.contains('\n'),
            "{msg}"
        );
        if len < 4 {
            assert!(matches!(e, GgufError::BadMagic { .. }), "{len}: {e}");
        }
    }
}

#[test]
fn every_truncation_of_an_opened_file_is_an_error() {
    let full = small_valid();
    let dir = std::env::temp_dir().join(format!("sluice-gguf-trunc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cut.gguf");
    for len in 0..full.len() {
        std::fs::write(&path, &full[..len]).unwrap();
        assert!(
            GgufFile::open(&path).is_err(),
            "truncated to {len} bytes was accepted"
        );
    }
    std::fs::write(&path, &full).unwrap();
    assert_eq!(GgufFile::open(&path).unwrap(), {
        let mut f = GgufFile::parse(&full, &path).unwrap();
        f.path = path.clone();
        f
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    #[test]
    fn random_byte_mutations_never_panic(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut b = small_valid();
        for (i, v) in edits {
            let n = b.len();
            b[i % n] = v;
        }
        let keep = b.len() - cut % 8;
        let _ = GgufFile::parse(&b[..keep], "m.gguf".as_ref());
    }

    #[test]
    fn random_u64_field_overwrites_never_panic(pos in 0usize..200, v in any::<u64>()) {
        let mut b = small_valid();
        let pos = pos.min(b.len() - 8);
        b[pos..pos + 8].copy_from_slice(&v.to_le_bytes());
        if let Err(e) = GgufFile::parse(&b, "m.gguf".as_ref()) {
            prop_assert!(!e.to_string().contains('\n'));
        }
    }
}
