//! DeepSeek V4 attention on the GPU (the CPU's `sluice_models::blocks::dsv4_attention`).
//!
//! Owns: the launch sequence of one layer ([`GpuDecoder::dsv4`]): q-LoRA and the KV row
//! (`dsv4_heads`: per-head RMS and partial interleaved RoPE; `dsv4_kv_prep`), the KV
//! compressor (`dsv4_compress` + `ring_store`: compressed rows from the batch and the carry
//! ring), the lightning indexer (scores and top-k through `GpuDecoder::index_select`),
//! `dsv4_attention` (window rows from the batch or the ring, the chosen compressed rows, the
//! head's sink), the window ring's update, the output's de-rotation and the grouped
//! low-rank output. Its device weights are `forward::DDsv4`, its state `forward::Dsv4Kv`.

use sluice_models::ModelError;

use crate::forward::{i32_of, rows_n, Call, DComp, DDsv4, DMat, GpuDecoder, IndexSelect};
use crate::kernels;

impl GpuDecoder {
    /// DeepSeek V4 attention of layer `il` (the CPU's `blocks::dsv4_attention`): q-LoRA,
    /// the KV row, the compressor and the lightning indexer, attention over the window
    /// and the chosen compressed rows with the head's sink, the grouped low-rank output.
    /// Its output rows and matrix.
    pub(crate) fn dsv4<'w>(
        &self,
        a: &'w DDsv4,
        il: usize,
        c: &Call<'_>,
    ) -> Result<(&'w DMat, u64), ModelError> {
        let Call {
            n,
            eps,
            small,
            kvt,
            pos,
            dense,
            n_dense,
            nd,
            head_chunks,
            n_headc,
            h,
            q,
            k,
            att,
            qa,
            qan,
            cc,
            cz,
            iq,
            wh,
            ic,
            iz,
            scores,
            stride,
            idx_tile,
            selb,
            nselb,
            dz,
            dsv4_ptrs,
            ..
        } = *c;

        let s = self
            .dsv4
            .as_ref()
            .expect("checked: DeepSeek V4 has a shape");
        let dp = dsv4_ptrs[il];
        let nrot = s.n_rot as i32;
        let round = i32::from(kvt == 0);
        // Every product of the normed input.
        let mut from_h: Vec<(&DMat, u64)> = vec![(&a.q_a, qa), (&a.kv, k)];
        if let Some(c) = &a.comp {
            from_h.extend([(&c.kv, cc), (&c.gate, cz)]);
        }
        if let Some(ix) = &a.indexer {
            from_h.extend([(&ix.proj, wh), (&ix.comp.kv, ic), (&ix.comp.gate, iz)]);
        }
        self.mv(&from_h, dense, n_dense, nd, h, 1, small)?;
        self.rms_norm(qa, a.q_a_norm, qan, 0, n, s.q_lora, eps)?;
        let mut from_q: Vec<(&DMat, u64)> = vec![(&a.q_b, q)];
        if let Some(ix) = &a.indexer {
            from_q.push((&ix.q_b, iq));
        }
        self.mv(&from_q, dense, n_dense, nd, qan, 1, small)?;
        let heads = |buf: u64, n_heads: usize, dim: usize, freq: u64, flags: i32| {
            kernels::Dsv4Heads {
                x: buf,
                pos,
                inv_freq: freq,
                n_heads: n_heads as i32,
                hd: dim as i32,
                n_rot: nrot,
                flags,
                eps,
            }
            .launch(self, (n as u32, n_heads as u32, 1))
        };
        heads(q, s.n_head, s.head_dim, a.rope, 1)?;
        kernels::Dsv4KvPrep {
            kv: k,
            norm: a.kv_norm,
            pos,
            inv_freq: a.rope,
            hd: s.head_dim as i32,
            n_rot: nrot,
            round,
            eps,
        }
        .launch(self, rows_n(n))?;
        let compress = |c: &DComp, cb: u64, zb: u64, st: [u64; 3]| {
            kernels::Dsv4Compress {
                c: cb,
                z: zb,
                rc: st[0],
                rz: st[1],
                ape: c.ape,
                norm: c.norm,
                pos,
                inv_freq: a.rope_compress,
                rows: st[2],
                ratio: c.ratio as i32,
                hd: c.head_dim as i32,
                coff: c.coff as i32,
                n_rot: nrot,
                round,
                eps,
            }
            .launch(self, rows_n(n))?;
            let width = c.coff * c.head_dim;
            self.ring_store(cb, zb, st[0], st[1], pos, width, c.coff * c.ratio, n)
        };
        if let Some(c) = &a.comp {
            compress(c, cc, cz, dp.comp)?;
        }
        let (mut sel, mut nsel, mut top) = (0, 0, 0);
        if let Some(ix) = &a.indexer {
            heads(iq, ix.n_head, ix.head_dim, a.rope_compress, 0)?;
            compress(&ix.comp, ic, iz, dp.index)?;
            let ix_sel = IndexSelect {
                iq,
                wh,
                n_head: ix.n_head,
                head_dim: ix.head_dim,
                rows: dp.index[2],
                ratio: ix.comp.ratio,
                top_k: ix.top_k,
            };
            let scratch = (scores, stride, idx_tile, selb, nselb);
            self.index_select(&ix_sel, pos, scratch, n)?;
            (sel, nsel, top) = (selb, nselb, ix.top_k);
        }
        let ratio = a.comp.as_ref().map_or(0, |c| c.ratio);
        kernels::Dsv4Attention {
            q,
            kb: k,
            ring: dp.ring,
            rows: dp.comp[2],
            sel,
            nsel,
            sinks: a.sinks,
            out: att,
            pos,
            nh: s.n_head as i32,
            hd: s.head_dim as i32,
            window: i32_of(s.window, "window")?,
            ratio: ratio as i32,
            top_k: top as i32,
            scale: self.plan.shape.scale,
        }
        .launch(self, (n as u32, s.n_head as u32, 1))?;
        // The window's ring after every read of it.
        self.ring_store(k, 0, dp.ring, 0, pos, s.head_dim, s.window, n)?;
        heads(att, s.n_head, s.head_dim, a.rope, 2)?;
        let gy = s.o_groups * nd;
        self.mv(&[(&a.out_a, dz)], head_chunks, n_headc, gy, att, 1, small)?;
        Ok((&a.out_b, dz))
    }
}
