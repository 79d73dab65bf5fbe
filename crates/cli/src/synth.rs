//! `sluice synth -o FILE`: write a random-weight GGUF with a real architecture's shape
//! (qwen3moe), for benchmarking expert streaming on models larger than RAM side by side
//! with llama.cpp.
//!
//! Owns: the flags (presets, free dimensions, quant, router skew, vocabulary source), the
//! plan summary, the progress bar and Ctrl-C handling. Generation lives in
//! `sluice_synth`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_gguf::GgmlType;
use sluice_synth as synth;
use sluice_synth::deepseek4::{Dsv4Config, Dsv4Preset, Dsv4Quant};
use sluice_synth::glm_dsa::{GlmDsaConfig, GlmDsaPreset, GlmDsaQuant};
use sluice_synth::{Plan, Preset, SynthConfig, Vocab, WriteOptions};

/// Arguments of `sluice synth`.
///
/// The weights are random: the file is for speed measurements (IO, kernels, memory), not for
/// text. Routing is synthetic too: with `--router-skew 0` every expert is equally likely,
/// with S > 0 expert popularity falls off Zipf-like; real models' routing differs (it
/// depends on the text and is correlated across tokens and layers).
#[derive(clap::Args)]
pub struct SynthArgs {
    /// Output file (written as FILE.tmp, renamed when complete).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Architecture: qwen3moe, deepseek4 (DeepSeek V4: presets deepseek-v4-flash and
    /// deepseek4-tiny, --quant q2 or mxfp4; of the shape flags only --layers and --vocab
    /// apply), glm-dsa (GLM-5.2/5.3: presets glm-5.2 and glm-dsa-tiny, --quant iq2xxs or q2;
    /// of the shape flags only --layers and --vocab apply), qwen4exp (Qwen3.8-Flash-Next, the real shape with its 320M-row n-gram PLE
    /// table; only --layers, --quant, --ple-quant, --seed and --name apply; also chosen by
    /// `--preset qwen3.8-flash-next`), or glm5next (GLM-5.3-Flash, the real shape without the
    /// MTP block; only --layers, --experts, --quant, --vocab-from, --seed and --name apply;
    /// also chosen by `--preset glm-5.3-flash`).
    #[arg(long, default_value = "qwen3moe")]
    pub arch: String,
    /// Shape preset: tiny, qwen3-30b-a3b, qwen3-235b-a22b (qwen3moe); deepseek-v4-flash,
    /// deepseek4-tiny (deepseek4; default deepseek4-tiny); glm-5.2 (also glm-5.3), glm-dsa-tiny
    /// (glm-dsa; default glm-dsa-tiny); qwen3.8-flash-next (qwen4exp); glm-5.3-flash (glm5next).
    /// The flags below override it.
    #[arg(long)]
    pub preset: Option<String>,
    #[arg(long)]
    pub layers: Option<usize>,
    /// Hidden size (embedding length).
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Routed experts per layer.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts used per token.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Hidden size of one expert's FFN.
    #[arg(long)]
    pub expert_ff: Option<usize>,
    /// Vocabulary size (default: the tokenizer's token count; larger pads with [PADn] tokens).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Trained context length written to the metadata.
    #[arg(long)]
    pub context: Option<usize>,
    /// Type of the large matrices (experts, attention, embeddings/output): F32, Q8_0, Q4_K,
    /// Q6_K. Norms and the router stay F32. A matrix whose rows are not a multiple of the
    /// block size falls back to Q8_0 (then F32). Default Q8_0.
    /// deepseek4: q2 (routed gate/up IQ2_XXS, down Q2_K; attention, shared expert and
    /// output Q8_0; hyper-connection, router, compressor, indexer F16) or mxfp4 (routed
    /// experts MXFP4, the rest the same). glm-dsa: iq2xxs or q2 (routed experts IQ2_XXS or
    /// Q2_K; attention, indexer, dense/shared FFN, embedding, output Q8_0; router, norms F32).
    #[arg(long)]
    pub quant: Option<String>,
    /// Synthetic expert popularity: 0 = uniform; S > 0 scales router row e by
    /// (1 + rank(e))^(-S/2) (ranks a seeded permutation per layer), so popularity falls
    /// Zipf-like with rank (S = 1, 128 experts, top-8: the 8 most popular take ~30 % of picks).
    /// Synthetic: real models' routing differs.
    #[arg(long, default_value_t = 0.0)]
    pub router_skew: f32,
    /// Copy the tokenizer (tokenizer.* metadata) from this GGUF, e.g. llama.cpp's
    /// models/ggml-vocab-qwen2.gguf. Default: a small built-in byte-level vocabulary.
    #[arg(long)]
    pub vocab_from: Option<PathBuf>,
    /// qwen3.8-flash-next: type of the PLE table: Q4_0 (28.8 GB, ggml-org), Q8_0 (54.4 GB,
    /// unsloth UD-Q5/Q6) or F32.
    #[arg(long, default_value = "Q4_0")]
    pub ple_quant: String,
    /// Seed: the same seed and flags give the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// general.name (default: "sluice synth <preset> <quant>").
    #[arg(long)]
    pub name: Option<String>,
    /// Replace OUTPUT if it exists.
    #[arg(long)]
    pub force: bool,
    /// Print the plan and exit without writing.
    #[arg(long)]
    pub dry_run: bool,
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The configuration the flags describe.
pub fn config(args: &SynthArgs) -> Result<SynthConfig> {
    let name = args.preset.as_deref().unwrap_or("tiny");
    let preset = Preset::from_name(name).ok_or_else(|| {
        anyhow!(
            "unknown --preset '{name}'; known: {}",
            Preset::NAMES.join(", ")
        )
    })?;
    let q = args.quant.as_deref().unwrap_or("Q8_0");
    let quant = GgmlType::from_name(&q.to_uppercase())
        .filter(|t| synth::QUANTS.contains(t))
        .ok_or_else(|| anyhow!("--quant '{q}': expected F32, Q8_0, Q4_K or Q6_K"))?;
    let mut s = preset.shape();
    let set = |v: &mut usize, o: Option<usize>| {
        if let Some(o) = o {
            *v = o;
        }
    };
    set(&mut s.layers, args.layers);
    set(&mut s.hidden, args.hidden);
    set(&mut s.heads, args.heads);
    set(&mut s.kv_heads, args.kv_heads);
    set(&mut s.head_dim, args.head_dim);
    set(&mut s.experts, args.experts);
    set(&mut s.top_k, args.top_k);
    set(&mut s.expert_ff, args.expert_ff);
    set(&mut s.context, args.context);
    if args.vocab.is_some() {
        s.vocab = args.vocab;
    }
    Ok(SynthConfig {
        shape: s,
        quant,
        router_skew: args.router_skew,
        seed: args.seed,
        name: args
            .name
            .clone()
            .unwrap_or_else(|| format!("sluice synth {} {}", preset.name(), quant)),
    })
}

fn print_plan(args: &SynthArgs, cfg: &SynthConfig, plan: &Plan, vocab_src: &str) {
    let s = &cfg.shape;
    let r = plan.role_bytes();
    let size = plan.file_size();
    eprintln!(
        "synth {}: qwen3moe, {} layers, hidden {}, {}/{} heads of {}, {} experts of {} (top-{}), \
         vocab {} ({}), {}, seed {}, router skew {}",
        args.output.display(),
        s.layers,
        s.hidden,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.experts,
        s.expert_ff,
        s.top_k,
        plan.layout
            .tensor("token_embd.weight")
            .map_or(0, |t| t.dims[1]),
        vocab_src,
        cfg.quant,
        cfg.seed,
        cfg.router_skew
    );
    eprintln!(
        "  file: {size} bytes ({:.2} GiB), {} tensors",
        gib(size),
        plan.layout.tensors.len()
    );
    eprintln!(
        "  routed experts: {:.2} GiB ({:.1} %), {} bytes per expert ({} layers x {} experts)",
        gib(r.routed_experts),
        100.0 * r.routed_experts as f64 / size as f64,
        plan.one_expert_bytes(),
        s.layers,
        s.experts
    );
    eprintln!(
        "  resident: {:.2} GiB (attention, norms, router) + embeddings/output {:.2} GiB",
        gib(r.resident),
        gib(r.embeddings)
    );
    for f in &plan.fallbacks {
        eprintln!("  note: {f}");
    }
}

/// Presets whose only free dimensions are `--layers` and `--vocab` (deepseek4, glm-dsa):
/// any other shape flag, or a router skew, is an error naming the flag.
fn only_layers_and_vocab(args: &SynthArgs, arch: &str) -> Result<()> {
    let ignored = [
        ("--hidden", args.hidden),
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--experts", args.experts),
        ("--top-k", args.top_k),
        ("--expert-ff", args.expert_ff),
        ("--context", args.context),
    ];
    if let Some((f, _)) = ignored.iter().find(|(_, v)| v.is_some()) {
        anyhow::bail!("{f} does not apply to --arch {arch} (only --layers and --vocab)");
    }
    if args.router_skew != 0.0 {
        anyhow::bail!("--router-skew does not apply to --arch {arch}");
    }
    Ok(())
}

/// The deepseek4 configuration the flags describe.
pub fn dsv4_config(args: &SynthArgs) -> Result<Dsv4Config> {
    let name = args.preset.as_deref().unwrap_or("deepseek4-tiny");
    let preset = Dsv4Preset::from_name(name).ok_or_else(|| {
        anyhow!(
            "unknown deepseek4 --preset '{name}'; known: {}",
            Dsv4Preset::NAMES.join(", ")
        )
    })?;
    let q = args
        .quant
        .as_deref()
        .ok_or_else(|| anyhow!("--arch deepseek4 needs --quant q2 or mxfp4"))?;
    let quant = Dsv4Quant::from_name(q)
        .ok_or_else(|| anyhow!("--quant '{q}': deepseek4 takes q2 or mxfp4"))?;
    only_layers_and_vocab(args, "deepseek4")?;
    let mut shape = preset.shape();
    if let Some(l) = args.layers {
        shape.layers = l;
    }
    if args.vocab.is_some() {
        shape.vocab = args.vocab;
    }
    Ok(Dsv4Config {
        shape,
        quant,
        seed: args.seed,
        name: args
            .name
            .clone()
            .unwrap_or_else(|| format!("sluice synth {} {}", preset.name(), quant.name())),
    })
}

/// The glm-dsa configuration the flags describe.
pub fn glm_dsa_config(args: &SynthArgs) -> Result<GlmDsaConfig> {
    let name = args.preset.as_deref().unwrap_or("glm-dsa-tiny");
    let preset = GlmDsaPreset::from_name(name).ok_or_else(|| {
        anyhow!(
            "unknown glm-dsa --preset '{name}'; known: {}",
            GlmDsaPreset::NAMES.join(", ")
        )
    })?;
    let q = args
        .quant
        .as_deref()
        .ok_or_else(|| anyhow!("--arch glm-dsa needs --quant iq2xxs or q2"))?;
    let quant = GlmDsaQuant::from_name(q)
        .ok_or_else(|| anyhow!("--quant '{q}': glm-dsa takes iq2xxs or q2"))?;
    only_layers_and_vocab(args, "glm-dsa")?;
    let mut shape = preset.shape();
    if let Some(l) = args.layers {
        shape.layers = l;
    }
    if args.vocab.is_some() {
        shape.vocab = args.vocab;
    }
    Ok(GlmDsaConfig {
        shape,
        quant,
        seed: args.seed,
        name: args
            .name
            .clone()
            .unwrap_or_else(|| format!("sluice synth {} {}", preset.name(), quant.name())),
    })
}

fn print_glm_dsa_plan(args: &SynthArgs, cfg: &GlmDsaConfig, plan: &Plan, vocab_src: &str) {
    let s = &cfg.shape;
    let r = plan.role_bytes();
    let size = plan.file_size();
    let full = synth::glm_dsa::indexer_types(s.layers);
    eprintln!(
        "synth {}: glm-dsa, {} layers ({} dense, {} full indexers), hidden {}, {} MLA heads, {} experts of {} (top-{}), vocab {} ({}), {}, seed {}",
        args.output.display(),
        s.layers,
        s.dense_layers.min(s.layers),
        full.iter().filter(|&&b| b).count(),
        s.hidden,
        s.heads,
        s.experts,
        s.expert_ff,
        s.top_k,
        plan.layout
            .tensor("token_embd.weight")
            .map_or(0, |t| t.dims[1]),
        vocab_src,
        cfg.quant.name(),
        cfg.seed
    );
    eprintln!(
        "  file: {size} bytes ({:.2} GiB), {} tensors; routed experts {:.2} GiB ({} bytes per expert), resident {:.2} GiB + embeddings/output {:.2} GiB",
        gib(size),
        plan.layout.tensors.len(),
        gib(r.routed_experts),
        plan.one_expert_bytes(),
        gib(r.resident),
        gib(r.embeddings)
    );
    for f in &plan.fallbacks {
        eprintln!("  note: {f}");
    }
}

fn print_dsv4_plan(args: &SynthArgs, cfg: &Dsv4Config, plan: &Plan, vocab_src: &str) {
    let s = &cfg.shape;
    let r = plan.role_bytes();
    let size = plan.file_size();
    eprintln!(
        "synth {}: deepseek4, {} layers (compress ratios {:?}), hidden {}, {} heads of {}, {} experts of {} (top-{}, {} hash layers), vocab {} ({}), {}, seed {}",
        args.output.display(),
        s.layers,
        synth::deepseek4::compress_ratios(s.layers),
        s.hidden,
        s.heads,
        s.head_dim,
        s.experts,
        s.expert_ff,
        s.top_k,
        s.hash_layers,
        plan.layout
            .tensor("token_embd.weight")
            .map_or(0, |t| t.dims[1]),
        vocab_src,
        cfg.quant.name(),
        cfg.seed
    );
    eprintln!(
        "  file: {size} bytes ({:.2} GiB), {} tensors",
        gib(size),
        plan.layout.tensors.len()
    );
    eprintln!(
        "  routed experts: {:.2} GiB ({:.1} %), {} bytes per expert ({} layers x {} experts)",
        gib(r.routed_experts),
        100.0 * r.routed_experts as f64 / size as f64,
        plan.one_expert_bytes(),
        s.layers,
        s.experts
    );
    eprintln!(
        "  resident: {:.2} GiB + embeddings/output {:.2} GiB",
        gib(r.resident),
        gib(r.embeddings)
    );
    for f in &plan.fallbacks {
        eprintln!("  note: {f}");
    }
}

/// The `qwen3.8-flash-next` plan (qwen4exp).
fn qwen4exp_plan(args: &SynthArgs) -> Result<Plan> {
    let ty = |s: &str, flag: &str| {
        GgmlType::from_name(&s.to_uppercase()).ok_or_else(|| anyhow!("{flag} '{s}': unknown type"))
    };
    let q = args.quant.as_deref().unwrap_or("Q8_0");
    let quant = ty(q, "--quant")?;
    if !synth::QUANTS.contains(&quant) {
        anyhow::bail!("--quant '{q}': expected F32, Q8_0, Q4_K or Q6_K");
    }
    let cfg = synth::qwen4exp::Q4SynthConfig {
        shape: synth::qwen4exp::Q4Shape::flash_next(),
        layers: args.layers.unwrap_or(synth::qwen4exp::LAYERS),
        quant,
        ple_quant: ty(&args.ple_quant, "--ple-quant")?,
        seed: args.seed,
        name: args
            .name
            .clone()
            .unwrap_or_else(|| format!("sluice synth qwen3.8-flash-next {quant}")),
    };
    let vocab = match &args.vocab_from {
        Some(p) => Vocab::from_gguf(p)?,
        None => Vocab::builtin(),
    };
    let plan = synth::qwen4exp::plan(&cfg, vocab)?;
    let size = plan.file_size();
    let r = plan.role_bytes();
    let table = plan
        .layout
        .tensor("per_layer_token_embd.weight")
        .map_or(0, |t| t.n_bytes);
    eprintln!(
        "synth {}: qwen4exp (Qwen3.8-Flash-Next shape), {} layers, {} matrices, PLE table {} ({:.2} GiB), seed {}",
        args.output.display(),
        cfg.layers,
        cfg.quant,
        cfg.ple_quant,
        gib(table),
        cfg.seed
    );
    eprintln!(
        "  file: {size} bytes ({:.2} GiB), {} tensors; routed experts {:.2} GiB, embeddings/output {:.2} GiB",
        gib(size),
        plan.layout.tensors.len(),
        gib(r.routed_experts),
        gib(r.embeddings)
    );
    for f in &plan.fallbacks {
        eprintln!("  note: {f}");
    }
    Ok(plan)
}

/// The `glm-5.3-flash` plan (glm5next).
fn glm5next_plan(args: &SynthArgs) -> Result<Plan> {
    let q = args.quant.as_deref().unwrap_or("Q8_0");
    let quant = GgmlType::from_name(&q.to_uppercase())
        .filter(|t| synth::QUANTS.contains(t))
        .ok_or_else(|| anyhow!("--quant '{q}': expected F32, Q8_0, Q4_K or Q6_K"))?;
    let ignored = [
        ("--hidden", args.hidden),
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--top-k", args.top_k),
        ("--expert-ff", args.expert_ff),
        ("--context", args.context),
        ("--vocab", args.vocab),
    ];
    if let Some((f, _)) = ignored.iter().find(|(_, v)| v.is_some()) {
        anyhow::bail!("{f} does not apply to glm5next (only --layers and --experts)");
    }
    let cfg = synth::glm5next::G5SynthConfig {
        shape: synth::glm5next::G5Shape::flash(),
        layers: args.layers.unwrap_or(synth::glm5next::LAYERS),
        experts: args.experts.unwrap_or(synth::glm5next::EXPERTS),
        quant,
        seed: args.seed,
        name: args
            .name
            .clone()
            .unwrap_or_else(|| format!("sluice synth glm-5.3-flash {quant}")),
    };
    let vocab = match &args.vocab_from {
        Some(p) => Vocab::from_gguf(p)?,
        None => Vocab::builtin(),
    };
    let plan = synth::glm5next::plan(&cfg, vocab)?;
    let size = plan.file_size();
    let r = plan.role_bytes();
    eprintln!(
        "synth {}: glm5-next (GLM-5.3-Flash shape), {} layers ({} KDA), {} experts of {} (top-{}), {}, seed {}",
        args.output.display(),
        cfg.layers,
        (0..cfg.layers).filter(|&i| synth::glm5next::is_kda(i)).count(),
        cfg.experts,
        synth::glm5next::EXPERT_FF,
        synth::glm5next::TOP_K,
        cfg.quant,
        cfg.seed
    );
    eprintln!(
        "  file: {size} bytes ({:.2} GiB), {} tensors; routed experts {:.2} GiB, embeddings/output {:.2} GiB",
        gib(size),
        plan.layout.tensors.len(),
        gib(r.routed_experts),
        gib(r.embeddings)
    );
    for f in &plan.fallbacks {
        eprintln!("  note: {f}");
    }
    Ok(plan)
}

pub fn main(args: SynthArgs) -> Result<()> {
    let vocab = match &args.vocab_from {
        Some(p) => Vocab::from_gguf(p)?,
        None => Vocab::builtin(),
    };
    let vocab_src = vocab.source.clone();
    let plan = match args.arch.as_str() {
        "qwen4exp" => qwen4exp_plan(&args)?,
        "glm5next" | "glm5-next" => glm5next_plan(&args)?,
        "qwen3moe" if args.preset.as_deref() == Some("glm-5.3-flash") => glm5next_plan(&args)?,
        "qwen3moe" if args.preset.as_deref() == Some("qwen3.8-flash-next") => qwen4exp_plan(&args)?,
        "qwen3moe" => {
            let cfg = config(&args)?;
            let plan = Plan::new(&cfg, vocab)?;
            print_plan(&args, &cfg, &plan, &vocab_src);
            plan
        }
        "deepseek4" => {
            let cfg = dsv4_config(&args)?;
            let plan = synth::deepseek4::plan(&cfg, vocab)?;
            print_dsv4_plan(&args, &cfg, &plan, &vocab_src);
            plan
        }
        "glm-dsa" => {
            let cfg = glm_dsa_config(&args)?;
            let plan = synth::glm_dsa::plan(&cfg, vocab)?;
            print_glm_dsa_plan(&args, &cfg, &plan, &vocab_src);
            plan
        }
        a => anyhow::bail!(
            "--arch '{a}': synth writes qwen3moe, deepseek4, qwen4exp, glm-dsa or glm5next"
        ),
    };
    if args.dry_run {
        return Ok(());
    }

    let cancel = Arc::new(AtomicBool::new(false));
    {
        let cancel = cancel.clone();
        let _ = ctrlc::set_handler(move || cancel.store(true, Ordering::SeqCst));
    }
    let size = plan.file_size();
    let bar = ProgressBar::new(size);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {decimal_bytes_per_sec} elapsed {elapsed} eta {eta}",
        )
        .context("progress bar template")?,
    );
    let t0 = Instant::now();
    // Without a terminal the bar is hidden: print a line every 10 % instead (logs).
    let next_tenth = AtomicU64::new(1);
    let progress = |done: u64| {
        bar.set_position(done);
        if bar.is_hidden() && size > 0 {
            let tenth = next_tenth.load(Ordering::Relaxed);
            if tenth <= 10 && done >= size / 10 * tenth {
                next_tenth.store(tenth + 1, Ordering::Relaxed);
                eprintln!(
                    "  {}0 %: {:.2} GB in {:.1} s ({:.2} GB/s)",
                    tenth,
                    done as f64 / 1e9,
                    t0.elapsed().as_secs_f64(),
                    done as f64 / 1e9 / t0.elapsed().as_secs_f64().max(1e-9)
                );
            }
        }
    };
    let result = synth::write(
        &plan,
        &args.output,
        &WriteOptions {
            force: args.force,
            progress: &progress,
            cancel: &cancel,
        },
    );
    bar.finish_and_clear();
    result?;
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({size} bytes) in {secs:.1} s: {:.2} GB/s",
        args.output.display(),
        size as f64 / secs / 1e9
    );
    Ok(())
}
