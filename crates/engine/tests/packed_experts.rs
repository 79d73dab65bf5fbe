//! Packed experts (`sluice pack`): logits are identical, bit for bit, when routed experts
//! stream from the packed sidecar (one read per expert) instead of the model file, for both
//! reading backends and budgets from the minimum to everything; the reference is the
//! resident model (no streaming). A sidecar made for another model, a truncated one and a
//! damaged one are refused with an error naming the sidecar, by the library and by loading;
//! so are one packed from other expert data under the same header (at open) and one with
//! damaged expert data (when that expert is read).

mod common;

use std::path::{Path, PathBuf};

use common::{qwen3moe_fixture as fixture, qwen3moe_tokens as tokens, same_bits};
use sluice_engine::load::{Budget, LoadOptions, PackChoice, StreamOptions};
use sluice_engine::tier::pack::{write_pack, PackError, PackFile};
use sluice_engine::tier::{PolicyKind, StreamConfig, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};

fn logits(m: &Model) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let toks = tokens();
    let (prompt, rest) = toks.split_at(toks.len() / 2);
    let mut kv = m.new_state(256, false);
    let mut out = Vec::new();
    out.extend(
        pool.install(|| m.forward(&mut kv, prompt, Logits::All))
            .unwrap(),
    );
    for &t in rest {
        out.extend(
            pool.install(|| m.forward(&mut kv, &[t], Logits::All))
                .unwrap(),
        );
    }
    out
}

fn tmp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-packed-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn pack(model: &Path, out: &Path) {
    let m = Model::load(model).unwrap();
    write_pack(
        model,
        m.map.bytes(),
        m.gguf.data_offset,
        &m.groups.experts,
        out,
    )
    .unwrap();
}

fn open(pack: &Path, model: &Path) -> Result<PackFile, PackError> {
    let m = Model::load(model).unwrap();
    PackFile::open(
        pack,
        model,
        m.map.bytes(),
        m.gguf.data_offset,
        &m.groups.experts,
    )
}

#[test]
fn packed_logits_bit_identical() {
    let dir = tmp_dir("logits");
    for name in ["a-q8_0.gguf", "b-f32.gguf"] {
        let path = fixture(name);
        let sidecar = dir.join(format!("{name}.slpack"));
        pack(&path, &sidecar);
        let pf = open(&sidecar, &path).unwrap();
        let resident = Model::load(&path).unwrap();
        let want = logits(&resident);
        let k = resident.cfg.n_expert_used;
        let min = StreamingExperts::min_budget(&resident.groups.experts, k);
        let all = resident.groups.experts.total_bytes() * 2;
        for backend in [Backend::Uring, Backend::Pread] {
            for budget in [min, min + min / 2, all] {
                for direct in [true, false] {
                    let cfg = StreamConfig {
                        budget,
                        policy: PolicyKind::default(),
                        resident_layers: 0,
                        io: IoConfig {
                            backend,
                            direct,
                            depth: 8,
                            inflight_bytes: 0,
                            threads: 2,
                            high_priority: false,
                        },
                    };
                    let mut m = Model::load(&path).unwrap();
                    let s = std::sync::Arc::new(
                        StreamingExperts::open_packed(&path, &m.groups.experts, k, &cfg, Some(&pf))
                            .unwrap(),
                    );
                    m.set_expert_source(Box::new(s.clone()));
                    let got = logits(&m);
                    assert!(
                        same_bits(&got, &want),
                        "{name}: packed logits differ with {backend:?} budget {budget} direct {direct}"
                    );
                    // One read per missed expert (the point of packing).
                    let io = s.io_stats();
                    let cs = s.cache_stats();
                    assert!(cs.total.misses > 0);
                    assert_eq!(
                        io.bytes_requested,
                        cs.total.misses
                            * (resident.groups.experts.total_bytes()
                                / (resident.cfg.n_layer * resident.cfg.n_expert) as u64),
                        "{name}: bytes requested must be misses x expert bytes"
                    );
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn load_with(model: &Path, pack: PackChoice) -> Result<sluice_engine::load::Loaded, String> {
    LoadOptions {
        path: model.to_path_buf(),
        threads: 1,
        ctx: 64,
        stream: Some(StreamOptions {
            budget: "100%".parse::<Budget>().unwrap(),
            budget_text: "100%".into(),
            policy: PolicyKind::default(),
            resident_layers: 0,
            io: buffered_pread(),
            hash_prefetch: true,
            lookahead: true,
            pack,
            preload_profile: None,
        }),
        record_routing: None,
        ple: Default::default(),
        sequences: 1,
        device: Default::default(),
        weight_load: Default::default(),
    }
    .load()
    .map_err(|e| e.to_string())
}

#[test]
fn mismatched_truncated_and_damaged_sidecars_are_refused() {
    let dir = tmp_dir("refuse");
    let a = fixture("a-q8_0.gguf");
    let b = fixture("b-f32.gguf");
    let a_f32 = fixture("a-f32.gguf");
    let sidecar = dir.join("a.slpack");
    pack(&a, &sidecar);
    assert!(load_with(&a, PackChoice::File(sidecar.clone())).is_ok());
    // Another model (other shape; same shape, other type).
    for other in [&b, &a_f32] {
        let e = open(&sidecar, other).unwrap_err();
        assert!(matches!(e, PackError::Mismatch { .. }), "{e}");
        let msg = load_with(other, PackChoice::File(sidecar.clone()))
            .err()
            .expect("a sidecar of another model must be refused");
        assert!(
            msg.contains("a.slpack") && msg.contains("does not match"),
            "{msg}"
        );
    }
    let bytes = std::fs::read(&sidecar).unwrap();
    // Truncated.
    let cut = dir.join("cut.slpack");
    std::fs::write(&cut, &bytes[..bytes.len() - 4096]).unwrap();
    let msg = load_with(&a, PackChoice::File(cut.clone())).err().unwrap();
    assert!(
        msg.contains("cut.slpack") && msg.contains("truncated"),
        "{msg}"
    );
    std::fs::write(&cut, &bytes[..10]).unwrap();
    let msg = load_with(&a, PackChoice::File(cut.clone())).err().unwrap();
    assert!(msg.contains("cut.slpack"), "{msg}");
    // A damaged header (a layer record's byte flipped).
    let mut bad = bytes.clone();
    bad[70] ^= 0x40;
    std::fs::write(&cut, &bad).unwrap();
    let msg = load_with(&a, PackChoice::File(cut.clone())).err().unwrap();
    assert!(
        msg.contains("cut.slpack") && msg.contains("damaged"),
        "{msg}"
    );
    // A missing file given by name.
    let msg = load_with(&a, PackChoice::File(dir.join("none.slpack")))
        .err()
        .unwrap();
    assert!(msg.contains("none.slpack"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sidecar is bound to the expert bytes it was packed from (issue 35 item 2): one packed
/// from a file with the same header and other expert data is refused at open, and one with
/// damaged expert data fails the read of that expert with an error naming the sidecar;
/// neither ever yields logits.
#[test]
fn sidecar_bound_to_expert_data() {
    let dir = tmp_dir("bound");
    let a = fixture("a-q8_0.gguf");
    let m = Model::load(&a).unwrap();
    let u0 = m.groups.experts.layers.iter().flatten().next().unwrap();
    // Same header and size, one expert byte different (first expert's first matrix).
    let mut other = std::fs::read(&a).unwrap();
    let at = u0.part_range(0, 0).start as usize + 5;
    other[at] ^= 0x21;
    let a2 = dir.join("a2.gguf");
    std::fs::write(&a2, &other).unwrap();
    let foreign = dir.join("foreign.slpack");
    pack(&a2, &foreign);
    let e = open(&foreign, &a).unwrap_err();
    assert!(matches!(e, PackError::Mismatch { .. }), "{e}");
    let msg = load_with(&a, PackChoice::File(foreign.clone()))
        .err()
        .expect("a sidecar packed from other expert data must be refused");
    assert!(
        msg.contains("foreign.slpack") && msg.contains("does not match") && !msg.contains('\n'),
        "{msg}"
    );
    // A flipped byte in every expert's data of the sidecar: every read of it fails.
    let good = dir.join("good.slpack");
    pack(&a, &good);
    let pf = open(&good, &a).unwrap();
    let mut bytes = std::fs::read(&good).unwrap();
    for p in pf.layers.iter().flatten() {
        for e in 0..p.n_units {
            bytes[p.offset(e) as usize + 7] ^= 0x04;
        }
    }
    let flipped = dir.join("flipped.slpack");
    std::fs::write(&flipped, &bytes).unwrap();
    let pf = open(&flipped, &a).expect("the header is intact");
    let k = m.cfg.n_expert_used;
    let cfg = StreamConfig {
        budget: m.groups.experts.total_bytes() * 2,
        policy: PolicyKind::default(),
        resident_layers: 0,
        io: buffered_pread(),
    };
    let mut sm = Model::load(&a).unwrap();
    let s = StreamingExperts::open_packed(&a, &sm.groups.experts, k, &cfg, Some(&pf)).unwrap();
    sm.set_expert_source(Box::new(s));
    let mut kv = sm.new_state(64, false);
    let err = sm
        .forward(&mut kv, &tokens()[..4], Logits::All)
        .expect_err("a damaged sidecar must not give logits");
    let msg = err.to_string();
    assert!(
        msg.contains("flipped.slpack") && msg.contains("damaged") && !msg.contains('\n'),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Buffered pread, depth 4, two threads: the IO the packed-sidecar checks here read with.
fn buffered_pread() -> IoConfig {
    IoConfig {
        backend: Backend::Pread,
        direct: false,
        depth: 4,
        inflight_bytes: 0,
        threads: 2,
        high_priority: false,
    }
}
