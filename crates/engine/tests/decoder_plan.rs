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

/// The other learned-router MoE architectures' plans keep the link too (their streamed
/// `--lookahead` runs are checked by `lookahead_decode_equals_resident` in their oracle
/// tests).
#[test]
fn moe_plans_keep_the_router_lookahead_link() {
    for rel in [
        "glm_dsa/a-f32.gguf",
        "glm_dsa/b-f32.gguf",
        "glm5next/a-f32.gguf",
        "glm5next/b-f32.gguf",
        "qwen4exp/a-f32.gguf",
        "qwen4exp/b-f32.gguf",
    ] {
        plan_links_each_moe_layer_to_the_next(&fixture(rel));
    }
}

/// The CPU decoder keeps a sequence's layer state in `SeqState::extra`, as the
/// architectures' own states were: a sequence of a plan with recurrent, windowed or latent
/// state cannot be cut back (a snapshot is restored instead), a plain GQA one can, and
/// after a cut it continues with the bits of a sequence that never went further.
#[test]
fn stateful_plans_refuse_truncation_plain_ones_allow_it() {
    use sluice_engine::Logits;
    let toks: Vec<u32> = (0..12u32).map(|i| (i * 37 + 11) % 200).collect();
    for rel in [
        "glm_dsa/a-f32.gguf",
        "deepseek4/a-f32.gguf",
        "glm5next/a-f32.gguf",
        "qwen4exp/a-f32.gguf",
    ] {
        let m = Model::load(&fixture(rel)).unwrap();
        let mut st = m.new_state(64, false);
        assert!(st.extra.is_some(), "{rel}: the CPU decoder's state");
        m.forward(&mut st, &toks, Logits::None).unwrap();
        assert!(!st.truncate(6), "{rel}: truncation must be refused");
        assert_eq!(st.len(), toks.len(), "{rel}");
    }
    let m = Model::load(&fixture("qwen3moe/a-q8_0.gguf")).unwrap();
    let mut st = m.new_state(64, false);
    assert!(
        st.extra.is_none(),
        "qwen3moe: the KV cache is all its state"
    );
    m.forward(&mut st, &toks, Logits::None).unwrap();
    assert!(st.truncate(6));
    let cut = m.forward(&mut st, &toks[6..9], Logits::All).unwrap();
    let mut fresh = m.new_state(64, false);
    let want = m.forward(&mut fresh, &toks[..9], Logits::All).unwrap();
    let n_vocab = m.cfg.n_vocab;
    assert!(common::same_bits(&cut, &want[6 * n_vocab..]));
}
