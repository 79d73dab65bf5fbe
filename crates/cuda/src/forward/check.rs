//! What the GPU decoder refuses in the parts of Qwen3.8-Flash-Next (low-rank mixers, PLE,
//! the shared expert's gate, Gated DeltaNet, QSA) and GLM-5.3-Flash (KDA, pooled attention),
//! and why: the shapes their kernels assume. `GpuDecoder::check` calls both.

use sluice_models::blocks::hyper_lowrank::HcWeights;
use sluice_models::blocks::mla_pooled::PooledShape;
use sluice_models::plan::{DecoderPlan, PlanAttn, PlanFfn};

use crate::blocks::deltanet::{gdn_smem, DV_MAX};
use crate::blocks::dsa_indexer::IDX_MAX_Q;
use crate::blocks::kda::delta_shape;
use crate::kernel_format;

/// The shapes these kernels assume, for `GpuDecoder::check` (the reason when not). `smem`:
/// the dynamic shared memory a block may have.
pub(crate) fn qwen4exp_parts(plan: &DecoderPlan, smem: usize) -> Result<(), String> {
    let e = plan.n_embd;
    let s = plan.lowrank.as_ref().map_or(1, |lr| lr.n_stream);
    if s == 0 {
        return Err("low-rank hyper-connections of 0 streams".into());
    }
    let d = s * e;
    let mix_ok = |w: &HcWeights, inject: bool| {
        let r = w.down.rows;
        r > 0
            && w.norm.len() == d
            && (w.down.cols, w.up.rows, w.up.cols) == (d, d, r)
            && match &w.inject {
                Some(m) => (m.rows, m.cols) == (s, d),
                None => !inject,
            }
    };
    if let Some(lr) = &plan.lowrank {
        if !mix_ok(&lr.head, false) {
            return Err("the output low-rank mixer's shapes do not match the streams".into());
        }
    }
    for (il, l) in plan.layers.iter().enumerate() {
        // The mixers normalise: the kernels apply no norm beside them.
        let norms = !l.attn_norm.is_empty()
            || !l.ffn_norm.is_empty()
            || l.post_attn_norm.is_some()
            || l.post_ffn_norm.is_some();
        if plan.lowrank.is_some() && norms {
            return Err(format!(
                "layer {il}: norms beside low-rank mixers have no GPU kernel"
            ));
        }
        match (&l.hc_lowrank, &plan.lowrank) {
            (Some(w), Some(_)) if w.iter().all(|w| mix_ok(w, true)) => {}
            (None, None) => {}
            (Some(_), Some(_)) => {
                return Err(format!(
                    "layer {il}: low-rank mixers of the wrong shape or without injection weights"
                ))
            }
            _ => {
                return Err(format!(
                    "layer {il}: low-rank mixers do not match the plan's residual"
                ))
            }
        }
        if let Some(w) = &l.ple {
            let Some(pp) = &plan.ple else {
                return Err(format!("layer {il}: a PLE layer without the plan's hash"));
            };
            let heads = pp.hash.n_heads();
            let width = heads * (e / heads.max(1));
            let ok = heads > 0
                && w.kernel > 0
                && w.dilation > 0
                && (w.key.rows, w.key.cols, w.value.rows, w.value.cols) == (d, width, e, width)
                && w.norm_key.len() == d
                && w.norm_query.len() == d
                && w.norm_conv.len() == d
                && w.conv.len() == d * w.kernel;
            if !ok {
                return Err(format!(
                    "layer {il}: PLE layer shapes do not match the streams"
                ));
            }
        }
        if let PlanFfn::Moe {
            shared: Some(sh), ..
        } = &l.ffn
        {
            if let Some(g) = &sh.gate {
                if (g.rows, g.cols) != (1, e) {
                    return Err(format!(
                        "layer {il}: a shared expert gate of {} x {}",
                        g.rows, g.cols
                    ));
                }
            }
        }
        match &l.attn {
            PlanAttn::Delta { w, shape: sh } => {
                let (hv, dk, dv) = (sh.n_v_heads, sh.d_k, sh.d_v);
                let cd = sh.conv_dim();
                let ok = sh.n_k_heads > 0
                    && hv > 0
                    && dk > 0
                    && dv > 0
                    && dv <= DV_MAX
                    && gdn_smem(sh) <= smem
                    && sh.conv_kernel > 0
                    && (w.qkv.rows, w.gate.rows, w.beta.rows, w.alpha.rows)
                        == (cd, hv * dv, hv, hv)
                    && (w.out.rows, w.out.cols) == (e, hv * dv)
                    && w.conv.len() == cd * sh.conv_kernel
                    && (w.dt_bias.len(), w.a.len(), w.norm.len()) == (hv, hv, dv);
                if !ok {
                    return Err(format!(
                        "layer {il}: a Gated DeltaNet of {} key / {hv} value heads of {dk} x {dv} the kernels do not take (values up to {}, the state within {smem} bytes of shared memory)",
                        sh.n_k_heads,
                        DV_MAX
                    ));
                }
            }
            PlanAttn::Qsa {
                w,
                shape: sh,
                inv_freq,
            } => {
                let a = &plan.shape;
                let (nh, hd, id) = (sh.n_head, sh.head_dim, sh.idx_dim);
                let ok = (nh, sh.n_head_kv, hd, hd)
                    == (a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v)
                    && sh.n_rot.is_multiple_of(2)
                    && sh.n_rot <= hd
                    && inv_freq.len() == sh.n_rot / 2
                    && (w.wq.rows, w.wk.rows, w.wv.rows)
                        == (nh * 2 * hd, sh.n_head_kv * hd, sh.n_head_kv * hd)
                    && (w.wo.rows, w.wo.cols) == (e, nh * hd)
                    && (w.q_norm.len(), w.k_norm.len()) == (hd, hd)
                    && (sh.ratio == 0
                        || (sh.idx_heads > 0
                            && sh.idx_heads * id <= IDX_MAX_Q
                            && sh.n_rot <= id
                            && sh.budget >= sh.ratio
                            && sh.budget.is_multiple_of(sh.ratio)
                            && (w.idx_q.rows, w.idx_k.rows) == (sh.idx_heads * id, id)
                            && (w.idx_q_norm.len(), w.idx_k_norm.len()) == (id, id)));
                if !ok {
                    return Err(format!(
                        "layer {il}: a QSA layer of {nh} heads of {hd} (rotating {}, indexer {} x {id}, ratio {}, budget {}) the kernels do not take",
                        sh.n_rot, sh.idx_heads, sh.ratio, sh.budget
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The shapes these kernels assume, for `GpuDecoder::check` (the reason when not).
pub(crate) fn glm5next_parts(plan: &DecoderPlan, smem: usize) -> Result<(), String> {
    let e = plan.n_embd;
    let first = plan.layers.iter().find_map(|l| match &l.attn {
        PlanAttn::Pooled { shape, .. } => Some(*shape),
        _ => None,
    });
    for (il, l) in plan.layers.iter().enumerate() {
        // The kernels' attention shape is the pooled layers' absorbed view for the whole
        // decoder: no other attention beside them.
        if first.is_some()
            && matches!(
                l.attn,
                PlanAttn::Gqa { .. }
                    | PlanAttn::Mla { .. }
                    | PlanAttn::Qsa { .. }
                    | PlanAttn::Dsv4 { .. }
            )
        {
            return Err(format!(
                "layer {il}: pooled latent attention mixed with other attention"
            ));
        }
        match &l.attn {
            PlanAttn::Kda { w, shape: s } => {
                let (h, d) = (s.n_head, s.head_dim);
                let inner = s.inner();
                let delta = delta_shape(s);
                let ok = h > 0
                    && d > 0
                    && d <= DV_MAX
                    && gdn_smem(&delta) <= smem
                    && s.conv_kernel > 0
                    && (w.q.rows, w.k.rows, w.v.rows) == (inner, inner, inner)
                    && (w.f_a.rows, w.g_a.rows) == (d, d)
                    && (w.f_b.rows, w.f_b.cols, w.g_b.rows, w.g_b.cols) == (inner, d, inner, d)
                    && w.beta.rows == h
                    && (w.out.rows, w.out.cols) == (e, inner)
                    && [&w.conv_q, &w.conv_k, &w.conv_v]
                        .iter()
                        .all(|c| c.len() == inner * s.conv_kernel)
                    && (w.dt_bias.len(), w.a.len(), w.norm.len()) == (inner, h, d);
                if !ok {
                    return Err(format!(
                        "layer {il}: a Kimi delta attention of {h} heads of {d} the kernels do not take (heads up to {}, the state within {smem} bytes of shared memory)",
                        DV_MAX
                    ));
                }
            }
            PlanAttn::Pooled { w, shape: s } => {
                let dims = |s: &PooledShape| (s.n_head, s.q_lora, s.kv_lora, s.head_k, s.head_v);
                // (The kernels take the plan's attention shape as the absorbed view.)
                let a = &plan.shape;
                let ok = first.as_ref().map(dims) == Some(dims(s))
                    && (a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v)
                        == (s.n_head, 1, s.kv_lora, s.kv_lora)
                    && s.n_head > 0
                    && s.kv_lora <= super::MAX_HEAD_DIM_V
                    && (w.q_a.rows, w.q_b.rows, w.q_b.cols)
                        == (s.q_lora, s.n_head * s.head_k, s.q_lora)
                    && (w.q_a_norm.len(), w.kv_a.rows, w.kv_a_norm.len())
                        == (s.q_lora, s.kv_lora, s.kv_lora)
                    && (w.k_b.n_expert, w.k_b.rows, w.k_b.cols) == (s.n_head, s.kv_lora, s.head_k)
                    && (w.v_b.n_expert, w.v_b.rows, w.v_b.cols) == (s.n_head, s.head_v, s.kv_lora)
                    && (w.out.rows, w.out.cols) == (e, s.n_head * s.head_v);
                if !ok {
                    return Err(format!(
                        "layer {il}: pooled latent attention of {} heads (kv_lora {}, keys {}, values {}) the kernels do not take, or unlike the first pooled layer's",
                        s.n_head, s.kv_lora, s.head_k, s.head_v
                    ));
                }
                let kernel = |ty: sluice_kernels::GgmlType, cols: usize, what: &str| {
                    kernel_format(ty, cols)
                        .map(|_| ())
                        .ok_or_else(|| format!("layer {il} attention {what}: {ty:?} with {cols} columns has no GPU kernel"))
                };
                kernel(w.k_b.ty, w.k_b.cols, "k_b")?;
                kernel(w.v_b.ty, w.v_b.cols, "v_b")?;
                if let Some(ix) = &w.indexer {
                    let (ih, id, kp) = (s.idx_heads, s.idx_dim, s.kpool);
                    let ok = ih > 0
                        && ih * id <= IDX_MAX_Q
                        && kp > 0
                        && s.top_k >= kp
                        && (ix.q_b.rows, ix.q_b.cols) == (ih * id, s.q_lora)
                        && (ix.k.rows, ix.gate.rows, ix.proj.rows) == (id, id, ih)
                        && (ix.k_norm.len(), ix.k_norm_b.len(), ix.ape.len()) == (id, id, kp * id);
                    if !ok {
                        return Err(format!(
                            "layer {il}: a k-pool indexer of {ih} heads of {id} (pools of {kp}, top {}) the kernels do not take",
                            s.top_k
                        ));
                    }
                } else if !plan.layers[..il]
                    .iter()
                    .any(|l| matches!(&l.attn, PlanAttn::Pooled { w, .. } if w.indexer.is_some()))
                {
                    return Err(format!(
                        "layer {il}: a shared pooled layer before any layer with its indexer"
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(())
}
