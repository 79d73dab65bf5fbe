//! The architectures sluice runs, one module each, and their registry.
//!
//! An architecture owns its metadata keys, its tensor names, its streamable groups, its
//! certain units and its [`crate::plan::DecoderPlan`] (the layers as data, run on the CPU by
//! [`crate::decoder::CpuDecoder`]); it has no forward loop of its own. Adding one: write
//! `arch/<name>.rs` with a `load` function returning a `Box<dyn Architecture>`, add
//! `pub mod <name>;` and one line to [`REGISTRY`].

pub mod deepseek4;
pub mod gemma3;
pub mod glm5next;
pub mod glm_dsa;
pub mod qwen3moe;
pub mod qwen4exp;

use sluice_gguf::GgufFile;
use sluice_io::MappedFile;
use sluice_tier::StreamableGroups;

use crate::config::ModelConfig;
use crate::state::SeqState;
use crate::ModelError;

/// A loaded architecture: its configuration, its weights (ranges of the mapped file), its
/// streamable groups and its forward pass as a plan.
pub trait Architecture: Send + Sync {
    /// What the rest of the engine needs to know about the model.
    fn config(&self) -> &ModelConfig;

    /// Every tensor group that may live outside RAM (routed experts, row tables).
    fn groups(&self) -> StreamableGroups;

    /// Read the row table `name` (one of `groups().row_tables`) through `src`; false if
    /// the architecture has no such table.
    fn set_row_source(
        &mut self,
        _name: &str,
        _src: std::sync::Arc<dyn sluice_tier::PleSource>,
    ) -> bool {
        false
    }

    /// A fresh per-sequence state for up to `n_ctx` positions (already capped at the
    /// trained context by the caller).
    fn new_state(&self, n_ctx: usize) -> SeqState;

    /// Routed units certain to be needed for `tokens`, known before any layer runs (e.g.
    /// hash-routed layers, whose experts follow from the token ids): (layer, sorted unit
    /// ids) in layer order. None for learned routers (the default).
    fn certain_units(&self, _tokens: &[u32]) -> Vec<(usize, Vec<usize>)> {
        Vec::new()
    }

    /// The whole forward pass as data (weights, norms, RoPE tables, the router-lookahead
    /// links): the one description of the model, which the CPU decoder
    /// ([`crate::decoder::CpuDecoder`]) and a device backend run.
    fn plan(&self) -> crate::plan::DecoderPlan;
}

/// Builds an architecture from a parsed header and the mapped file.
pub type LoadFn = fn(&GgufFile, &MappedFile) -> Result<Box<dyn Architecture>, ModelError>;

/// `general.architecture` name -> loader. One line per architecture.
pub const REGISTRY: &[(&str, LoadFn)] = &[
    ("qwen3moe", qwen3moe::load),
    ("gemma3", gemma3::load),
    ("deepseek4", deepseek4::load),
    ("qwen4exp", qwen4exp::load),
    ("glm-dsa", glm_dsa::load),
    ("glm5-next", glm5next::load),
    ("glm5next", glm5next::load),
];

/// Names of every registered architecture.
pub fn known() -> Vec<&'static str> {
    REGISTRY.iter().map(|(n, _)| *n).collect()
}

/// The loader for `name`, if registered.
pub fn find(name: &str) -> Option<LoadFn> {
    REGISTRY.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// The hyper-parameters every GQA transformer reads the same way (`<arch>.*` keys with
/// llama.cpp's defaults), checked.
pub(crate) struct GqaHparams {
    pub n_embd: usize,
    pub n_layer: usize,
    pub shape: crate::blocks::attention::AttnShape,
    pub rope_base: f32,
    /// Linear RoPE position scale (1.0 = none).
    pub rope_scale: f32,
}

impl GqaHparams {
    pub fn read(hp: &crate::config::Hparams<'_>) -> Result<GqaHparams, ModelError> {
        let n_embd = hp.u("embedding_length")?;
        let n_head = hp.u("attention.head_count")?;
        let n_head_kv = hp.u_or("attention.head_count_kv", n_head)?;
        let head_dim = hp.u_or("attention.key_length", n_embd / n_head.max(1))?;
        let head_dim_v = hp.u_or("attention.value_length", head_dim)?;
        let n_layer = hp.block_count()?;
        let rms_eps = hp.f_or("attention.layer_norm_rms_epsilon", 1e-6)?;
        let rope_base = hp.f_or("rope.freq_base", 10_000.0)?;
        let rope_scale = hp.rope_linear_scale()?;
        if n_embd == 0 {
            return Err(hp.bad("embedding_length must be > 0".into()));
        }
        check_attention(hp, n_head, n_head_kv, head_dim, rms_eps, rope_base)?;
        // The blocks rotate the whole head (NEOX pairs i and i + head_dim / 2).
        let n_rot = hp.u_or("rope.dimension_count", head_dim)?;
        if n_rot != head_dim {
            return Err(hp.bad(format!(
                "{}.rope.dimension_count is {n_rot}; {} rotates the whole head (key_length {head_dim})",
                hp.arch, hp.arch
            )));
        }
        Ok(GqaHparams {
            n_embd,
            n_layer,
            shape: crate::blocks::attention::AttnShape {
                n_head,
                n_head_kv,
                head_dim,
                head_dim_v,
                scale: 1.0 / (head_dim as f32).sqrt(),
                rms_eps,
            },
            rope_base,
            rope_scale,
        })
    }

    /// KV-cache bytes per position at f32, all layers.
    pub fn kv_bytes_per_pos(&self) -> u64 {
        let s = &self.shape;
        // Saturating: the sizes are bounded one by one, not their product.
        [s.n_head_kv, s.head_dim + s.head_dim_v, 4]
            .iter()
            .fold(self.n_layer as u64, |a, &b| a.saturating_mul(b as u64))
    }
}

/// Checks shared by attention architectures: head counts and dimensions that the blocks
/// rely on, and finite positive epsilon / RoPE base.
pub(crate) fn check_attention(
    hp: &crate::config::Hparams<'_>,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    rms_eps: f32,
    rope_base: f32,
) -> Result<(), ModelError> {
    if n_head == 0 || n_head_kv == 0 {
        return Err(hp.bad("head counts must be > 0".into()));
    }
    if !n_head.is_multiple_of(n_head_kv) {
        return Err(hp.bad(format!(
            "head_count {n_head} is not a multiple of head_count_kv {n_head_kv}"
        )));
    }
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(hp.bad(format!("key_length {head_dim} must be even and > 0")));
    }
    if rms_eps.is_nan() || rms_eps < 0.0 {
        return Err(hp.bad(format!(
            "attention.layer_norm_rms_epsilon is {rms_eps}; it must be a finite number >= 0"
        )));
    }
    if rope_base.is_nan() || rope_base <= 0.0 {
        return Err(hp.bad(format!(
            "rope.freq_base is {rope_base}; it must be a finite number > 0"
        )));
    }
    Ok(())
}
