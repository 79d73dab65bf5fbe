//! Hostile model files (issue 35, items 6, 7, 11, 12, 13): every size, count and float a
//! file sets is checked at load, before anything is allocated or iterated from it, and a
//! tensor's whole shape is checked. Each case edits a test fixture (metadata or a tensor's
//! shape), loads it with `Model::load` and expects one error naming the file and the key
//! or tensor; the unedited fixtures (and the real Gemma 3 270M when `SLUICE_GEMMA` is
//! set) must still load.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use sluice_gguf::{GgufFile, GgufWriter, MetaValue, TensorSpec};
use sluice_models::Model;

fn fixture(dir: &str, name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(dir)
        .join(name)
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-validate-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A copy of `src` with its metadata edited by `meta` and its tensor table by `specs`
/// (a tensor's bytes are written as they are, padded or cut to its new size).
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
    let out = std::fs::File::create(dst).unwrap();
    let mut w = GgufWriter::new(out, dst, &md, &sp).unwrap();
    let mut file = std::fs::File::open(src).unwrap();
    for (t, s) in f.tensors.iter().zip(&sp) {
        let r = f.tensor_range(t);
        let mut buf = vec![0u8; (r.end - r.start) as usize];
        file.seek(SeekFrom::Start(r.start)).unwrap();
        file.read_exact(&mut buf).unwrap();
        let n = s.dims.iter().product::<u64>() / s.ty.block_size() * s.ty.type_size();
        buf.resize(n as usize, 0);
        w.write_tensor(&t.name, &buf).unwrap();
    }
    w.finish().unwrap();
}

/// Sets (or adds) metadata `key`.
fn set(md: &mut Vec<(String, MetaValue)>, key: &str, v: MetaValue) {
    match md.iter_mut().find(|(k, _)| k == key) {
        Some(e) => e.1 = v,
        None => md.push((key.to_string(), v)),
    }
}

/// `Model::load` of `path` fails with one line naming the file and every needle.
fn refused(path: &Path, needles: &[&str]) {
    let e = match Model::load(path) {
        Ok(_) => panic!(
            "{} loaded; expected an error naming {needles:?}",
            path.display()
        ),
        Err(e) => e.to_string(),
    };
    assert!(!e.contains('\n'), "not one line: {e}");
    assert!(
        e.contains(&path.display().to_string()),
        "file not named: {e}"
    );
    for n in needles {
        assert!(e.contains(n), "error lacks {n:?}: {e}");
    }
}

/// One refused metadata edit per case: (fixture dir, fixture, key, value, needles).
fn refuse_meta(name: &str, cases: &[(&str, &str, &str, MetaValue, &[&str])]) {
    let dir = tmp_dir(name);
    for (i, (fdir, fname, key, v, needles)) in cases.iter().enumerate() {
        let m = dir.join(format!("{i}.gguf"));
        rewrite(
            &fixture(fdir, fname),
            &m,
            |md| set(md, key, v.clone()),
            |_| {},
        );
        refused(&m, needles);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

const DS4: (&str, &str) = ("deepseek4", "a-f32.gguf");
const G5N: (&str, &str) = ("glm5next", "a-f32.gguf");
const GDSA: (&str, &str) = ("glm_dsa", "a-f32.gguf");
const Q3: (&str, &str) = ("qwen3moe", "a-f32.gguf");
const Q4X: (&str, &str) = ("qwen4exp", "a-f32.gguf");

#[test]
fn valid_fixtures_still_load() {
    for (dir, name) in [
        DS4,
        ("deepseek4", "c-mxfp4.gguf"),
        G5N,
        ("glm5next", "a-alias.gguf"),
        ("glm5next", "c-f32.gguf"),
        GDSA,
        Q3,
        ("qwen3moe", "a-q8_0-gate_up.gguf"),
        Q4X,
        ("qwen4exp", "a-ratios-f32.gguf"),
    ] {
        let p = fixture(dir, name);
        if let Err(e) = Model::load(&p) {
            panic!("{}: {e}", p.display());
        }
    }
    match std::env::var("SLUICE_GEMMA") {
        Ok(g) => {
            Model::load(Path::new(&g)).unwrap();
        }
        Err(_) => eprintln!("note: SLUICE_GEMMA not set; the real Gemma file is not loaded"),
    }
}

// ---- item 6: sizes read from the file are bounded before anything is allocated --------

#[test]
fn sizes_past_their_bounds_are_refused_naming_the_key() {
    let big = MetaValue::U32(u32::MAX);
    refuse_meta(
        "sizes",
        &[
            // the 2 TB window ring of the issue: bounded by the context length
            (
                DS4.0,
                DS4.1,
                "deepseek4.attention.sliding_window",
                big.clone(),
                &["deepseek4.attention.sliding_window", "4294967295"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.attention.sliding_window",
                MetaValue::U32(4097),
                &["deepseek4.attention.sliding_window", "context length 4096"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.attention.indexer.top_k",
                MetaValue::U32(5000),
                &["deepseek4.attention.indexer.top_k"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.context_length",
                big.clone(),
                &["deepseek4.context_length"],
            ),
            (
                Q3.0,
                Q3.1,
                "qwen3moe.context_length",
                MetaValue::U64(1 << 40),
                &["qwen3moe.context_length"],
            ),
            (
                Q3.0,
                Q3.1,
                "qwen3moe.context_length",
                MetaValue::U32(0),
                &["qwen3moe.context_length"],
            ),
            // per-layer vectors are allocated from block_count before any tensor is read
            (
                Q3.0,
                Q3.1,
                "qwen3moe.block_count",
                big.clone(),
                &["qwen3moe.block_count"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.block_count",
                big.clone(),
                &["glm5-next.block_count"],
            ),
            (
                Q4X.0,
                Q4X.1,
                "qwen4exp.block_count",
                MetaValue::U32(1_000_000),
                &["qwen4exp.block_count"],
            ),
            (
                GDSA.0,
                GDSA.1,
                "glm-dsa.block_count",
                big.clone(),
                &["glm-dsa.block_count"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.attention.indexer.top_k",
                MetaValue::U32(1 << 24),
                &["glm5-next.attention.indexer.top_k"],
            ),
            (
                GDSA.0,
                GDSA.1,
                "glm-dsa.attention.indexer.top_k",
                MetaValue::U32(4104),
                &["glm-dsa.attention.indexer.top_k"],
            ),
            (
                Q4X.0,
                Q4X.1,
                "qwen4exp.attention.indexer.top_k",
                MetaValue::U32(1 << 20),
                &["qwen4exp.attention.indexer.top_k"],
            ),
            (
                Q4X.0,
                Q4X.1,
                "qwen4exp.attention.indexer.top_k",
                MetaValue::U32(0),
                &["qwen4exp.attention.indexer.top_k", "> 0"],
            ),
            // any integer key: at most MAX_INT
            (
                Q3.0,
                Q3.1,
                "qwen3moe.expert_count",
                MetaValue::U64(u64::MAX),
                &["qwen3moe.expert_count", "at most"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.attention.q_lora_rank",
                big,
                &["deepseek4.attention.q_lora_rank", "at most"],
            ),
        ],
    );
}

// ---- item 7: iteration counts ------------------------------------------------------

#[test]
fn iteration_counts_past_their_bound_are_refused_naming_the_key() {
    refuse_meta(
        "iters",
        &[
            (
                DS4.0,
                DS4.1,
                "deepseek4.hyper_connection.sinkhorn_iterations",
                MetaValue::U32(u32::MAX),
                &[
                    "deepseek4.hyper_connection.sinkhorn_iterations",
                    "4294967295",
                ],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.hyper_connection.sinkhorn_iterations",
                MetaValue::U32(1001),
                &["deepseek4.hyper_connection.sinkhorn_iterations", "1..=1000"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.hyper_connection.sinkhorn_iterations",
                MetaValue::U32(0),
                &["deepseek4.hyper_connection.sinkhorn_iterations"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.hyper_connection.sinkhorn_iterations",
                MetaValue::U32(u32::MAX),
                &[
                    "glm5-next.hyper_connection.sinkhorn_iterations",
                    "4294967295",
                ],
            ),
        ],
    );
}

// ---- item 12: floats and RoPE scaling ----------------------------------------------------

#[test]
fn bad_floats_and_unknown_rope_scaling_are_refused_naming_the_key() {
    let s = |v: &str| MetaValue::Str(v.to_string());
    refuse_meta(
        "floats",
        &[
            (
                DS4.0,
                DS4.1,
                "deepseek4.rope.scaling.factor",
                MetaValue::F32(0.0),
                &["deepseek4.rope.scaling.factor", "> 0"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.rope.scaling.factor",
                MetaValue::F32(-2.0),
                &["deepseek4.rope.scaling.factor"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.attention.compress_rope_freq_base",
                MetaValue::F32(-1.0),
                &["deepseek4.attention.compress_rope_freq_base", "> 0"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.hyper_connection.epsilon",
                MetaValue::F32(-1.0),
                &["deepseek4.hyper_connection.epsilon", ">= 0"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.hyper_connection.epsilon",
                MetaValue::F32(f32::NAN),
                &["deepseek4.hyper_connection.epsilon"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.rope.scaling.type",
                s("bogus"),
                &["deepseek4.rope.scaling.type", "'bogus'", "none, yarn"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.rope.scaling.type",
                MetaValue::U32(3),
                &["deepseek4.rope.scaling.type", "string"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.rope.scaling.yarn_beta_fast",
                MetaValue::F32(f32::INFINITY),
                &["deepseek4.rope.scaling.yarn_beta_fast"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.rope.scaling.original_context_length",
                MetaValue::U32(0),
                &["deepseek4.rope.scaling.original_context_length"],
            ),
            (
                DS4.0,
                DS4.1,
                "deepseek4.expert_weights_scale",
                MetaValue::F32(-1.5),
                &["deepseek4.expert_weights_scale"],
            ),
            // the other architectures
            (
                Q3.0,
                Q3.1,
                "qwen3moe.rope.scaling.type",
                s("bogus"),
                &["qwen3moe.rope.scaling.type", "'bogus'", "none, linear"],
            ),
            (
                Q3.0,
                Q3.1,
                "qwen3moe.rope.scaling.type",
                s("yarn"),
                &["qwen3moe.rope.scaling.type", "'yarn'"],
            ),
            (
                Q3.0,
                Q3.1,
                "qwen3moe.rope.scaling.factor",
                MetaValue::F32(0.0),
                &["qwen3moe.rope.scaling.factor", "> 0"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.hyper_connection.epsilon",
                MetaValue::F32(-1.0),
                &["glm5-next.hyper_connection.epsilon"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.attention.layer_norm_rms_epsilon",
                MetaValue::F32(-1e-5),
                &["glm5-next.attention.layer_norm_rms_epsilon", ">= 0"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.attention.layer_norm_epsilon",
                MetaValue::F32(-1e-6),
                &["glm5-next.attention.layer_norm_epsilon", ">= 0"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.rope.scaling.type",
                s("yarn"),
                &["glm5-next.rope.scaling.type", "'yarn'"],
            ),
            (
                G5N.0,
                G5N.1,
                "glm5-next.expert_weights_scale",
                MetaValue::F32(0.0),
                &["glm5-next.expert_weights_scale"],
            ),
            (
                GDSA.0,
                GDSA.1,
                "glm-dsa.attention.layer_norm_epsilon",
                MetaValue::F32(-1e-6),
                &["glm-dsa.attention.layer_norm_epsilon"],
            ),
            (
                GDSA.0,
                GDSA.1,
                "glm-dsa.rope.scaling.factor",
                MetaValue::F32(4.0),
                &["glm-dsa.rope.scaling.factor", "no RoPE scaling"],
            ),
            (
                GDSA.0,
                GDSA.1,
                "glm-dsa.expert_weights_scale",
                MetaValue::F32(f32::NEG_INFINITY),
                &["glm-dsa.expert_weights_scale"],
            ),
            (
                Q4X.0,
                Q4X.1,
                "qwen4exp.rope.scaling.type",
                s("linear"),
                &["qwen4exp.rope.scaling.type", "'linear'"],
            ),
        ],
    );
}

#[test]
fn declared_rope_scaling_the_architecture_implements_still_loads() {
    let dir = tmp_dir("rope-ok");
    let cases: &[(&str, &str, &str, MetaValue)] = &[
        (
            Q3.0,
            Q3.1,
            "qwen3moe.rope.scaling.type",
            MetaValue::Str("linear".into()),
        ),
        (
            Q3.0,
            Q3.1,
            "qwen3moe.rope.scaling.type",
            MetaValue::Str("none".into()),
        ),
        (
            Q3.0,
            Q3.1,
            "qwen3moe.rope.dimension_count",
            MetaValue::U32(16),
        ),
        (
            DS4.0,
            DS4.1,
            "deepseek4.hyper_connection.epsilon",
            MetaValue::F32(0.0),
        ),
    ];
    for (i, (fdir, fname, key, v)) in cases.iter().enumerate() {
        let m = dir.join(format!("{i}.gguf"));
        rewrite(
            &fixture(fdir, fname),
            &m,
            |md| set(md, key, v.clone()),
            |_| {},
        );
        if let Err(e) = Model::load(&m) {
            panic!("{key} = {v:?} refused: {e}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 13: tensor shapes and qwen3moe's rope.dimension_count ---------------------------

#[test]
fn tensors_of_the_wrong_shape_are_refused_naming_the_tensor() {
    let dir = tmp_dir("shapes");
    // (fixture, tensor, new dims): same element count, other shape
    let cases: &[((&str, &str), &str, &[u64])] = &[
        (Q3, "blk.0.attn_norm.weight", &[32, 2]),
        (Q3, "output_norm.weight", &[16, 4]),
        (Q3, "blk.1.attn_k_norm.weight", &[8, 2]),
        (DS4, "blk.0.attn_sinks.weight", &[2, 2]),
        (DS4, "blk.1.attn_compressor_ape.weight", &[64, 8]),
        (G5N, "blk.0.ssm_conv1d_q.weight", &[8, 1, 32, 1]),
        (Q4X, "blk.0.ssm_conv1d.weight", &[8, 32]),
        (GDSA, "blk.1.exp_probs_b.bias", &[4, 2]),
        (Q4X, "per_layer_token_embd.weight", &[8, 128, 2]),
    ];
    for (i, ((fdir, fname), tensor, dims)) in cases.iter().enumerate() {
        let src = fixture(fdir, fname);
        let f = GgufFile::open(&src).unwrap();
        let old = &f.tensor(tensor).unwrap().dims;
        assert_eq!(
            old.iter().product::<u64>(),
            dims.iter().product::<u64>(),
            "{tensor}: the case must keep the element count"
        );
        let m = dir.join(format!("{i}.gguf"));
        rewrite(
            &src,
            &m,
            |_| {},
            |sp| {
                sp.iter_mut().find(|s| s.name == *tensor).unwrap().dims = dims.to_vec();
            },
        );
        refused(&m, &[tensor, "expected shape"]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn qwen3moe_rope_dimension_count_other_than_the_head_is_refused() {
    refuse_meta(
        "rope-dims",
        &[
            (
                Q3.0,
                Q3.1,
                "qwen3moe.rope.dimension_count",
                MetaValue::U32(1000),
                &["qwen3moe.rope.dimension_count", "1000"],
            ),
            (
                Q3.0,
                Q3.1,
                "qwen3moe.rope.dimension_count",
                MetaValue::U32(3),
                &["qwen3moe.rope.dimension_count", "3"],
            ),
            (
                Q3.0,
                Q3.1,
                "qwen3moe.rope.dimension_count",
                MetaValue::U32(8),
                &["qwen3moe.rope.dimension_count", "key_length 16"],
            ),
        ],
    );
}

// ---- item 11: the tokenizer must match the embedding --------------------------------

#[test]
fn a_tokenizer_that_does_not_match_the_embedding_is_refused() {
    let dir = tmp_dir("vocab");
    let cut = |n: usize| {
        move |md: &mut Vec<(String, MetaValue)>| {
            for (k, v) in md.iter_mut() {
                if k.starts_with("tokenizer.ggml.") && k != "tokenizer.ggml.merges" {
                    if let MetaValue::Array(a) = v {
                        if a.values.len() > n {
                            a.values.truncate(n);
                        }
                    }
                }
            }
        }
    };
    for (i, ((fdir, fname), n, needles)) in [
        (
            Q3,
            1usize,
            &["tokenizer.ggml.tokens has 1 tokens", "512 rows"][..],
        ),
        (Q3, 511, &["tokenizer.ggml.tokens has 511 tokens"][..]),
        (
            GDSA,
            1,
            &[
                "tokenizer.ggml.tokens has 1 tokens",
                "glm-dsa.vocab_size 512",
            ][..],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let m = dir.join(format!("{i}.gguf"));
        rewrite(&fixture(fdir, fname), &m, cut(n), |_| {});
        refused(&m, needles);
    }
    // more tokens than embedding rows
    let m = dir.join("more.gguf");
    rewrite(
        &fixture(Q3.0, Q3.1),
        &m,
        |md| {
            let e = md
                .iter_mut()
                .find(|(k, _)| k == "tokenizer.ggml.tokens")
                .unwrap();
            let MetaValue::Array(a) = &mut e.1 else {
                panic!()
            };
            a.values.push(MetaValue::Str("<extra>".into()));
        },
        |_| {},
    );
    refused(&m, &["tokenizer.ggml.tokens has 513 tokens", "512 rows"]);
    // a tokenizer key of the wrong type
    let m = dir.join("type.gguf");
    rewrite(
        &fixture(Q3.0, Q3.1),
        &m,
        |md| set(md, "tokenizer.ggml.tokens", MetaValue::U32(512)),
        |_| {},
    );
    refused(&m, &["tokenizer.ggml.tokens", "array"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- all items: a sweep over every numeric key ------------------------------------------

/// Load `m` and evaluate three tokens on another thread, under a 120 s watchdog:
/// `Ok(None)` when it loaded, `Ok(Some(error))` when it was refused, `Err(why)` when it
/// hung or panicked.
fn load_and_eval(m: &Path) -> Result<Option<String>, &'static str> {
    let (tx, rx) = std::sync::mpsc::channel();
    let mc = m.to_path_buf();
    std::thread::spawn(move || {
        let r = Model::load(&mc).map(|model| {
            let mut st = model.new_state(64, false);
            let _ = model.forward(&mut st, &[1, 2, 3], sluice_models::Logits::All);
        });
        let _ = tx.send(r.err().map(|e| e.to_string()));
    });
    match rx.recv_timeout(std::time::Duration::from_secs(120)) {
        Ok(r) => Ok(r),
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err("still running after 120 s"),
        Err(_) => Err("panicked"),
    }
}

/// Hostile values of the same type as `v` (None: not a numeric scalar).
fn hostile(v: &MetaValue) -> Option<Vec<MetaValue>> {
    Some(match v {
        MetaValue::U32(_) => vec![MetaValue::U32(0), MetaValue::U32(u32::MAX)],
        MetaValue::I32(_) => vec![
            MetaValue::I32(0),
            MetaValue::I32(-1),
            MetaValue::I32(i32::MAX),
        ],
        MetaValue::U64(_) => vec![MetaValue::U64(0), MetaValue::U64(u64::MAX)],
        MetaValue::F32(_) => vec![
            MetaValue::F32(0.0),
            MetaValue::F32(-1.0),
            MetaValue::F32(f32::NAN),
            MetaValue::F32(1e30),
        ],
        // arrays (per-layer values, PLE constants): every element hostile, one element,
        // none
        MetaValue::Array(a) if !a.values.is_empty() => {
            let mut out: Vec<MetaValue> = hostile(&a.values[0])?
                .into_iter()
                .map(|h| {
                    MetaValue::Array(sluice_gguf::MetaArray {
                        elem_type: a.elem_type,
                        values: vec![h; a.values.len()],
                    })
                })
                .collect();
            for n in [1, 0] {
                out.push(MetaValue::Array(sluice_gguf::MetaArray {
                    elem_type: a.elem_type,
                    values: a.values[..n].to_vec(),
                }));
            }
            out
        }
        _ => return None,
    })
}

/// Every numeric key of every architecture's fixture set to 0, -1, the type's maximum,
/// NaN or 1e30 (one at a time; arrays: every element so, or cut to one or no element): the load either fails with an error naming the file or
/// the model evaluates 3 tokens (Ok or an error); no panic, no abort, no hang (a case
/// running past the watchdog fails the test).
#[test]
fn every_numeric_key_set_to_a_hostile_value_loads_or_fails_cleanly() {
    let dir = tmp_dir("sweep");
    let mut failures = Vec::new();
    let mut cases = 0;
    for (fdir, fname) in [DS4, G5N, GDSA, Q3, Q4X] {
        let src = fixture(fdir, fname);
        let bytes = std::fs::read(&src).unwrap();
        let file = GgufFile::parse(&bytes, &src).unwrap();
        for (i, (key, v)) in file.metadata.iter().enumerate() {
            if key.starts_with("general.") || key.starts_with("tokenizer.") {
                continue;
            }
            for (j, hv) in hostile(v).unwrap_or_default().into_iter().enumerate() {
                cases += 1;
                let mut f2 = file.clone();
                f2.metadata[i].1 = hv.clone();
                let m = dir.join(format!("{fdir}-{i}-{j}.gguf"));
                let dst = std::fs::File::create(&m).unwrap();
                GgufWriter::rewrite(&f2, &mut std::io::Cursor::new(&bytes), dst, &m).unwrap();
                let what = format!("{key} = {hv:?}");
                match load_and_eval(&m) {
                    Ok(Some(e)) if !e.contains(&m.display().to_string()) || e.contains('\n') => {
                        failures.push(format!("{what}: error not one line naming the file: {e}"))
                    }
                    Ok(_) => {}
                    Err(why) => failures.push(format!("{what}: {why}")),
                }
                std::fs::remove_file(&m).unwrap();
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(cases > 100, "only {cases} cases");
    assert!(
        failures.is_empty(),
        "{} of {cases} cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Every tensor of every architecture's fixture given another shape with the same element
/// count (2-D and up: the first two dimensions swapped; 1-D: split in two), one at a
/// time: refused with one line naming the file (the shape check is total: every tensor
/// the architectures read is checked against its whole expected shape); no panic, no hang.
#[test]
fn every_tensor_reshaped_loads_or_fails_cleanly() {
    let dir = tmp_dir("reshape");
    let mut failures = Vec::new();
    let mut cases = 0;
    for (fdir, fname) in [DS4, G5N, GDSA, Q3, Q4X] {
        let src = fixture(fdir, fname);
        let bytes = std::fs::read(&src).unwrap();
        let file = GgufFile::parse(&bytes, &src).unwrap();
        for (i, t) in file.tensors.iter().enumerate() {
            let d = &t.dims;
            let new: Vec<u64> = match d.len() {
                1 if d[0] % 2 == 0 && d[0] >= 4 && t.ty.block_size() == 1 => vec![d[0] / 2, 2],
                // (a swap with a size-1 dimension keeps the layout: not another shape)
                n if n >= 2
                    && d[0] != d[1]
                    && d[0] > 1
                    && d[1] > 1
                    && d[1] % t.ty.block_size() == 0 =>
                {
                    let mut v = d.clone();
                    v.swap(0, 1);
                    v
                }
                _ => continue,
            };
            cases += 1;
            let mut f2 = file.clone();
            f2.tensors[i].dims = new.clone();
            let m = dir.join(format!("{fdir}-{i}.gguf"));
            let dst = std::fs::File::create(&m).unwrap();
            GgufWriter::rewrite(&f2, &mut std::io::Cursor::new(&bytes), dst, &m).unwrap();
            let what = format!("{fdir} {} {:?} as {new:?}", t.name, t.dims);
            match load_and_eval(&m) {
                Ok(Some(e)) if !e.contains(&m.display().to_string()) || e.contains('\n') => {
                    failures.push(format!("{what}: error not one line naming the file: {e}"))
                }
                Ok(None) => failures.push(format!("{what}: accepted")),
                Ok(Some(_)) => {}
                Err(why) => failures.push(format!("{what}: {why}")),
            }
            std::fs::remove_file(&m).unwrap();
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(cases > 100, "only {cases} cases");
    assert!(
        failures.is_empty(),
        "{} of {cases} cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
