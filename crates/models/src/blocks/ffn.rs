//! Dense gated feed-forward: `down(act(gate x) * up x)`.

use super::Env;
use crate::ops::{gelu_tanh, silu};
use crate::weights::{Mat, Tensors};
use crate::ModelError;

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

impl GluWeights {
    /// Layer `il`'s `blk.{il}.ffn_{gate,up,down}{suffix}.weight` over `n_embd` inputs
    /// (`suffix` "" for a dense feed-forward, "_shexp" for a shared expert): `ff` rows
    /// when given, else as many as the gate has.
    pub fn load(
        t: &Tensors<'_>,
        il: usize,
        suffix: &str,
        n_embd: usize,
        ff: Option<usize>,
    ) -> Result<GluWeights, ModelError> {
        let n = |p: &str| format!("blk.{il}.{p}{suffix}.weight");
        let gate = match ff {
            Some(ff) => t.mat(&n("ffn_gate"), ff, n_embd)?,
            None => t.mat_any_rows(&n("ffn_gate"), n_embd)?,
        };
        let ff = gate.rows;
        Ok(GluWeights {
            up: t.mat(&n("ffn_up"), ff, n_embd)?,
            down: t.mat(&n("ffn_down"), n_embd, ff)?,
            gate,
        })
    }
}

/// Dense GLU over `h` (`[T, n_embd]`).
pub fn glu(
    env: &Env<'_>,
    w: &GluWeights,
    act: Activation,
    h: &[f32],
    t_len: usize,
) -> Result<Vec<f32>, ModelError> {
    let [mut a, u] = env.linear_many([&w.gate, &w.up], h, t_len)?;
    // Element-wise, in place over the gate values, on the compute pool: splitting never
    // changes a bit. One loop per activation so each is a plain vectorisable loop.
    const CHUNK: usize = 4096;
    crate::threads::for_each_chunk(&mut a, CHUNK, 4, |i, gs| {
        let us = &u[i * CHUNK..i * CHUNK + gs.len()];
        match act {
            Activation::Silu => act_loop(gs, us, |g, u| silu(g) * u),
            // Same operations as the scalar loop, in vector registers of the CPU's tier.
            Activation::GeluTanh => {
                sluice_kernels::act::geglu(gs, us).expect("chunks of equal length")
            }
            Activation::SiluClamped { limit } => {
                act_loop(gs, us, |g, u| silu(g.min(limit)) * u.clamp(-limit, limit))
            }
        }
    });
    super::give_buf(u);
    let y = env.linear(&w.down, &a, t_len);
    super::give_buf(a);
    y
}

/// `g[i] = f(g[i], u[i])` for every element.
#[inline(always)]
fn act_loop(g: &mut [f32], u: &[f32], f: impl Fn(f32, f32) -> f32) {
    for (g, &u) in g.iter_mut().zip(u) {
        *g = f(*g, u);
    }
}
