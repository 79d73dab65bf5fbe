//! The decoder plans (`Architecture::plan`) are what the CPU runs (`CpuDecoder`): their
//! logits are checked against transformers and llama.cpp by each architecture's oracle
//! tests. Here: what the plan must keep besides the arithmetic (the router-lookahead link).

mod common;

use std::path::{Path, PathBuf};

use common::qwen3moe_tokens;
use sluice_engine::models::plan::PlanFfn;
use sluice_engine::Model;

fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
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
