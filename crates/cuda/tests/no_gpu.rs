//! The CUDA backend without a GPU: opening it is a clean error (no panic, no abort), the
//! kernel source compiles with NVRTC where NVRTC is installed (no GPU needed for that), and
//! the RAM tier hands the slot memory that `--gpu` page-locks to a `SlotMemory` hook such
//! that every streamed expert matrix a compute backend gets lies inside it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

mod common;
use common::fixtures;

use sluice_cuda::{compile_kernels, Cuda, CudaError};
use sluice_engine::models::compute::{Compute, Cpu, LinearJob};
use sluice_engine::tier::{PolicyKind, SlotMemory, StreamConfig, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};
use sluice_kernels::{GgmlType, KernelError};

/// Whether this machine shows an NVIDIA device node (then a GPU may be usable).
fn has_nvidia_node() -> bool {
    std::path::Path::new("/dev/nvidia0").exists()
}

#[test]
fn opening_without_a_gpu_is_a_clean_error() {
    let weights = vec![0u8; 64];
    match Cuda::new(&weights) {
        Ok(c) => {
            assert!(
                has_nvidia_node(),
                "Cuda::new succeeded ({}) on a machine without /dev/nvidia0",
                c.device()
            );
            assert!(!c.device().is_empty());
        }
        Err(e) => {
            let msg = e.to_string();
            eprintln!("Cuda::new: {msg}");
            assert!(!msg.is_empty());
            assert!(
                matches!(
                    e,
                    CudaError::NoDriver | CudaError::NoNvrtc | CudaError::NoDevice(_)
                ) || has_nvidia_node(),
                "without a GPU the error must say there is no driver / NVRTC / device: {msg}"
            );
            // Twice: the first failure leaves nothing half-initialised behind.
            assert!(Cuda::new(&weights).is_err());
        }
    }
}

/// Needs libnvrtc (e.g. the `nvidia-cuda-nvrtc` wheel's lib directory on LD_LIBRARY_PATH,
/// or a CUDA toolkit), no GPU: `cargo test -p sluice-cuda --test no_gpu -- --ignored`.
#[test]
#[ignore = "needs NVRTC (CUDA toolkit or the nvidia-cuda-nvrtc wheel), not a GPU"]
fn kernels_compile_with_nvrtc() {
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile_kernels(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        for (_, f) in sluice_cuda::FORMATS {
            for k in ["mv", "mm", "mvg", "mvt", "mvt1", "embed"] {
                let name = format!(".entry {k}_{f}(");
                assert!(ptx.contains(&name), "{arch}: PTX lacks {name}");
            }
        }
        for k in [
            "rms_norm_rows",
            "residual_norm",
            "qk_norm_rope",
            "kv_store_f16",
            "kv_store_f32",
            "attention_f16",
            "attention_f32",
            "topk_route",
            "moe_chunks",
            "glu_act",
            "moe_combine",
            "mla_kv_prep",
            "mla_q_split",
            "mla_q_join",
            "hc_expand",
            "hc_pre",
            "hc_post",
            "dsv4_heads",
            "dsv4_kv_prep",
            "dsv4_compress",
            "ring_store",
            "dsv4_index_scores",
            "dsv4_topk",
            "dsv4_attention",
            "dsa_key_prep",
            "quant_x8",
        ] {
            let name = format!(".entry {k}(");
            assert!(ptx.contains(&name), "{arch}: PTX lacks {name}");
        }
        // Every kernel's parameters (the whole forward pass's and the products backend's
        // `mv_*` / `mm_*`) are what its launches pass.
        let mut checked = 0;
        for (name, params) in ptx_entries(&ptx) {
            let Some(sig) = sluice_cuda::forward::kernel_signature(&name) else {
                continue;
            };
            let want: Vec<&str> = sig
                .chars()
                .map(|c| match c {
                    'P' | 'L' => ".u64",
                    'I' => ".u32",
                    'F' => ".f32",
                    other => panic!("{name}: unknown kind {other}"),
                })
                .collect();
            assert_eq!(
                params, want,
                "{arch}: {name}'s parameters vs its signature {sig}"
            );
            checked += 1;
        }
        // The int8 products of Q8_0 and Q4_K, Q4_K's dp4a decode product.
        for k in ["mvq_q4_k", "mvq_q4_k_q"] {
            let name = format!(".entry {k}(");
            assert!(ptx.contains(&name), "{arch}: PTX lacks {name}");
        }
        for f in ["q8_0", "q4_k"] {
            for k in ["mvi", "mvi1", "mvid"] {
                let name = format!(".entry {k}_{f}(");
                assert!(ptx.contains(&name), "{arch}: PTX lacks {name}");
            }
        }
        // Every format x (mv, mm, mvg, mvt, mvt1, mvd, embed), 2 x (kv_store, attention),
        // 2 x (mvi, mvi1, mvid), mvq_q4_k and mvq_q4_k_q, 38 others.
        let formats = sluice_cuda::FORMATS.len();
        assert!(formats >= 19, "the seeds' formats have kernels");
        assert_eq!(
            checked,
            formats * 7 + 2 * 2 + 2 * 3 + 2 + 38,
            "{arch}: kernels checked"
        );
    }
}

/// (entry name, parameter types) of every `.entry` in `ptx`.
fn ptx_entries(ptx: &str) -> Vec<(String, Vec<&str>)> {
    let mut out = Vec::new();
    let mut lines = ptx.lines();
    while let Some(l) = lines.next() {
        let Some(rest) = l.trim().strip_prefix(".visible .entry ") else {
            continue;
        };
        let name = rest.trim_end_matches('(').to_string();
        let mut params = Vec::new();
        for p in lines.by_ref() {
            let p = p.trim();
            if p.starts_with(')') {
                break;
            }
            if let Some(t) = p.strip_prefix(".param ") {
                params.push(t.split_whitespace().next().unwrap_or(""));
            }
        }
        out.push((name, params));
    }
    out
}

/// A `SlotMemory` hook that keeps the ranges it is told about (what `Cuda` page-locks).
#[derive(Default)]
struct Ranges {
    live: Mutex<BTreeMap<usize, usize>>,
    added: AtomicU64,
}

impl Ranges {
    fn covers(&self, p: usize, len: usize) -> bool {
        let live = self.live.lock().unwrap();
        live.range(..=p)
            .next_back()
            .is_some_and(|(&a, &l)| p + len <= a + l)
    }
}

impl SlotMemory for Ranges {
    fn added(&self, addr: usize, len: usize) {
        self.added.fetch_add(1, Ordering::Relaxed);
        assert!(self.live.lock().unwrap().insert(addr, len).is_none());
    }
    fn removed(&self, addr: usize, len: usize) {
        assert_eq!(self.live.lock().unwrap().remove(&addr), Some(len));
    }
}

/// The CPU backend, checking that every routed-expert matrix it gets lies in a hooked range.
struct Checking {
    ranges: Arc<Ranges>,
    expert_jobs: AtomicU64,
    outside: AtomicU64,
}

impl Compute for Checking {
    fn linear(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        Cpu.linear(ty, w, rows, cols, x, n, y)
    }
    fn linear_group(&self, jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
        for j in jobs.iter() {
            if j.unit.is_some() {
                self.expert_jobs.fetch_add(1, Ordering::Relaxed);
                if !self.ranges.covers(j.w.as_ptr() as usize, j.w.len()) {
                    self.outside.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        Cpu.linear_group(jobs)
    }
    fn name(&self) -> &'static str {
        "checking"
    }
}

fn all_logits(m: &Model, toks: &[u32]) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let mut kv = m.new_state(toks.len() + 8, false);
    let (prompt, rest) = toks.split_at(toks.len() / 2);
    let mut out = pool
        .install(|| m.forward(&mut kv, prompt, Logits::All))
        .unwrap();
    for &t in rest {
        out.extend(
            pool.install(|| m.forward(&mut kv, &[t], Logits::All))
                .unwrap(),
        );
    }
    out
}

/// `--gpu --expert-cache`: the hook, set once every slot exists or while the background
/// filler is still making them (as the CLI does), hears of every slot, and every expert
/// matrix handed to the backend lies inside a range it holds at that moment; logits equal
/// the resident run's; dropping the tier removes every range.
#[test]
fn streamed_experts_lie_in_the_slot_memory_the_hook_holds() {
    for slots_first in [true, false] {
        hook_covers_streamed_experts(slots_first);
    }
}

fn hook_covers_streamed_experts(slots_first: bool) {
    let path = fixtures().join("qwen3moe/a-q8_0.gguf");
    let ids = std::fs::read_to_string(fixtures().join("qwen3moe/tokens.json")).unwrap();
    let ids: serde_json::Value = serde_json::from_str(&ids).unwrap();
    let toks: Vec<u32> = ids["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let want = all_logits(&Model::load(&path).unwrap(), &toks);
    let mut m = Model::load(&path).unwrap();
    let min = StreamingExperts::min_budget(&m.groups.experts, m.cfg.n_expert_used);
    let cfg = StreamConfig {
        budget: min.max(m.groups.experts.total_bytes() / 3),
        policy: PolicyKind::Lru,
        resident_layers: 0,
        io: IoConfig {
            backend: Backend::Pread,
            direct: false,
            depth: 4,
            inflight_bytes: 0,
            threads: 2,
            high_priority: false,
        },
    };
    let s = Arc::new(
        StreamingExperts::open(&path, &m.groups.experts, m.cfg.n_expert_used, &cfg).unwrap(),
    );
    if slots_first {
        s.wait_slots_ready();
        assert!(s.cache_stats().slot_allocations > 0);
    }
    let ranges = Arc::new(Ranges::default());
    s.set_slot_memory(ranges.clone());
    let check = Arc::new(Checking {
        ranges: ranges.clone(),
        expert_jobs: AtomicU64::new(0),
        outside: AtomicU64::new(0),
    });
    m.set_expert_source(Box::new(s.clone()));
    m.set_compute(Box::new(check.clone()));
    let got = all_logits(&m, &toks);
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "streamed logits differ from resident"
    );
    let (jobs, outside) = (
        check.expert_jobs.load(Ordering::Relaxed),
        check.outside.load(Ordering::Relaxed),
    );
    assert!(jobs > 0, "no expert product reached the backend");
    assert_eq!(
        outside, 0,
        "{outside} of {jobs} expert products outside the hooked slots"
    );
    s.wait_slots_ready();
    let slots = s.cache_stats().slot_allocations;
    assert_eq!(
        ranges.added.load(Ordering::Relaxed),
        slots,
        "slots_first {slots_first}: every slot hooked once"
    );
    assert!(s.cache_stats().total.misses > 0 && s.cache_stats().total.evictions > 0);
    drop(m);
    drop(s);
    assert!(
        ranges.live.lock().unwrap().is_empty(),
        "ranges left after the tier was dropped"
    );
}

/// `GpuDecoder::check` refuses `plan` edited by `edit`, naming `what`.
fn assert_refused(
    plan: &sluice_engine::models::plan::DecoderPlan,
    edit: impl FnOnce(&mut sluice_engine::models::plan::DecoderPlan),
    what: &str,
) {
    let mut p = plan.clone();
    edit(&mut p);
    let e = sluice_cuda::forward::GpuDecoder::check(&p).expect_err(what);
    assert!(e.contains(what), "{e}");
}

/// Which decoder plans the whole-forward GPU path takes, decided without a GPU: the
/// qwen3moe fixture (head size 16, Q8_0) is taken; a matrix in a format without a kernel, a
/// head wider than the attention kernel's and a top-k above the expert count are refused
/// with the part named; so are DeepSeek V4, Qwen3.8-Flash-Next and GLM-5.3-Flash plans past
/// the kernels' limits, while kernel-sized files of each seed architecture are taken.
#[test]
fn decoder_plans_the_gpu_takes() {
    use sluice_cuda::forward::GpuDecoder;
    use sluice_engine::models::plan::{DecoderPlan, MlaSelect, PlanAttn, PlanFfn};
    let m = Model::load(&fixtures().join("qwen3moe/a-q8_0.gguf")).unwrap();
    let plan = m.plan().expect("qwen3moe has a decoder plan");
    GpuDecoder::check(&plan).unwrap();

    let mut p = plan.clone();
    if let PlanAttn::Gqa { w, .. } = &mut p.layers[1].attn {
        w.wq.ty = GgmlType::TQ2_0;
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("layer 1 attention q"), "{e}");

    let mut p = plan.clone();
    p.shape.head_dim = 578;
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("head sizes 578"), "{e}");

    let mut p = plan.clone();
    if let PlanFfn::Moe { moe, .. } = &mut p.layers[0].ffn {
        moe.k = moe.n_expert + 1;
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("layer 0: top-"), "{e}");

    // DeepSeek V4's plan (hyper-connections, its own attention, hashed and biased
    // routers, clamped SwiGLU): the tiny fixture and a file with the real head size (512)
    // are taken; parts past the kernels' limits are refused, named.
    let dir = std::env::temp_dir().join(format!("sluice-no-gpu-ds4-{}", std::process::id()));
    let wide = Model::load(&common::deepseek4_wide(&dir, 8)).unwrap();
    let plan = wide.plan().expect("deepseek4 has a decoder plan");
    assert_eq!(plan.shape.head_dim, 512);
    GpuDecoder::check(&plan).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    let ds = Model::load(&fixtures().join("deepseek4/a-f32.gguf")).unwrap();
    let plan = ds.plan().expect("deepseek4 has a decoder plan");
    GpuDecoder::check(&plan).unwrap();
    let mut p = plan.clone();
    p.hyper.as_mut().unwrap().shape.n_hc = 9;
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("hyper-connections of 9 streams"), "{e}");
    let mut p = plan.clone();
    p.layers[2].hc = None;
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("layer 2: hyper-connection mixes"), "{e}");
    let mut p = plan.clone();
    if let PlanAttn::Dsv4 { shape, .. } = &mut p.layers[3].attn {
        shape.window = 64;
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(
        e.contains("layer 3: DeepSeek V4 attention: its shape differs"),
        "{e}"
    );
    let mut p = plan.clone();
    if let PlanAttn::Dsv4 { w, .. } = &mut p.layers[1].attn {
        w.indexer.as_mut().unwrap().n_head = 200;
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(
        e.contains("layer 1: DeepSeek V4 attention: an indexer of 200 heads"),
        "{e}"
    );
    let mut p = plan.clone();
    if let PlanAttn::Dsv4 { shape, .. } = &mut p.layers[0].attn {
        shape.n_rot = 3;
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("layer 0: DeepSeek V4 attention"), "{e}");
    // Layer 0's hash table naming expert 8 of 8, or one expert twice for a token (a chunk
    // would hold two of its rows).
    let with_table = |edit: &dyn Fn(&mut Vec<u32>)| {
        let mut p = plan.clone();
        let PlanFfn::Moe { moe, .. } = &mut p.layers[0].ffn else {
            panic!("layer 0 of the file is a MoE layer")
        };
        let sluice_engine::models::blocks::moe::Router::Hash { table, .. } = &mut moe.router else {
            panic!("layer 0 of the file is hash-routed")
        };
        edit(table);
        GpuDecoder::check(&p).unwrap_err()
    };
    for e in [with_table(&|t| t[5] = 8), with_table(&|t| t[1] = t[0])] {
        assert!(e.contains("layer 0: a hash router table"), "{e}");
    }
    // Post-norms inside the hyper-connection residual (no kernel applies them there).
    let mut p = plan.clone();
    p.layers[2].post_ffn_norm = Some(vec![1.0; p.n_embd]);
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(
        e.contains("layer 2: post-norms inside a hyper-connection"),
        "{e}"
    );
    // Qwen3.8-Flash-Next: the tiny fixture's mixers have 8-column products (no kernel); a
    // file of kernel-sized matrices (low-rank mixers, PLE, DeltaNet, QSA with its indexer,
    // the gated shared expert) is taken; shapes past the kernels' limits are refused.
    let q4 = Model::load(&fixtures().join("qwen4exp/a-f32.gguf")).unwrap();
    let e = GpuDecoder::check(&q4.plan().expect("qwen4exp has a decoder plan")).unwrap_err();
    assert!(
        e.contains("layer 0 attention mixer up: F32 with 8 columns"),
        "{e}"
    );
    let dir = std::env::temp_dir().join(format!("sluice-no-gpu-q4-{}", std::process::id()));
    let q4 = Model::load(&common::qwen4exp_wide(&dir, 4)).unwrap();
    let plan = q4.plan().expect("qwen4exp has a decoder plan");
    assert!(plan.lowrank.is_some() && plan.ple.is_some());
    GpuDecoder::check(&plan).unwrap();
    let delta_past_limit = |p: &mut DecoderPlan| {
        if let PlanAttn::Delta { shape, .. } = &mut p.layers[0].attn {
            shape.d_v = 1024;
        }
    };
    assert_refused(&plan, delta_past_limit, "layer 0: a Gated DeltaNet");
    let budget_not_blocks = |p: &mut DecoderPlan| {
        if let PlanAttn::Qsa { shape, .. } = &mut p.layers[3].attn {
            shape.budget = 18;
        }
    };
    assert_refused(&plan, budget_not_blocks, "layer 3: a QSA layer");
    let no_injection =
        |p: &mut DecoderPlan| p.layers[1].hc_lowrank.as_mut().unwrap()[1].inject = None;
    assert_refused(
        &plan,
        no_injection,
        "layer 1: low-rank mixers of the wrong shape",
    );
    let norm_beside = |p: &mut DecoderPlan| p.layers[2].ffn_norm = vec![1.0; p.n_embd];
    assert_refused(&plan, norm_beside, "layer 2: norms beside low-rank mixers");
    // A cut of recurrent layers only (its plan's attention shape is no QSA layer's) is
    // taken.
    let cut = Model::load(&common::qwen4exp_wide(&dir, 3)).unwrap();
    GpuDecoder::check(&cut.plan().expect("qwen4exp has a decoder plan")).unwrap();
    let no_hash = |p: &mut DecoderPlan| p.ple = None;
    assert_refused(
        &plan,
        no_hash,
        "layer 1: a PLE layer without the plan's hash",
    );
    std::fs::remove_dir_all(&dir).unwrap();
    // GLM-5.3-Flash: the tiny fixture's k_b has 16 columns (no product kernel); a file of
    // kernel-sized matrices (hyper-connections with the mean head, KDA, pooled latent
    // attention with its k-pool indexer) is taken; shapes past the kernels' limits are
    // refused.
    let g5 = Model::load(&fixtures().join("glm5next/a-f32.gguf")).unwrap();
    let p = g5.plan().expect("glm5next has a decoder plan");
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(
        e.contains("layer 1 attention k_b: F32 with 16 columns"),
        "{e}"
    );
    let dir = std::env::temp_dir().join(format!("sluice-no-gpu-g5-{}", std::process::id()));
    let g5 = Model::load(&common::glm5next_wide(&dir)).unwrap();
    let plan = g5.plan().expect("glm5next has a decoder plan");
    GpuDecoder::check(&plan).unwrap();
    let kda_past_limit = |p: &mut DecoderPlan| {
        if let PlanAttn::Kda { shape, .. } = &mut p.layers[0].attn {
            shape.head_dim = 1024;
        }
    };
    assert_refused(&plan, kda_past_limit, "layer 0: a Kimi delta attention");
    let unlike_first = |p: &mut DecoderPlan| {
        if let PlanAttn::Pooled { shape, .. } = &mut p.layers[7].attn {
            shape.kv_lora = 128;
        }
    };
    assert_refused(&plan, unlike_first, "layer 7: pooled latent attention");
    let shared_first = |p: &mut DecoderPlan| {
        if let PlanAttn::Pooled { w, .. } = &mut p.layers[3].attn {
            w.indexer = None;
        }
    };
    assert_refused(&plan, shared_first, "layer 3: a shared pooled layer before");
    std::fs::remove_dir_all(&dir).unwrap();

    // GLM-DSA's plan (MLA, biased sigmoid router, shared experts): the tiny fixture's k_b
    // has 16 columns (no product kernel); GLM-5's latent widths (576-wide keys, 512-wide
    // values) with kernel-sized matrices are taken; a hashed router whose table does not
    // cover the vocabulary is refused.
    let glm = Model::load(&fixtures().join("glm_dsa/a-f32.gguf")).unwrap();
    let plan = glm.plan().expect("glm-dsa has a decoder plan");
    let e = GpuDecoder::check(&plan).unwrap_err();
    assert!(
        e.contains("layer 0 attention k_b: F32 with 16 columns"),
        "{e}"
    );
    let dir = std::env::temp_dir().join(format!("sluice-no-gpu-glm-{}", std::process::id()));
    let wide = Model::load(&common::glm_dsa_wide_mla(&dir, 5, 64)).unwrap();
    let plan = wide.plan().expect("glm-dsa has a decoder plan");
    assert_eq!((plan.shape.head_dim, plan.shape.head_dim_v), (576, 512));
    assert_eq!(plan.max_positions, None);
    GpuDecoder::check(&plan).unwrap();
    let mut p = plan.clone();
    if let PlanAttn::Mla {
        select: MlaSelect::Indexer(ix),
        ..
    } = &mut p.layers[1].attn
    {
        ix.n_head = 1000;
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(e.contains("layer 1: a DSA indexer of 1000 heads"), "{e}");
    let mut p = plan.clone();
    if let PlanFfn::Moe { moe, .. } = &mut p.layers[1].ffn {
        moe.router = sluice_engine::models::blocks::moe::Router::Hash {
            table: vec![0; 8],
            score: sluice_engine::models::blocks::moe::ScoreFn::Sigmoid,
            norm: true,
            scale: 1.0,
        };
    }
    let e = GpuDecoder::check(&p).unwrap_err();
    assert!(
        e.contains("layer 1: a hash router table of 8 entries"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
