//! Hyper-connections on the GPU (the CPU's `sluice_models::blocks::hyper`): DeepSeek V4's
//! and GLM-5.3-Flash's residual streams.
//!
//! Owns: [`DHc`] (one mix's projection in column segments, its bias and scales; uploaded by
//! `Uploader::hc`), what the kernels take ([`HC_MAX`] streams, [`hc_segments`]), and the
//! launches: [`GpuDecoder::hc_mix`] (the streams' RMS norm, the projection, `hc_pre`:
//! Sinkhorn and the collapsed input), [`GpuDecoder::hc_post`] (the streams' update) and
//! [`GpuDecoder::stream_mean`] (the head's mean of the streams).

use sluice_kernels::GgmlType;
use sluice_models::blocks::hyper::HcShape;
use sluice_models::plan::{DecoderPlan, HyperHead};
use sluice_models::ModelError;

use crate::forward::products::MVT_STEP;
use crate::forward::scratch::Rows;
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// One hyper-connection mix in VRAM: the projection of the normalised streams, its bias
/// and scales.
pub(crate) struct DHc {
    /// The projection's `nseg` column segments, each its own `[n_out, cols / nseg]` matrix
    /// (re-laid out at upload; one pointer-table entry each): a decode step's projection is
    /// spread over `nseg` times the blocks, and a segment's sums do not depend on the
    /// chunk, so neither do their sum's bits (`hc_pre` adds them in segment order).
    pub(crate) proj: DMat,
    pub(crate) nseg: usize,
    pub(crate) base: u64,
    pub(crate) scale: u64,
}

/// Most residual streams, widest compressed row, most indexer query values and widest
/// DeepSeek V4 head the kernels take (`HC_MAX`, `2 * DSV4_PAIRS * 256`, `IDX_MAX_Q`,
/// `ATT_MAX_V` of forward.cu).
pub(crate) const HC_MAX: usize = 8;

/// Column segments a hyper-connection projection of `cols` columns of `ty` is split into:
/// the most of 32, 16, .. 2 whose segments are whole multiples of the decode kernel's step
/// (MVT_STEP columns) and of the format's blocks; 1 (no split) otherwise.
pub(crate) fn hc_segments(ty: GgmlType, cols: usize) -> usize {
    let Some(row) = ty.row_bytes(cols as u64) else {
        return 1;
    };
    [32, 16, 8, 4, 2]
        .into_iter()
        .find(|&n| {
            cols.is_multiple_of(n)
                && (cols / n).is_multiple_of(MVT_STEP)
                && ty.row_bytes((cols / n) as u64).map(|b| b * n as u64) == Some(row)
        })
        .unwrap_or(1)
}

impl Uploader<'_> {
    /// Upload a hyper-connection mix, its projection in `nseg` column segments ([`DHc`];
    /// [`hc_segments`] of it or fewer).
    pub(crate) fn hc(
        &mut self,
        w: &sluice_models::blocks::hyper::HcWeights,
        nseg: usize,
    ) -> Result<DHc, String> {
        Ok(DHc {
            proj: self.segments(&w.proj, nseg)?,
            nseg,
            base: self.norm(&w.base)?,
            scale: self.norm(&w.scale)?,
        })
    }
}

impl GpuDecoder {
    /// The mix `w` of every token's hyper-connection streams `x` (`[n][hc][e]`): their
    /// unweighted RMS norm into `hcf`, its projection's column segments into `hcm` (through
    /// the per-segment chunk table `segs`), then `hc_pre`: the collapsed input into `h`
    /// (RMS-normed with `norm` unless 0) and, when `pc` is not 0, post and comb into it for
    /// [`Self::hc_post`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn hc_mix(
        &self,
        w: &DHc,
        hs: &HcShape,
        x: u64,
        bufs: (u64, u64),
        pc: u64,
        norm: u64,
        h: u64,
        n: usize,
        segs: Rows,
        eps: f32,
    ) -> Result<(), ModelError> {
        let (hcf, hcm) = bufs;
        let width = hs.n_hc * hs.n_embd;
        self.rms_norm(x, 0, hcf, 0, n, width, hs.rms_eps)?;
        self.mv_rows(&[(&w.proj, hcm)], segs, hcf)?;
        kernels::HcPre {
            m: hcm,
            base: w.base,
            scale: w.scale,
            x,
            pc,
            norm,
            h,
            hc: hs.n_hc as i32,
            e: i32_of(hs.n_embd, "n_embd")?,
            iters: i32_of(hs.sinkhorn_iters, "Sinkhorn iterations")?,
            nseg: w.nseg as i32,
            eps: hs.eps,
            rms_eps: eps,
        }
        .launch(self, (n as u32, 1, 1))
    }

    /// `x[t][dst] = post[dst] y[t] + sum_src comb[src][dst] x[t][src]` (`pc` from
    /// [`Self::hc_mix`]).
    pub(crate) fn hc_post(
        &self,
        hs: &HcShape,
        x: u64,
        y: u64,
        pc: u64,
        n: usize,
    ) -> Result<(), ModelError> {
        kernels::HcPost {
            x,
            y,
            pc,
            hc: hs.n_hc as i32,
            e: i32_of(hs.n_embd, "n_embd")?,
        }
        .launch(self, (n as u32, hs.n_embd.div_ceil(256) as u32, 1))
    }

    /// The streams' mean (`[n][s][e]` -> `[n][e]`).
    pub(crate) fn stream_mean(&self, x: u64, h: u64, s: usize, n: usize) -> Result<(), ModelError> {
        let e = self.plan.n_embd;
        kernels::StreamMean {
            x,
            h,
            e: i32_of(e, "n_embd")?,
            s: s as i32,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))
    }
}

/// What the hyper-connection kernels refuse: more streams than [`HC_MAX`], mixes or a
/// head mix of the wrong shape, post-norms inside the residual. The reason when not.
pub(crate) fn check(plan: &DecoderPlan) -> Result<(), String> {
    if let Some(h) = &plan.hyper {
        let hc = h.shape.n_hc;
        if hc == 0 || hc > HC_MAX || h.shape.n_embd != plan.n_embd {
            return Err(format!(
                "hyper-connections of {hc} streams (the kernels take 1 to {HC_MAX})"
            ));
        }
        let w_ok = |w: &sluice_models::blocks::hyper::HcWeights, n_out: usize, n_scale| {
            (w.proj.rows, w.proj.cols, w.base.len(), w.scale.len())
                == (n_out, hc * plan.n_embd, n_out, n_scale)
        };
        match &h.head {
            HyperHead::Learned(w) if w_ok(w, hc, 1) => {}
            HyperHead::Learned(_) => {
                return Err("the hyper-connection head's shapes do not match".into())
            }
            HyperHead::Mean => {}
        }
        for (il, l) in plan.layers.iter().enumerate() {
            match &l.hc {
                Some(w) if w.iter().all(|w| w_ok(w, (2 + hc) * hc, 3)) => {}
                _ => {
                    return Err(format!(
                        "layer {il}: hyper-connection mixes missing or of the wrong shape"
                    ))
                }
            }
        }
        if let Some(il) = plan
            .layers
            .iter()
            .position(|l| l.post_attn_norm.is_some() || l.post_ffn_norm.is_some())
        {
            return Err(format!(
                "layer {il}: post-norms inside a hyper-connection residual have no GPU kernel"
            ));
        }
    } else if plan.layers.iter().any(|l| l.hc.is_some()) {
        return Err("hyper-connection mixes without the residual's shape".into());
    }
    Ok(())
}
