//! Hostile model files through `sluice run` (issue 35, items 6, 7, 8, 11, 12, 13): each
//! ends with one `error:` line naming the file and the key or tensor and a non-zero exit
//! of its own (no panic, abort or signal), under the watchdog and a virtual-memory limit
//! (an attempted huge allocation fails the case instead of swapping the machine).
//! The load-time checks themselves are tested in `crates/models/tests/validate.rs`.

mod common;

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::process::Output;

use common::{exited, fixture, sluice_limited, tmp_dir};
use sluice_gguf::{GgufFile, GgufWriter, MetaValue, TensorSpec};

/// Exits non-zero by itself with an `error:` line naming every needle, and no panic.
fn fails_with(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    let code = exited(out);
    assert_ne!(code, 0, "expected failure, stderr: {err}");
    assert_ne!(code, 101, "panicked: {err}");
    assert!(!err.contains("panicked"), "panicked: {err}");
    let line = err
        .lines()
        .rev()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    for n in needles {
        assert!(line.contains(n), "error line lacks {n:?}: {line}");
    }
}

/// A copy of `src` with its metadata edited by `meta` and its tensor table by `specs`.
fn rewrite(
    src: &Path,
    dst: &Path,
    meta: impl Fn(&mut Vec<(String, MetaValue)>),
    specs: impl Fn(&mut Vec<TensorSpec>),
) {
    let f = GgufFile::open(src).unwrap();
    let mut md = f.metadata.clone();
    meta(&mut md);
    let mut sp: Vec<TensorSpec> = f.tensors.iter().map(TensorSpec::from).collect();
    specs(&mut sp);
    let mut w = GgufWriter::new(std::fs::File::create(dst).unwrap(), dst, &md, &sp).unwrap();
    let mut file = std::fs::File::open(src).unwrap();
    for t in &f.tensors {
        let r = f.tensor_range(t);
        let mut buf = vec![0u8; (r.end - r.start) as usize];
        file.seek(SeekFrom::Start(r.start)).unwrap();
        file.read_exact(&mut buf).unwrap();
        w.write_tensor(&t.name, &buf).unwrap();
    }
    w.finish().unwrap();
}

fn set(md: &mut [(String, MetaValue)], key: &str, v: MetaValue) {
    md.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
}

fn fixture_in(dir: &str, name: &str) -> String {
    fixture(name).replace("/qwen3moe/", &format!("/{dir}/"))
}

fn run(model: &str, extra: &[&str]) -> Output {
    let mut args = vec!["run", "-m", model, "--tokens", "2,84,104", "-n", "2"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--temp", "0"]);
    sluice_limited(&args, b"")
}

#[test]
fn hostile_hyperparameters_end_run_with_one_error_naming_the_key() {
    let dir = tmp_dir("validate-meta");
    let u = MetaValue::U32;
    let cases: &[(&str, &str, MetaValue)] = &[
        // item 6: the 2 TB window (rc 134 before)
        (
            "deepseek4",
            "deepseek4.attention.sliding_window",
            u(u32::MAX),
        ),
        ("qwen3moe", "qwen3moe.block_count", u(u32::MAX)),
        // item 7: an endless Sinkhorn loop
        (
            "deepseek4",
            "deepseek4.hyper_connection.sinkhorn_iterations",
            u(u32::MAX),
        ),
        (
            "glm5next",
            "glm5-next.hyper_connection.sinkhorn_iterations",
            u(u32::MAX),
        ),
        // item 12
        (
            "deepseek4",
            "deepseek4.rope.scaling.factor",
            MetaValue::F32(0.0),
        ),
        (
            "deepseek4",
            "deepseek4.attention.compress_rope_freq_base",
            MetaValue::F32(-1.0),
        ),
        (
            "deepseek4",
            "deepseek4.hyper_connection.epsilon",
            MetaValue::F32(-1.0),
        ),
        (
            "deepseek4",
            "deepseek4.rope.scaling.type",
            MetaValue::Str("bogus".into()),
        ),
        // item 13
        ("qwen3moe", "qwen3moe.rope.dimension_count", u(1000)),
        ("qwen3moe", "qwen3moe.rope.dimension_count", u(3)),
    ];
    for (i, (fdir, key, v)) in cases.iter().enumerate() {
        let m = dir.join(format!("{i}.gguf"));
        let src = fixture_in(fdir, "a-f32.gguf");
        let add = |md: &mut Vec<(String, MetaValue)>| {
            if md.iter().any(|(k, _)| k == key) {
                set(md, key, v.clone())
            } else {
                md.push((key.to_string(), v.clone()))
            }
        };
        rewrite(Path::new(&src), &m, add, |_| {});
        let m = m.to_str().unwrap();
        fails_with(&run(m, &[]), &[m, key]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_wrong_norm_shape_or_a_one_token_tokenizer_ends_run_with_one_error() {
    let dir = tmp_dir("validate-shape");
    let src = fixture("a-f32.gguf");
    // item 13: a [64] norm written as [32, 2]
    let m = dir.join("norm.gguf");
    rewrite(
        Path::new(&src),
        &m,
        |_| {},
        |sp| {
            sp.iter_mut()
                .find(|s| s.name == "blk.0.attn_norm.weight")
                .unwrap()
                .dims = vec![32, 2];
        },
    );
    let ms = m.to_str().unwrap();
    fails_with(&run(ms, &[]), &[ms, "blk.0.attn_norm.weight", "shape"]);
    // item 11: one token for a 512-row embedding
    let m = dir.join("vocab.gguf");
    rewrite(
        Path::new(&src),
        &m,
        |md| {
            for (k, v) in md.iter_mut() {
                if let (true, MetaValue::Array(a)) = (k.starts_with("tokenizer.ggml."), v) {
                    if k != "tokenizer.ggml.merges" {
                        a.values.truncate(1);
                    }
                }
            }
        },
        |_| {},
    );
    let ms = m.to_str().unwrap();
    fails_with(
        &sluice_limited(&["run", "-m", ms, "-p", "hello", "-n", "2"], b""),
        &[ms, "tokenizer.ggml.tokens"],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_fifo_named_as_the_pack_sidecar_is_refused_not_waited_on() {
    let dir = tmp_dir("validate-fifo");
    let m = dir.join("m.gguf");
    std::fs::copy(fixture("a-q8_0.gguf"), &m).unwrap();
    let fifo = dir.join("m.gguf.slpack");
    let st = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(st.success());
    let (ms, fs) = (m.to_str().unwrap(), fifo.to_str().unwrap());
    // the sidecar is looked for when experts stream
    fails_with(
        &run(ms, &["--expert-cache", "100%"]),
        &[fs, "not a regular file"],
    );
    fails_with(
        &run(ms, &["--expert-cache", "100%", "--pack", fs]),
        &[fs, "not a regular file"],
    );
    // without streaming the sidecar is not read, and the run succeeds
    let out = run(ms, &[]);
    assert_eq!(exited(&out), 0, "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}
