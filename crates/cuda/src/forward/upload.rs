//! Uploading a plan's weights at start: [`Uploader`] (every matrix's bytes and its
//! pointer-table entry, norms, integer tables, per-head and column-segment layouts; the
//! blocks add their own methods), the kernels' loading (`Funcs::load`) and whether the
//! weights fit the VRAM budget ([`weights_fit`]).

use std::sync::Arc;

use sluice_kernels::GgmlType;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use sluice_models::plan::{DecoderPlan, HyperHead, PlanAttn, PlanFfn};
use sluice_models::weights::Mat;

use crate::blocks::deltanet::gdn_smem;
use crate::blocks::ffn::{act_id, DenseFfn};
use crate::blocks::hyper::hc_segments;
use crate::blocks::kda::delta_shape;
use crate::forward::bufs::FfnDims;
use crate::forward::products::{takes_f16, takes_i8};
use crate::forward::{kernel_signature, DAttn, DFfn, DLayer, DMat, ExpertPlacement, Funcs, Kernel};
use crate::{kernel_format, Device, Mma, FORMATS};

/// Uploads weights at start and keeps their device buffers and the host pointer table.
pub(crate) struct Uploader<'m> {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) map: &'m [u8],
    pub(crate) owned: Vec<CudaSlice<u8>>,
    pub(crate) norms: Vec<CudaSlice<f32>>,
    pub(crate) tab: Vec<u64>,
    pub(crate) uploaded: u64,
}

/// Whether `plan`'s weights fit what the backend may hold in VRAM (routed experts too when
/// `experts` is resident; cached ones need a VRAM expert cache); the VRAM expert cache's
/// budget.
pub(crate) fn weights_fit(
    d: &Device,
    plan: &DecoderPlan,
    experts: ExpertPlacement,
) -> Result<u64, String> {
    // What the weights need, against what the backend may hold.
    // (Pooled layers' per-head k_b / v_b are stacked tensors, outside `matrices`.)
    let stacked: u64 = plan
        .layers
        .iter()
        .map(|l| match &l.attn {
            PlanAttn::Pooled { w, .. } => (w.k_b.range.len() + w.v_b.range.len()) as u64,
            _ => 0,
        })
        .sum();
    let dense: u64 = stacked
        + plan
            .matrices()
            .iter()
            .map(|(_, m)| m.range.len() as u64)
            .sum::<u64>();
    let routed: u64 = plan
        .layers
        .iter()
        .map(|l| match &l.ffn {
            PlanFfn::Moe { experts, .. } => {
                experts.iter().map(|s| s.range.len() as u64).sum::<u64>()
            }
            PlanFfn::Dense { .. } => 0,
        })
        .sum();
    let (budget, held, expert_budget) = {
        let g = d.lock();
        (g.budget, g.stats.resident_bytes, g.stats.expert_budget)
    };
    let need = dense
        + if experts == ExpertPlacement::Resident {
            routed
        } else {
            0
        };
    if held + need > budget {
        return Err(format!(
            "the weights need {:.2} GiB of VRAM ({:.2} GiB routed experts{}), {:.2} GiB is left for weights; set --gpu-expert-cache to stream the experts",
            need as f64 / (1u64 << 30) as f64,
            routed as f64 / (1u64 << 30) as f64,
            if experts == ExpertPlacement::Resident { " included" } else { " not included" },
            budget.saturating_sub(held) as f64 / (1u64 << 30) as f64
        ));
    }
    if experts == ExpertPlacement::Cached && routed > 0 && expert_budget == 0 {
        return Err(
            "experts outside VRAM need a VRAM expert cache (--gpu-expert-cache SIZE)".into(),
        );
    }
    Ok(expert_budget)
}

impl Uploader<'_> {
    /// Upload `bytes`; their device address.
    pub(crate) fn bytes(&mut self, bytes: &[u8]) -> Result<u64, String> {
        let s = self
            .stream
            .clone_htod(bytes)
            .map_err(|e| format!("uploading {} bytes of weights: {e}", bytes.len()))?;
        let a = s.device_ptr(&self.stream).0;
        self.owned.push(s);
        self.uploaded += bytes.len() as u64;
        Ok(a)
    }

    /// Upload a matrix and give it a pointer-table entry.
    pub(crate) fn mat(&mut self, m: &Mat) -> Result<DMat, String> {
        let a = self.bytes(m.bytes(self.map))?;
        self.tab.push(a);
        Ok(DMat {
            tab: self.tab.len() - 1,
            fi: kernel_format(m.ty, m.cols).expect("checked"),
            rows: m.rows,
            cols: m.cols,
            row_bytes: m.ty.row_bytes(m.cols as u64).expect("checked") as i64,
        })
    }

    /// Upload a matrix of `n` heads' row blocks and give each head a pointer-table entry
    /// (consecutive); the result's `rows` are one head's.
    pub(crate) fn heads(&mut self, m: &Mat, n: usize) -> Result<DMat, String> {
        let a = self.bytes(m.bytes(self.map))?;
        let row_bytes = m.ty.row_bytes(m.cols as u64).expect("checked") as i64;
        let rows = m.rows / n;
        let first = self.tab.len();
        for h in 0..n {
            self.tab.push(a + (h * rows) as u64 * row_bytes as u64);
        }
        Ok(DMat {
            tab: first,
            fi: kernel_format(m.ty, m.cols).expect("checked"),
            rows,
            cols: m.cols,
            row_bytes,
        })
    }

    pub(crate) fn norm(&mut self, v: &[f32]) -> Result<u64, String> {
        let s = self
            .stream
            .clone_htod(v)
            .map_err(|e| format!("uploading a norm: {e}"))?;
        let a = s.device_ptr(&self.stream).0;
        self.norms.push(s);
        Ok(a)
    }

    /// Upload integers (a hash router's table); their device address.
    pub(crate) fn ints(&mut self, v: &[i32]) -> Result<u64, String> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.bytes(&bytes)
    }

    /// Upload a matrix as `nseg` column segments, each its own `[rows, cols / nseg]` matrix
    /// with a pointer-table entry (consecutive; the result's `cols` are a segment's): a
    /// product through a per-segment chunk table (unit s: the s-th `cols / nseg` values of
    /// each input row) gives every segment's partial sums, which a kernel adds in segment
    /// order, so a short, wide product spreads over `nseg` times the blocks.
    pub(crate) fn segments(&mut self, m: &Mat, nseg: usize) -> Result<DMat, String> {
        let row_bytes = m.ty.row_bytes(m.cols as u64).expect("checked") as usize;
        let seg_cols = m.cols / nseg;
        let seg_bytes = row_bytes / nseg;
        let src = m.bytes(self.map);
        // [nseg][rows][seg_bytes]: segment s of row r is bytes s * seg_bytes.. of the row.
        let mut out = Vec::with_capacity(src.len());
        for sg in 0..nseg {
            for r in 0..m.rows {
                let at = r * row_bytes + sg * seg_bytes;
                out.extend_from_slice(&src[at..at + seg_bytes]);
            }
        }
        let a = self.bytes(&out)?;
        let first = self.tab.len();
        for sg in 0..nseg {
            self.tab.push(a + (sg * m.rows * seg_bytes) as u64);
        }
        Ok(DMat {
            tab: first,
            fi: kernel_format(m.ty, seg_cols).expect("checked"),
            rows: m.rows,
            cols: seg_cols,
            row_bytes: seg_bytes as i64,
        })
    }

    /// A norm's address, 0 (a null pointer for the kernels) when there is none.
    pub(crate) fn opt_norm(&mut self, v: &Option<Vec<f32>>) -> Result<u64, String> {
        match v {
            Some(v) => self.norm(v),
            None => Ok(0),
        }
    }

    /// Upload one layer's attention block (its weights, in the block's own type).
    pub(crate) fn attention(&mut self, attn: &PlanAttn) -> Result<DAttn, String> {
        Ok(match attn {
            PlanAttn::Gqa {
                w: a,
                inv_freq,
                window,
            } => DAttn::Gqa(self.gqa(a, inv_freq, window)?),
            PlanAttn::Kda { w, shape } => DAttn::Kda(Box::new(self.kda(w, shape)?)),
            // Absorbed MLA without RoPE over the positions its k-pool indexer picks.
            PlanAttn::Pooled { w, shape } => DAttn::Mla(Box::new(self.pooled(w, shape)?)),
            PlanAttn::Delta { w, shape } => DAttn::Delta(Box::new(self.delta(w, shape)?)),
            PlanAttn::Qsa { w, shape, inv_freq } => {
                DAttn::Qsa(Box::new(self.qsa(w, shape, inv_freq)?))
            }
            PlanAttn::Dsv4 { w, shape } => DAttn::Dsv4(Box::new(self.dsv4(w, shape)?)),
            PlanAttn::Mla { w, shape, select } => DAttn::Mla(Box::new(self.mla(w, shape, select)?)),
        })
    }
}

/// The column segments of the hyper-connection projections and of the low-rank mixers'
/// down products: one count for each (the call header has one segment chunk table); a
/// count that splits one splits the others (powers of two).
pub(crate) fn segment_counts(plan: &DecoderPlan) -> (usize, usize) {
    let hc_nseg = plan
        .layers
        .iter()
        .flat_map(|l| l.hc.iter().flat_map(|w| w.iter()))
        .chain(match &plan.hyper {
            Some(h) => match &h.head {
                HyperHead::Learned(w) => Some(w),
                HyperHead::Mean => None,
            },
            None => None,
        })
        .map(|w| hc_segments(w.proj.ty, w.proj.cols))
        .min()
        .unwrap_or(1);
    // The low-rank mixers' down products: a few hundred rows, the streams' width in
    // columns.
    let lr_nseg = plan
        .layers
        .iter()
        .flat_map(|l| l.hc_lowrank.iter().flat_map(|w| w.iter()))
        .map(|w| hc_segments(w.down.ty, w.down.cols))
        .min()
        .unwrap_or(1);
    (hc_nseg, lr_nseg)
}

impl Uploader<'_> {
    /// Upload every layer of `plan` (each block's weights through its own `Uploader`
    /// method; `experts`: where routed experts live; the mixes' segment counts); the widest
    /// feed-forward with them.
    pub(crate) fn layers(
        &mut self,
        plan: &DecoderPlan,
        experts: ExpertPlacement,
        hc_nseg: usize,
        lr_nseg: usize,
    ) -> Result<(Vec<DLayer>, FfnDims), String> {
        let mut dims = FfnDims {
            dense: 0,
            moe: 0,
            k_max: 0,
            n_expert_max: 0,
        };
        let mut layers = Vec::with_capacity(plan.layers.len());
        for l in &plan.layers {
            let ffn = match &l.ffn {
                PlanFfn::Dense { w, act } => {
                    dims.dense = dims.dense.max(w.gate.rows);
                    DFfn::Dense(DenseFfn {
                        gate: self.mat(&w.gate)?,
                        up: self.mat(&w.up)?,
                        down: self.mat(&w.down)?,
                        act: act_id(*act),
                    })
                }
                PlanFfn::Moe {
                    moe,
                    experts: st,
                    shared,
                } => {
                    dims.moe = dims.moe.max(st[0].rows);
                    dims.k_max = dims.k_max.max(moe.k);
                    dims.n_expert_max = dims.n_expert_max.max(moe.n_expert);
                    if let Some(sh) = shared {
                        dims.dense = dims.dense.max(sh.w.gate.rows);
                    }
                    DFfn::Moe(Box::new(self.moe(moe, st, shared, experts)?))
                }
            };
            let attn = self.attention(&l.attn)?;
            let hc = match &l.hc {
                Some(w) => Some([self.hc(&w[0], hc_nseg)?, self.hc(&w[1], hc_nseg)?]),
                None => None,
            };
            let lr = match &l.hc_lowrank {
                Some(w) => Some([self.mix(&w[0], lr_nseg)?, self.mix(&w[1], lr_nseg)?]),
                None => None,
            };
            let ple = l
                .ple
                .as_ref()
                .map(|w| self.ple(w))
                .transpose()?
                .map(Box::new);
            layers.push(DLayer {
                lr,
                ple,
                attn_norm: self.norm(&l.attn_norm)?,
                attn,
                post_attn: self.opt_norm(&l.post_attn_norm)?,
                ffn_norm: self.norm(&l.ffn_norm)?,
                ffn,
                post_ffn: self.opt_norm(&l.post_ffn_norm)?,
                hc,
            });
        }
        Ok((layers, dims))
    }
}

impl Funcs {
    /// DeltaNet's (and KDA's) state lives in shared memory while a batch runs:
    /// `delta_rule` may have what the widest head of `plan` needs (the opt-in limit less
    /// the kernel's static shared memory is the driver's to check).
    pub(crate) fn fit_delta_rule(&self, plan: &DecoderPlan) -> Result<(), String> {
        let need = plan
            .layers
            .iter()
            .filter_map(|l| match &l.attn {
                PlanAttn::Delta { shape, .. } => Some(gdn_smem(shape)),
                PlanAttn::Kda { shape, .. } => Some(gdn_smem(&delta_shape(shape))),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        if need > 0 {
            self.delta_rule
                .f
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    need as i32,
                )
                .map_err(|e| format!("kernel delta_rule: {need} bytes of shared memory: {e}"))?;
        }
        Ok(())
    }

    /// Load every kernel of the forward pass from the compiled module (`mvt1_*` allowed
    /// `smem_max` bytes of dynamic shared memory).
    pub(crate) fn load(d: &Device, smem_max: usize) -> Result<Funcs, String> {
        let load = |n: &str| -> Result<Kernel, String> {
            Ok(Kernel {
                f: d.module
                    .load_function(n)
                    .map_err(|e| format!("kernel {n}: {e}"))?,
                name: n.to_string(),
                sig: kernel_signature(n).ok_or_else(|| format!("kernel {n}: no signature"))?,
            })
        };
        let mut mvg = Vec::new();
        let mut mvt = Vec::new();
        let mut mvi = Vec::new();
        let mut mvq = Vec::new();
        let mut embed = Vec::new();
        let dynamic = |name: String| -> Result<Kernel, String> {
            let k = load(&name)?;
            k.f.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem_max as i32,
            )
            .map_err(|e| format!("kernel {name}: {smem_max} bytes of shared memory: {e}"))?;
            Ok(k)
        };
        for (ty, s) in FORMATS {
            mvg.push(load(&format!("mvg_{s}"))?);
            let tensor = d.mma != Mma::Never && takes_f16(ty);
            mvt.push(if tensor {
                let one = dynamic(format!("mvt1_{s}"))?;
                let mvd = dynamic(format!("mvd_{s}"))?;
                Some([one, load(&format!("mvt_{s}"))?, mvd])
            } else {
                None
            });
            mvq.push(if tensor && ty == GgmlType::Q4_K {
                Some([dynamic(format!("mvq_{s}"))?, dynamic(format!("mvq_{s}_q"))?])
            } else {
                None
            });
            mvi.push(if tensor && takes_i8(ty) {
                let one = dynamic(format!("mvi1_{s}"))?;
                let mvd = dynamic(format!("mvid_{s}"))?;
                Some([one, load(&format!("mvi_{s}"))?, mvd])
            } else {
                None
            });
            embed.push(load(&format!("embed_{s}"))?);
        }
        Ok(Funcs {
            mvg,
            mvt,
            mvi,
            quant_x8: load("quant_x8")?,
            mvq,
            embed,
            rms_norm_rows: load("rms_norm_rows")?,
            residual_norm: load("residual_norm")?,
            qk_norm_rope: load("qk_norm_rope")?,
            kv_store: [load("kv_store_f16")?, load("kv_store_f32")?],
            attention: [load("attention_f16")?, load("attention_f32")?],
            topk_route: load("topk_route")?,
            moe_chunks: load("moe_chunks")?,
            glu_act: load("glu_act")?,
            moe_combine: load("moe_combine")?,
            mla_kv_prep: load("mla_kv_prep")?,
            mla_q_split: load("mla_q_split")?,
            mla_q_join: load("mla_q_join")?,
            hc_expand: load("hc_expand")?,
            hc_pre: load("hc_pre")?,
            hc_post: load("hc_post")?,
            dsv4_heads: load("dsv4_heads")?,
            dsv4_kv_prep: load("dsv4_kv_prep")?,
            dsv4_compress: load("dsv4_compress")?,
            ring_store: load("ring_store")?,
            dsv4_index_scores: load("dsv4_index_scores")?,
            dsv4_topk: load("dsv4_topk")?,
            dsv4_attention: load("dsv4_attention")?,
            dsa_key_prep: load("dsa_key_prep")?,
            rms_groups: load("rms_groups")?,
            lr_act: load("lr_act")?,
            lr_mix: load("lr_mix")?,
            lr_post: load("lr_post")?,
            ple_gate: load("ple_gate")?,
            conv_ring: load("conv_ring")?,
            delta_rule: load("delta_rule")?,
            qsa_prep: load("qsa_prep")?,
            qsa_pool: load("qsa_pool")?,
            qsa_expand: load("qsa_expand")?,
            rows_gather: load("rows_gather")?,
            dot_rows_f32: load("dot_rows_f32")?,
            stream_mean: load("stream_mean")?,
            kda_gate: load("kda_gate")?,
            pool_prep: load("pool_prep")?,
            pool_make: load("pool_make")?,
        })
    }
}
