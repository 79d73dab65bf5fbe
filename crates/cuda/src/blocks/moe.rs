//! The mixture-of-experts feed-forward on the GPU (the CPU's `sluice_models::blocks::moe`).
//!
//! Owns: [`Moe`] (the router and how `topk_route` scores it, the routed experts' parts as
//! pointer-table entries, the shared expert [`DShared`]) and its launch sequence
//! ([`GpuDecoder::moe`]): router product, `topk_route`, the shared expert, the experts
//! grouped on the device (`moe_chunks`; resident experts) or through the VRAM unit cache
//! (`GpuDecoder::ensure_units`, hits first), GLU, down, `moe_combine`.

use sluice_models::blocks::Env;
use sluice_models::plan::PlanFfn;
use sluice_models::ModelError;

use crate::forward::qwen4exp::DFew;
use crate::forward::{err, lock, rows_n, Act, Call, DMat, GpuDecoder, CHUNK_BYTES, MVG_N};
use crate::kernels;

/// A MoE layer in VRAM.
pub(crate) struct Moe {
    pub(crate) router: DMat,
    pub(crate) norm: bool,
    pub(crate) n_expert: usize,
    pub(crate) k: usize,
    /// Gate, up, down; `tab` is the first of `n_expert` entries.
    pub(crate) parts: [DMat; 3],
    /// Index of the first of this layer's entries in the pointer table.
    pub(crate) tab_index: usize,
    pub(crate) act: Act,
    /// `topk_route`'s score function (0 softmax, 1 sigmoid, 2 sqrt-softplus), the
    /// selection bias (0: none), renormalisation and scale.
    pub(crate) score: i32,
    pub(crate) bias: u64,
    pub(crate) scale: f32,
    /// A hashed router's token -> experts table (`[n_vocab][k]` i32; 0: none).
    pub(crate) table: u64,
    /// The shared expert (added to the routed sum).
    pub(crate) shared: Option<Box<DShared>>,
}

/// A MoE layer's shared expert: gate, up, down and its activation, and the `[1, n_embd]`
/// gate whose sigmoid scales its output (Qwen3.8-Flash-Next; None: unscaled).
pub(crate) struct DShared {
    pub(crate) gate: DMat,
    pub(crate) up: DMat,
    pub(crate) down: DMat,
    pub(crate) act: Act,
    pub(crate) scale: Option<DFew>,
}

impl GpuDecoder {
    /// MoE layer `il` (the CPU's `blocks::moe`) of the normed input into `o`: the router
    /// and its top-k, the shared expert, the routed experts' products (resident, or
    /// through the VRAM unit cache, hits first), the weighted combine.
    pub(crate) fn moe(
        &self,
        w: &Moe,
        il: usize,
        c: &Call<'_>,
        env: &Env<'_>,
        host_ids: &mut Vec<i32>,
    ) -> Result<(), ModelError> {
        let Moe {
            router,
            norm,
            score,
            bias,
            scale,
            table,
            shared,
            n_expert,
            k: top,
            parts,
            tab_index,
            act,
        } = w;
        let Call {
            n,
            e,
            ei,
            small,
            tokens,
            dense,
            n_dense,
            nd,
            dense_rows,
            h,
            o,
            shb,
            g,
            u,
            rl,
            ids,
            wts,
            dd,
            chunks,
            nchunks,
            nb,
            p,
            stream,
            sc_ids,
            ..
        } = *c;

        let (ne, kk) = (*n_expert, *top);
        self.mv(&[(router, rl)], dense, n_dense, nd, h, 1, small)?;
        kernels::TopkRoute {
            logits: rl,
            bias: *bias,
            n_expert: ne as i32,
            k: kk as i32,
            score: *score,
            norm: *norm as i32,
            scale: *scale,
            ids,
            wts,
            table: *table,
            tokens,
        }
        .launch(self, rows_n(n))?;
        let np = n * kk;
        if self.units.is_some() || env.routing.is_some() {
            host_ids.resize(np, 0);
            stream
                .memcpy_dtoh(&sc_ids.slice(0..np), &mut host_ids[..])
                .map_err(|e| err("expert ids", e))?;
            stream.synchronize().map_err(|e| err("expert ids", e))?;
            if let Some(rec) = env.routing {
                let v: Vec<u32> = host_ids.iter().map(|&i| i as u32).collect();
                lock(rec)
                    .record_layer(il as u32, &v)
                    .map_err(sluice_tier::StreamError::from)?;
            }
        }
        // The shared expert before the routed products (into `shb`; g and u
        // are free until those), added by moe_combine after the routed sum.
        // Queued after the expert ids' download, so with the VRAM unit cache
        // it runs while the misses are read.
        if let Some(sh) = shared {
            let gu = [(&sh.gate, g), (&sh.up, u)];
            self.mv(&gu, dense, n_dense, nd, h, 1, small)?;
            self.glu(g, u, n * sh.gate.rows, sh.act)?;
            self.mv(&[(&sh.down, shb)], dense, n_dense, nd, g, 1, small)?;
            if let Some(sg) = &sh.scale {
                self.few(sg, h, nb.sg, dense_rows, n)?;
            }
        }
        let len = np * parts[0].rows;
        if self.units.is_some() {
            // Hits first: their gate / up products run while the misses
            // are read and copied; then the misses', then down for all.
            let PlanFfn::Moe { experts, .. } = &p.layers[il].ffn else {
                unreachable!("the plan's layer kinds match")
            };
            let gate_up = |table: u64, count: u64, chunks: usize| {
                let gu = [(&parts[0], g), (&parts[1], u)];
                self.mv(&gu, table, count, chunks, h, kk, small)
            };
            let lc = self.ensure_units(env, il, host_ids, experts, ne, *tab_index, &mut |lc| {
                gate_up(lc.table, lc.counts, lc.hit)
            })?;
            let miss_table = lc.table + (lc.hit * CHUNK_BYTES) as u64;
            gate_up(miss_table, lc.counts + 4, lc.miss)?;
            self.glu(g, u, len, *act)?;
            self.mv(
                &[(&parts[2], dd)],
                lc.table,
                lc.counts + 8,
                lc.hit + lc.miss,
                g,
                1,
                small,
            )?;
        } else {
            kernels::MoeChunks {
                gids: ids,
                n_pairs: np as i32,
                n_expert: ne as i32,
                chunks,
                n_chunks: nchunks,
            }
            .launch(self, (1, 1, 1))?;
            let gy = np / MVG_N + ne.min(np);
            let gu = [(&parts[0], g), (&parts[1], u)];
            self.mv(&gu, chunks, nchunks, gy, h, kk, small)?;
            self.glu(g, u, len, *act)?;
            self.mv(&[(&parts[2], dd)], chunks, nchunks, gy, g, 1, small)?;
        }
        let sh_or_null = if shared.is_some() { shb } else { 0 };
        let gated = shared.as_ref().is_some_and(|sh| sh.scale.is_some());
        let sg_or_null = if gated { nb.sg } else { 0 };
        kernels::MoeCombine {
            d: dd,
            wts,
            sh: sh_or_null,
            sg: sg_or_null,
            o,
            k: kk as i32,
            cols: ei,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))?;
        Ok(())
    }
}
