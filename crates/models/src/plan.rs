//! A plain decoder's whole forward pass as data, for backends that run it on a device.
//!
//! Owns: [`DecoderPlan`] (every weight of a GQA decoder with dense GLU or softmax-routed
//! MoE feed-forward layers, as ranges of the mapped file, plus the hyper-parameters the
//! CPU blocks use) and [`DeviceForward`], the interface a device backend implements to
//! evaluate a batch with activations, KV cache and routing kept on the device. An
//! architecture that fits this shape (qwen3moe, gemma3) returns a plan from
//! [`crate::arch::Architecture::plan`]; the others run on the CPU blocks.

use crate::blocks::attention::{AttnShape, GqaWeights};
use crate::blocks::ffn::{Activation, GluWeights};
use crate::blocks::{Batch, Env};
use crate::state::SeqState;
use crate::weights::{Mat, Stacked};
use crate::ModelError;

/// Every weight and constant of a plain decoder.
#[derive(Debug, Clone)]
pub struct DecoderPlan {
    pub arch: &'static str,
    pub n_embd: usize,
    pub n_vocab: usize,
    pub shape: AttnShape,
    /// Token embedding table `[n_vocab, n_embd]`, rows multiplied by `embd_scale`.
    pub embd: Mat,
    pub embd_scale: f32,
    pub output_norm: Vec<f32>,
    /// `[n_vocab, n_embd]`
    pub output: Mat,
    pub layers: Vec<PlanLayer>,
}

impl DecoderPlan {
    /// Every matrix the plan holds whole (all but the routed experts), each named for
    /// messages ("token embedding", "layer 3 attention q", "layer 3 router", ...).
    pub fn matrices(&self) -> Vec<(String, &Mat)> {
        let mut out = vec![
            ("token embedding".to_string(), &self.embd),
            ("output".to_string(), &self.output),
        ];
        for (il, l) in self.layers.iter().enumerate() {
            let a = &l.attn;
            for (n, m) in [("q", &a.wq), ("k", &a.wk), ("v", &a.wv), ("o", &a.wo)] {
                out.push((format!("layer {il} attention {n}"), m));
            }
            match &l.ffn {
                PlanFfn::Dense { w, .. } => {
                    for (n, m) in [("gate", &w.gate), ("up", &w.up), ("down", &w.down)] {
                        out.push((format!("layer {il} ffn {n}"), m));
                    }
                }
                PlanFfn::Moe { router_w, .. } => {
                    out.push((format!("layer {il} router"), router_w));
                }
            }
        }
        out
    }
}

/// One block: `x += post_attn(attn(attn_norm(x)))`, then `x += post_ffn(ffn(ffn_norm(x)))`.
#[derive(Debug, Clone)]
pub struct PlanLayer {
    pub attn_norm: Vec<f32>,
    pub attn: GqaWeights,
    /// NEOX RoPE inverse frequencies of this layer.
    pub inv_freq: Vec<f32>,
    /// Sliding window in positions (None = global attention).
    pub window: Option<usize>,
    /// RMS norm applied to the attention output before the residual add (Gemma).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: PlanFfn,
    /// RMS norm applied to the feed-forward output before the residual add (Gemma).
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// The feed-forward half of a block.
#[derive(Debug, Clone)]
pub enum PlanFfn {
    Dense {
        w: GluWeights,
        act: Activation,
    },
    /// Softmax router over `n_expert` GLU experts, top-`k`, weights renormalised if
    /// `norm` (qwen3moe's `Router::Softmax`).
    Moe {
        router_w: Mat,
        norm: bool,
        n_expert: usize,
        k: usize,
        /// Stacked gate, up, down (units' parts 0, 1, 2 of the streamable group).
        experts: [Stacked; 3],
        act: Activation,
    },
}

/// A backend that evaluates a [`DecoderPlan`] on its device (the plan is given when the
/// backend is built). Keeps whatever per-sequence state it needs in `state.device`.
pub trait DeviceForward: Send + Sync {
    /// Evaluate `batch` (positions continuing `state`), update the sequence's state (the
    /// caller advances its length) and return the logits of `rows`
    /// (`[rows.len(), n_vocab]`), as [`crate::arch::Architecture::forward`] does.
    fn forward(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        state: &mut SeqState,
        rows: &[usize],
    ) -> Result<Vec<f32>, ModelError>;

    /// Short name for start-up lines and statistics.
    fn name(&self) -> &'static str;
}

/// A [`DecoderPlan`] evaluated with the CPU blocks: the same operations in the same order
/// as the architectures' own forward passes, so its logits equal theirs bit for bit when
/// the plan describes the model faithfully (the test that a device backend is handed the
/// right weights, norms, RoPE tables and windows). Also a reference for device backends.
pub struct PlanOnCpu(pub DecoderPlan);

impl DeviceForward for PlanOnCpu {
    fn forward(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        state: &mut SeqState,
        rows: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        use crate::blocks::attention::gqa;
        use crate::blocks::moe::{routed, MoeWeights, Router, UnitMat};
        use crate::blocks::{add_into, check_finite, ffn, head, rms_norm_rows, Stage};
        let p = &self.0;
        let eps = p.shape.rms_eps;
        let e = p.n_embd;
        let mut x = head::embed(env, &p.embd, batch, p.embd_scale)?;
        check_finite(&x, e, &batch.positions, Stage::Embedding)?;
        for (il, l) in p.layers.iter().enumerate() {
            let mut h = x.clone();
            rms_norm_rows(&mut h, &l.attn_norm, eps);
            let mut o = gqa(
                env,
                batch,
                &mut state.kv,
                il,
                &l.attn,
                &p.shape,
                &l.inv_freq,
                l.window,
                &h,
            )?;
            if let Some(w) = &l.post_attn_norm {
                rms_norm_rows(&mut o, w, eps);
            }
            add_into(&mut x, &o);
            let mut h = x.clone();
            rms_norm_rows(&mut h, &l.ffn_norm, eps);
            let mut f = match &l.ffn {
                PlanFfn::Dense { w, act } => ffn::glu(env, w, *act, &h, batch.len())?,
                PlanFfn::Moe {
                    router_w,
                    norm,
                    n_expert,
                    k,
                    experts,
                    act,
                } => {
                    let um = |s: &Stacked| UnitMat {
                        ty: s.ty,
                        rows: s.rows,
                        cols: s.cols,
                    };
                    let w = MoeWeights {
                        router_w: router_w.clone(),
                        router: Router::Softmax { norm: *norm },
                        n_expert: *n_expert,
                        k: *k,
                        gate: um(&experts[0]),
                        up: um(&experts[1]),
                        down: um(&experts[2]),
                        act: *act,
                        next: None,
                    };
                    routed(env, batch, il, &w, &h)?
                }
            };
            if let Some(w) = &l.post_ffn_norm {
                rms_norm_rows(&mut f, w, eps);
            }
            add_into(&mut x, &f);
            check_finite(&x, e, &batch.positions, Stage::Layer(il))?;
        }
        let logits = head::logits(env, &x, rows, &p.output_norm, eps, &p.output)?;
        head::check_logits(&logits, rows, batch)?;
        Ok(logits)
    }

    fn name(&self) -> &'static str {
        "plan-on-cpu"
    }
}
