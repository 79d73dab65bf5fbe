//! Dense gated feed-forward: `down(act(gate x) * up x)`.

use super::Env;
use crate::ops::{gelu_tanh, silu};
use crate::weights::Mat;
use crate::ModelError;
use rayon::prelude::*;

/// The gate activation of a GLU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// SwiGLU.
    Silu,
    /// GeGLU with the tanh approximation (Gemma).
    GeluTanh,
    /// SwiGLU with the gate and up values clamped to `limit` first (DeepSeek V4:
    /// gate clamped above, up clamped to [-limit, limit]).
    SiluClamped { limit: f32 },
}

impl Activation {
    /// `act(g) * u`.
    #[inline]
    pub fn glu(self, g: f32, u: f32) -> f32 {
        match self {
            Activation::Silu => silu(g) * u,
            Activation::GeluTanh => gelu_tanh(g) * u,
            Activation::SiluClamped { limit } => silu(g.min(limit)) * u.clamp(-limit, limit),
        }
    }
}

/// A dense GLU's weights.
#[derive(Debug, Clone)]
pub struct GluWeights {
    /// `[n_ff, n_embd]`
    pub gate: Mat,
    /// `[n_ff, n_embd]`
    pub up: Mat,
    /// `[n_embd, n_ff]`
    pub down: Mat,
}

/// Dense GLU over `h` (`[T, n_embd]`).
pub fn glu(
    env: &Env<'_>,
    w: &GluWeights,
    act: Activation,
    h: &[f32],
    t_len: usize,
) -> Result<Vec<f32>, ModelError> {
    let mut gu = env.linear_many(&[&w.gate, &w.up], h, t_len)?;
    let u = gu.pop().expect("two outputs");
    let g = gu.pop().expect("two outputs");
    // Element-wise, so splitting over threads never changes a bit.
    let a: Vec<f32> = g
        .par_iter()
        .zip(&u)
        .with_min_len(1 << 14)
        .map(|(&g, &u)| act.glu(g, u))
        .collect();
    env.linear(&w.down, &a, t_len)
}
