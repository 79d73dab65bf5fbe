//! The decoder plans device backends run (`Architecture::plan`) describe their models:
//! the plan evaluated with the CPU blocks (`PlanOnCpu`) gives the architecture's own
//! forward pass bit for bit, for qwen3moe, glm-dsa, deepseek4 and glm5next (tiny
//! transformers fixtures; glm-dsa up to its indexer's top-k positions, where the plan stops) and the
//! real Gemma 3 270M
//! (`SLUICE_GEMMA`; skipped with a note if unset). A plan that dropped a norm, used the
//! wrong RoPE table or window, the wrong router normalisation or bias, or lost the shared
//! expert would change bits.

mod common;

use std::path::{Path, PathBuf};

use common::{ids, manifest_in, qwen3moe_tokens, same_bits};
use sluice_engine::models::decoder::CpuDecoder;
use sluice_engine::models::plan::{PlanAttn, PlanFfn};
use sluice_engine::{Logits, Model};

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

/// Every position's logits for `toks` in chunks of `batch`, through the plan or not.
fn logits(path: &Path, toks: &[u32], batch: usize, through_plan: bool) -> Vec<f32> {
    let mut m = Model::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if through_plan {
        let plan = m
            .plan()
            .unwrap_or_else(|| panic!("{}: no decoder plan", path.display()));
        m.set_device_forward(Box::new(CpuDecoder::new(plan)));
        assert_eq!(m.device_forward(), Some("plan-on-cpu"));
    }
    let mut st = m.new_state(toks.len() + 4, false);
    let mut out = Vec::new();
    for c in toks.chunks(batch) {
        out.extend(m.forward(&mut st, c, Logits::All).unwrap());
    }
    out
}

/// The plan's logits are the architecture's bits for `toks` in chunks of each of
/// `batches`.
fn plan_gives_the_bits(path: &Path, toks: &[u32], batches: &[usize]) {
    for &batch in batches {
        let arch = logits(path, toks, batch, false);
        let through = logits(path, toks, batch, true);
        assert!(!arch.is_empty());
        assert!(
            same_bits(&arch, &through),
            "{}, batch {batch}: the plan's logits differ from the architecture's",
            path.display()
        );
    }
}

/// The MoE layers of a plan keep the router-lookahead link the architecture made at load
/// (each MoE layer names the next one's router; the last none): the CPU decoder runs the
/// plan, so without the link `--lookahead` would silently read nothing ahead.
fn plan_links_each_moe_layer_to_the_next(path: &Path) {
    let m = Model::load(path).unwrap();
    let plan = m.plan().expect("a decoder plan");
    let moe: Vec<usize> = (0..plan.layers.len())
        .filter(|&il| matches!(plan.layers[il].ffn, PlanFfn::Moe { .. }))
        .collect();
    assert!(moe.len() > 1, "{}: MoE layers", path.display());
    let links: Vec<Option<usize>> = moe
        .iter()
        .map(|&il| match &plan.layers[il].ffn {
            PlanFfn::Moe { moe, .. } => moe.next.as_ref().map(|n| n.layer),
            PlanFfn::Dense { .. } => None,
        })
        .collect();
    let want: Vec<Option<usize>> = (0..moe.len()).map(|i| moe.get(i + 1).copied()).collect();
    assert_eq!(links, want, "{}: lookahead links", path.display());
}

/// qwen3moe runs through its plan on the CPU: the plan keeps the lookahead link, and
/// decoding token by token with `--lookahead` streamed gives the resident bits and really
/// reads ahead (on `a`, whose 8 experts do not all fit the evicting budget; `b`'s 4 do, so
/// nothing is left to read ahead there).
#[test]
fn qwen3moe_plan_keeps_the_router_lookahead() {
    let toks = qwen3moe_tokens();
    for name in ["a-q8_0.gguf", "b-f32.gguf"] {
        plan_links_each_moe_layer_to_the_next(&fixture(&format!("qwen3moe/{name}")));
    }
    let path = fixture("qwen3moe/a-q8_0.gguf");
    let run = |m: &Model| common::logits_all(m, &toks, 64, false, 3, 4, 2);
    let want = run(&Model::load(&path).unwrap());
    let issued = common::check_lookahead(&path, &want, &run);
    assert!(issued > 0, "a-q8_0: no lookahead read issued");
}

/// Qwen3.8-Flash-Next as a plan (low-rank hyper-connection mixers in place of the norms,
/// Gated DeltaNet and QSA layers, softmax MoE with a sigmoid-gated shared expert, the hashed
/// n-gram PLE layer): the same bits as the architecture at every chunking, on the three
/// fixtures and the one whose compress ratios are written, over the long prompt.
#[test]
fn qwen4exp_plan_gives_the_architectures_bits() {
    let toks = ids(&manifest_in("qwen4exp")["prompts"]["long"]);
    for name in [
        "a-f32.gguf",
        "b-f32.gguf",
        "c-f32.gguf",
        "a-ratios-f32.gguf",
    ] {
        let path = fixture(&format!("qwen4exp/{name}"));
        let m = Model::load(&path).unwrap();
        let plan = m.plan().expect("qwen4exp has a decoder plan");
        assert!(
            plan.lowrank.is_some()
                && plan
                    .layers
                    .iter()
                    .any(|l| matches!(l.attn, PlanAttn::Delta { .. }))
                && plan
                    .layers
                    .iter()
                    .any(|l| matches!(l.attn, PlanAttn::Qsa { .. })),
            "{name}"
        );
        plan_gives_the_bits(&path, &toks, &[toks.len(), 5]);
    }
}
