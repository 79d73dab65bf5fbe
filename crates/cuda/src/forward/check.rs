//! What the GPU decoder refuses in the blocks of Qwen3.8-Flash-Next (low-rank mixers, PLE,
//! the shared expert's gate, Gated DeltaNet, QSA) and GLM-5.3-Flash (KDA, pooled attention),
//! layer by layer in the order the checks always ran: each block's own check is in its
//! file under `blocks/`. `GpuDecoder::check` calls both.

use sluice_models::plan::{DecoderPlan, PlanAttn};

use crate::blocks::{deltanet, hyper_lowrank, kda, mla_pooled, moe, ple, qsa};

/// The shapes these kernels assume, for `GpuDecoder::check` (the reason when not). `smem`:
/// the dynamic shared memory a block may have.
pub(crate) fn qwen4exp_parts(plan: &DecoderPlan, smem: usize) -> Result<(), String> {
    hyper_lowrank::check_head(plan)?;
    for (il, l) in plan.layers.iter().enumerate() {
        hyper_lowrank::check_layer(plan, il, l)?;
        if let Some(w) = &l.ple {
            ple::check_layer(plan, il, w)?;
        }
        moe::check_shared_gate(plan, il, l)?;
        match &l.attn {
            PlanAttn::Delta { w, shape } => deltanet::check_layer(plan, il, w, shape, smem)?,
            PlanAttn::Qsa { w, shape, inv_freq } => qsa::check_layer(plan, il, w, shape, inv_freq)?,
            _ => {}
        }
    }
    Ok(())
}

/// The shapes these kernels assume, for `GpuDecoder::check` (the reason when not).
pub(crate) fn glm5next_parts(plan: &DecoderPlan, smem: usize) -> Result<(), String> {
    let first = plan.layers.iter().find_map(|l| match &l.attn {
        PlanAttn::Pooled { shape, .. } => Some(*shape),
        _ => None,
    });
    for (il, l) in plan.layers.iter().enumerate() {
        mla_pooled::check_alone(il, l, first)?;
        match &l.attn {
            PlanAttn::Kda { w, shape } => kda::check_layer(plan, il, w, shape, smem)?,
            PlanAttn::Pooled { w, shape } => mla_pooled::check_layer(plan, il, w, shape, first)?,
            _ => {}
        }
    }
    Ok(())
}
