//! Low-rank hyper-connection mixers on the GPU (the CPU's
//! `sluice_models::blocks::hyper_lowrank`): Qwen3.8-Flash-Next's residual, whose mixers
//! replace every norm.
//!
//! Owns: [`DMix`] (the mixer's norm, its down product in column segments, up, the
//! injection weights) and [`DFew`] (a product of few rows: f32 weights through
//! `dot_rows_f32`, others through the product kernels), their upload, and the launches:
//! [`GpuDecoder::lr_mixer`] (`rms_groups`, down, `lr_act`, up, `lr_mix`),
//! [`GpuDecoder::lr_post`], [`GpuDecoder::few`], [`GpuDecoder::gather`] (the head's rows).

use sluice_kernels::GgmlType;
use sluice_models::blocks::hyper_lowrank::HcWeights;
use sluice_models::plan::{DecoderPlan, PlanLayer};
use sluice_models::weights::Mat;
use sluice_models::ModelError;

use crate::forward::scratch::{NextBufs, Rows};
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// Threads of a block that reduces over one stream of a token (`rms_groups`, `ple_gate`):
/// a decode step has one block per stream, so each is wide.
pub(crate) const GROUP_THREADS: u32 = 1024;

/// A low-rank mixer in VRAM (`hyper_lowrank::HcWeights`): the down product in `nseg`
/// column segments (`Uploader::segments`; 1: whole).
pub(crate) struct DMix {
    pub(crate) norm: u64,
    pub(crate) down: DMat,
    pub(crate) nseg: usize,
    pub(crate) up: DMat,
    pub(crate) inject: Option<DFew>,
}

/// Most rows a product of f32 weights may have to go through `dot_rows_f32` (a block per
/// token and row) instead of the product kernels (a warp per row: a few long rows would
/// keep a few warps busy).
pub(crate) const FEW_ROWS: usize = 64;

/// A product of few rows: f32 weights through `dot_rows_f32` (their address and shape),
/// others through the product kernels.
pub(crate) enum DFew {
    F32 { ptr: u64, rows: usize, cols: usize },
    Mat(DMat),
}

impl Uploader<'_> {
    /// A low-rank mixer, its down product in `nseg` column segments.
    pub(crate) fn mix(&mut self, w: &HcWeights, nseg: usize) -> Result<DMix, String> {
        Ok(DMix {
            norm: self.norm(&w.norm)?,
            down: if nseg > 1 {
                self.segments(&w.down, nseg)?
            } else {
                self.mat(&w.down)?
            },
            nseg,
            up: self.mat(&w.up)?,
            inject: w.inject.as_ref().map(|m| self.few(m)).transpose()?,
        })
    }

    /// A product of few rows ([`DFew`]).
    pub(crate) fn few(&mut self, m: &Mat) -> Result<DFew, String> {
        if m.ty == GgmlType::F32 && m.rows <= FEW_ROWS {
            Ok(DFew::F32 {
                ptr: self.bytes(m.bytes(self.map))?,
                rows: m.rows,
                cols: m.cols,
            })
        } else {
            Ok(DFew::Mat(self.mat(m)?))
        }
    }
}

impl GpuDecoder {
    /// `n` rows' low-rank mixer `w` over the streams `x` (`[n][s][e]`): the block input into
    /// `h`, and the injection weights into `b.inj` when `w` has them. `rows`: the rows'
    /// chunk table and the per-segment one (for a segmented down product).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lr_mixer(
        &self,
        w: &DMix,
        s: usize,
        x: u64,
        h: u64,
        b: &NextBufs,
        rows: (Rows, Rows),
        n: usize,
        eps: f32,
    ) -> Result<(), ModelError> {
        let (rows, seg) = rows;
        let e = self.plan.n_embd;
        let ei = i32_of(e, "n_embd")?;
        let si = i32_of(s, "streams")?;
        kernels::RmsGroups {
            x,
            w: w.norm,
            out: b.xn,
            e: ei,
            eps,
        }
        .launch(self, (n as u32, s as u32, 1))?;
        let down = if w.nseg > 1 { seg } else { rows };
        self.mv_rows(&[(&w.down, b.ud)], down, b.xn)?;
        if let Some(m) = &w.inject {
            self.few(m, b.xn, b.inj, rows, n)?;
        }
        let inj = if w.inject.is_some() { b.inj } else { 0 };
        kernels::LrAct {
            part: b.ud,
            u: b.u,
            inj,
            r: i32_of(w.down.rows, "rank")?,
            s: si,
            nseg: w.nseg as i32,
            inv_s: 1.0 / s as f32,
        }
        .launch(self, (n as u32, 1, 1))?;
        self.mv_rows(&[(&w.up, b.gw)], rows, b.u)?;
        kernels::LrMix {
            gw: b.gw,
            xn: b.xn,
            m: h,
            e: ei,
            s: si,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))
    }

    /// `x[t][st] += inj[t][st] * y[t]` for `n` tokens of `s` streams.
    pub(crate) fn lr_post(
        &self,
        s: usize,
        x: u64,
        y: u64,
        inj: u64,
        n: usize,
    ) -> Result<(), ModelError> {
        let e = self.plan.n_embd;
        kernels::LrPost {
            x,
            y,
            inj,
            e: i32_of(e, "n_embd")?,
            s: s as i32,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))
    }

    /// `y = W x` for `n` rows of `x` (`rows`: their chunk table) of a few-row product.
    pub(crate) fn few(
        &self,
        w: &DFew,
        x: u64,
        y: u64,
        rows: Rows,
        n: usize,
    ) -> Result<(), ModelError> {
        match w {
            DFew::F32 { ptr, rows: r, cols } => kernels::DotRowsF32 {
                w: *ptr,
                x,
                y,
                rows: *r as i32,
                cols: i32_of(*cols, "columns")?,
            }
            .launch(self, (n as u32, *r as u32, 1)),
            DFew::Mat(m) => self.mv_rows(&[(m, y)], rows, x),
        }
    }

    /// `out[i] = x[rows[i]]` for `n` rows of `cols`.
    pub(crate) fn gather(
        &self,
        x: u64,
        rows: u64,
        out: u64,
        n: usize,
        cols: usize,
    ) -> Result<(), ModelError> {
        kernels::RowsGather {
            x,
            rows,
            out,
            cols: i32_of(cols, "row")?,
        }
        .launch(self, (n as u32, cols.div_ceil(256) as u32, 1))
    }
}

/// Whether the low-rank mixer `w` fits streams of `d` values (`s` of them); `inject`: it
/// must have injection weights.
fn mix_ok(w: &HcWeights, s: usize, d: usize, inject: bool) -> bool {
    let r = w.down.rows;
    r > 0
        && w.norm.len() == d
        && (w.down.cols, w.up.rows, w.up.cols) == (d, d, r)
        && match &w.inject {
            Some(m) => (m.rows, m.cols) == (s, d),
            None => !inject,
        }
}

/// What the low-rank mixers refuse of the plan: no streams, an output mixer of the wrong
/// shape. The reason when not.
pub(crate) fn check_head(plan: &DecoderPlan) -> Result<(), String> {
    let e = plan.n_embd;
    let s = plan.lowrank.as_ref().map_or(1, |lr| lr.n_stream);
    if s == 0 {
        return Err("low-rank hyper-connections of 0 streams".into());
    }
    let d = s * e;
    if let Some(lr) = &plan.lowrank {
        if !mix_ok(&lr.head, s, d, false) {
            return Err("the output low-rank mixer's shapes do not match the streams".into());
        }
    }
    Ok(())
}

/// What the low-rank mixers refuse of layer `il`: norms beside them, mixers of the wrong
/// shape, without injection weights, or unlike the plan's residual. The reason when not.
pub(crate) fn check_layer(plan: &DecoderPlan, il: usize, l: &PlanLayer) -> Result<(), String> {
    let s = plan.lowrank.as_ref().map_or(1, |lr| lr.n_stream);
    let d = s * plan.n_embd;
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
        (Some(w), Some(_)) if w.iter().all(|w| mix_ok(w, s, d, true)) => {}
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
    Ok(())
}
