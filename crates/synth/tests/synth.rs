//! `sluice_synth`: synthetic qwen3moe files load, run with finite varied logits,
//! are deterministic for a seed (whatever the thread count), honour the free-space check,
//! leave no temporary file behind on cancellation, and `router_skew` skews routing.
//!
//! (llama.cpp loading these files is checked by hand, see the synth report in README.md;
//! the model's numbers have no external oracle: the weights are random by design.)

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use sluice_gguf::{GgmlType, GgufFile};
use sluice_models::Logits;
use sluice_models::Model;
use sluice_synth as synth;
use sluice_synth::{
    check_free_space, router_scales, temp_path, Plan, Preset, SynthConfig, SynthError, Vocab,
    WriteOptions, SPACE_MARGIN,
};
use sluice_tier::RoutingTrace;

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-synth-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny(quant: GgmlType, seed: u64) -> SynthConfig {
    SynthConfig {
        shape: Preset::Tiny.shape(),
        quant,
        router_skew: 0.0,
        seed,
        name: "test".into(),
    }
}

fn write_file(cfg: &SynthConfig, path: &Path) {
    let plan = Plan::new(cfg, Vocab::builtin()).unwrap();
    synth::write_replacing(&plan, path).unwrap();
    assert_eq!(std::fs::metadata(path).unwrap().len(), plan.file_size());
    assert!(temps_of(path).is_empty());
}

/// Temporary files of `path` (`<path>.<pid>.<n>.tmp`) in its directory.
fn temps_of(path: &std::path::Path) -> Vec<std::path::PathBuf> {
    let name = path.file_name().unwrap().to_string_lossy().to_string() + ".";
    std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy();
            n.starts_with(&name) && n.ends_with(".tmp")
        })
        .collect()
}

#[test]
fn temp_names_are_unique_and_non_regular_targets_refused() {
    let p = std::path::Path::new("/x/out.gguf");
    let (a, b) = (temp_path(p), temp_path(p));
    assert_ne!(a, b);
    assert!(a.to_string_lossy().starts_with("/x/out.gguf."));
    let plan = Plan::new(&tiny(GgmlType::Q8_0, 0), Vocab::builtin()).unwrap();
    let cancel = AtomicBool::new(false);
    for target in ["/dev/null", "/tmp"] {
        let err = synth::write(
            &plan,
            std::path::Path::new(target),
            &WriteOptions {
                force: true,
                progress: &|_| {},
                cancel: &cancel,
            },
        )
        .unwrap_err();
        assert!(matches!(err, SynthError::NotRegular { .. }), "{err}");
    }
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
}

fn bytes_of(cfg: &SynthConfig, threads: usize) -> Vec<u8> {
    let plan = Plan::new(cfg, Vocab::builtin()).unwrap();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let cancel = AtomicBool::new(false);
    pool.install(|| synth::write_to(&plan, Vec::new(), Path::new("mem"), &|_| {}, &cancel))
        .unwrap()
}

#[test]
fn every_quant_loads_and_gives_finite_varied_logits() {
    let dir = tmp_dir("quants");
    for quant in synth::QUANTS {
        let path = dir.join(format!("tiny-{quant}.gguf"));
        write_file(&tiny(quant, 1), &path);
        let model = Model::load(&path).unwrap();
        assert_eq!(model.cfg.n_layer, 2);
        assert_eq!(model.cfg.n_expert, 8);
        let n_vocab = model.cfg.n_vocab;
        let tokens: Vec<u32> = (0..12).map(|i| (i * 37 % n_vocab) as u32).collect();
        let mut kv = model.new_state(64, false);
        let logits = model.forward(&mut kv, &tokens, Logits::All).unwrap();
        assert_eq!(logits.len(), tokens.len() * n_vocab);
        assert!(
            logits.iter().all(|v| v.is_finite()),
            "{quant}: non-finite logits"
        );
        for row in logits.chunks(n_vocab) {
            let mean = row.iter().sum::<f32>() / n_vocab as f32;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n_vocab as f32;
            // Logits of N(0, 1/fan_in) output rows against a unit-RMS hidden state: std ~ 1.
            assert!(
                (0.1..10.0).contains(&var.sqrt()),
                "{quant}: logit std {}",
                var.sqrt()
            );
        }
        // Different positions give different distributions.
        assert_ne!(logits[..n_vocab], logits[n_vocab..2 * n_vocab]);
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.tensor("blk.0.ffn_up_exps.weight").unwrap().ty, quant);
        assert_eq!(
            f.tensor("blk.0.ffn_gate_inp.weight").unwrap().ty,
            GgmlType::F32
        );
        assert_eq!(
            f.tensor("blk.1.attn_norm.weight").unwrap().ty,
            GgmlType::F32
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn same_seed_same_bytes_whatever_the_threads() {
    let cfg = tiny(GgmlType::Q4_K, 7);
    let a = bytes_of(&cfg, 1);
    let b = bytes_of(&cfg, 2);
    assert_eq!(
        a.len() as u64,
        Plan::new(&cfg, Vocab::builtin()).unwrap().file_size()
    );
    assert!(a == b, "1 and 2 threads differ");
    let c = bytes_of(&tiny(GgmlType::Q4_K, 8), 2);
    assert_eq!(a.len(), c.len());
    assert!(a != c, "a different seed gives the same bytes");
    // And the file written through the temporary file is those bytes.
    let dir = tmp_dir("det");
    let path = dir.join("x.gguf");
    write_file(&cfg, &path);
    assert!(std::fs::read(&path).unwrap() == a);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn free_space_check() {
    let p = Path::new("/x/model.gguf");
    let gib = 1u64 << 30;
    assert!(check_free_space(p, 10 * gib, 11 * gib + 1).is_ok());
    assert!(check_free_space(p, 10 * gib, 11 * gib).is_ok());
    let err = check_free_space(p, 10 * gib, 11 * gib - 1).unwrap_err();
    assert!(matches!(
        err,
        SynthError::NoSpace { needed, available, .. } if needed == 10 * gib && available == 11 * gib - 1
    ));
    let msg = err.to_string();
    assert!(
        msg.contains("/x/model.gguf") && msg.contains("not enough free space"),
        "{msg}"
    );
    assert!(check_free_space(p, u64::MAX, u64::MAX).is_err());
    assert_eq!(SPACE_MARGIN, gib);
}

#[test]
fn a_file_larger_than_the_disk_is_refused_before_anything_is_written() {
    let dir = tmp_dir("nospace");
    let path = dir.join("huge.gguf");
    let mut cfg = tiny(GgmlType::F32, 0);
    cfg.shape = Preset::Qwen3_235bA22b.shape();
    cfg.shape.layers = 20_000; // ~ 200 TB of experts in F32
    let plan = Plan::new(&cfg, Vocab::builtin()).unwrap();
    assert!(plan.file_size() > 100 << 40);
    let cancel = AtomicBool::new(false);
    let err = synth::write(
        &plan,
        &path,
        &WriteOptions {
            force: false,
            progress: &|_| {},
            cancel: &cancel,
        },
    )
    .unwrap_err();
    assert!(matches!(err, SynthError::NoSpace { .. }), "{err}");
    assert!(!path.exists() && temps_of(&path).is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cancelling_removes_the_temporary_file() {
    let dir = tmp_dir("cancel");
    let path = dir.join("c.gguf");
    let mut cfg = tiny(GgmlType::Q8_0, 0);
    cfg.shape.experts = 64; // ~ 70 MB: several batches
    cfg.shape.layers = 8;
    let plan = Plan::new(&cfg, Vocab::builtin()).unwrap();
    let cancel = AtomicBool::new(false);
    let seen_tmp = AtomicBool::new(false);
    let progress = |done: u64| {
        if done > 1 << 20 {
            seen_tmp.store(temps_of(&path).len() == 1, Ordering::SeqCst);
            cancel.store(true, Ordering::SeqCst);
        }
    };
    let err = synth::write(
        &plan,
        &path,
        &WriteOptions {
            force: false,
            progress: &progress,
            cancel: &cancel,
        },
    )
    .unwrap_err();
    assert!(matches!(err, SynthError::Interrupted { .. }), "{err}");
    assert!(
        seen_tmp.load(Ordering::SeqCst),
        "the temporary file was never written"
    );
    assert!(temps_of(&path).is_empty(), "temporary file left behind");
    assert!(!path.exists());
    // An existing output is not replaced without force.
    std::fs::write(&path, b"keep").unwrap();
    cancel.store(false, Ordering::SeqCst);
    let err = synth::write(
        &Plan::new(&tiny(GgmlType::Q8_0, 0), Vocab::builtin()).unwrap(),
        &path,
        &WriteOptions {
            force: false,
            progress: &|_| {},
            cancel: &cancel,
        },
    )
    .unwrap_err();
    assert!(matches!(err, SynthError::Exists { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"keep");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Per-layer pick counts of `n` random tokens through the model at `path`.
fn route_counts(path: &Path, dir: &Path, n: usize) -> Vec<Vec<usize>> {
    let mut model = Model::load(path).unwrap();
    let trace_path = dir.join("routing.trace");
    model.record_routing(&trace_path).unwrap();
    let n_vocab = model.cfg.n_vocab as u64;
    let mut state = 12345u64;
    let tokens: Vec<u32> = (0..n)
        .map(|_| (synth::blocks::splitmix64(&mut state) % n_vocab) as u32)
        .collect();
    let mut kv = model.new_state(n, false);
    model.forward(&mut kv, &tokens, Logits::None).unwrap();
    model.finish_routing().unwrap();
    let trace = RoutingTrace::read(&trace_path).unwrap();
    let (layers, k, e) = (
        trace.header.n_layer as usize,
        trace.header.top_k as usize,
        trace.header.n_expert as usize,
    );
    let mut counts = vec![vec![0usize; e]; layers];
    for t in 0..trace.n_tokens() {
        for (i, &id) in trace.token(t).iter().enumerate() {
            counts[i / k][id as usize] += 1;
        }
    }
    counts
}

#[test]
fn router_skew_makes_the_top_expert_more_popular() {
    let dir = tmp_dir("skew");
    let mut cfg = tiny(GgmlType::Q8_0, 3);
    cfg.shape.experts = 16;
    let flat = dir.join("flat.gguf");
    write_file(&cfg, &flat);
    cfg.router_skew = 1.5;
    let skewed = dir.join("skewed.gguf");
    write_file(&cfg, &skewed);
    let n = 256;
    let c_flat = route_counts(&flat, &dir, n);
    let c_skew = route_counts(&skewed, &dir, n);
    for layer in 0..cfg.shape.layers {
        let top4 = |c: &[usize]| {
            let mut c = c.to_vec();
            c.sort_unstable_by(|a, b| b.cmp(a));
            c[..4].iter().sum::<usize>()
        };
        // Uniform: 4 of 16 experts take 25 % of the 512 picks (128); random weights alone
        // make some experts a bit more popular, the skew much more.
        let (flat4, skew4) = (top4(&c_flat[layer]), top4(&c_skew[layer]));
        assert!(
            skew4 as f64 > 1.3 * flat4 as f64,
            "layer {layer}: 4 most popular experts take {skew4} picks skewed vs {flat4} flat"
        );
        // The most picked expert is one of the 3 with the largest router scale.
        let scales = router_scales(16, 1.5, 3, layer);
        let mut by_scale: Vec<usize> = (0..16).collect();
        by_scale.sort_by(|&a, &b| scales[b].total_cmp(&scales[a]));
        let top = (0..16).max_by_key(|&e| c_skew[layer][e]).unwrap();
        assert!(
            by_scale[..3].contains(&top),
            "layer {layer}: top expert {top}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
