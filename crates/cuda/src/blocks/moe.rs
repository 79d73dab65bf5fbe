//! The mixture-of-experts feed-forward on the GPU (the CPU's `sluice_models::blocks::moe`).
//!
//! Owns: [`Moe`] (the router and how `topk_route` scores it, the routed experts' parts as
//! pointer-table entries, the shared expert [`DShared`]) and its launch sequence
//! ([`GpuDecoder::moe`]): router product, `topk_route`, the shared expert, the experts
//! grouped on the device (`moe_chunks`; resident experts) or through the VRAM unit cache
//! (`GpuDecoder::ensure_units`, hits first), GLU, down, `moe_combine`.

use std::collections::BTreeMap;

use cudarc::driver::{CudaSlice, DevicePtr};
use sluice_models::blocks::moe::{MoeWeights, Router, ScoreFn};
use sluice_models::blocks::Env;
use sluice_models::plan::{DecoderPlan, PlanFfn, PlanLayer, PlanShared};
use sluice_models::weights::Stacked;
use sluice_models::ModelError;
use sluice_tier::Stop;

use crate::blocks::ffn::{act_id, Act};
use crate::blocks::hyper_lowrank::DFew;
use crate::forward::bufs::{FfnBufs, Io};
use crate::forward::scratch::Rows;
use crate::forward::{
    addr, err, lock, push_chunk, rows_n, DMat, ExpertPlacement, GpuDecoder, Uploader, CHUNK_BYTES,
    MVG_N,
};
use crate::lru::Lru;
use crate::staging::{Staging, StagingConfig};
use crate::{kernel_format, kernels};

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

pub(crate) const MAX_EXPERTS: usize = 1024;

/// Routed experts kept in VRAM by (layer, unit) when they are not resident whole.
pub(crate) struct UnitCache {
    /// (layer, unit) -> the unit's gate, up and down bytes in one buffer.
    pub(crate) lru: Lru<(usize, usize), CudaSlice<u8>>,
    /// Units of the layer in progress that did not fit the budget next to the layer's
    /// other units (a prefill chunk may use more experts than the cache holds): copied for
    /// this layer only, freed at the next layer (counted as copied per use).
    pub(crate) transient: Vec<(usize, CudaSlice<u8>)>,
    /// Host copy of the pointer table (rewritten per layer for the units it uses).
    pub(crate) tab: Vec<u64>,
    /// The layer's chunk table built on the host ([`layer_table`]).
    pub(crate) chunks: Option<CudaSlice<u8>>,
    /// Scan resistance (`SLUICE_CUDA_SCAN=0`: plain LRU): a batch that needs at least half
    /// of a layer's experts, with at least as many (token, slot) rows as experts, neither
    /// promotes its hits nor puts its misses anywhere but at the cold end ([`Lru::insert_cold`]).
    pub(crate) scan: bool,
    /// Uploads of misses from pageable memory through the page-locked ring.
    pub(crate) staging: Staging,
}

impl UnitCache {
    /// An empty cache of `budget` bytes over the host pointer table `tab`; scan resistance
    /// and the staging ring as the environment says.
    pub(crate) fn new(budget: u64, tab: Vec<u64>) -> UnitCache {
        UnitCache {
            lru: Lru::new(budget),
            transient: Vec::new(),
            tab,
            chunks: None,
            scan: !std::env::var("SLUICE_CUDA_SCAN").is_ok_and(|v| v == "0"),
            staging: Staging::new(StagingConfig::from_env()),
        }
    }

    /// Whether a layer's batch of `rows` (token, slot) rows needing `needed` of its
    /// `n_expert` units is a scan (see `scan`).
    pub(crate) fn is_scan(&self, rows: usize, needed: usize, n_expert: usize) -> bool {
        self.scan && rows >= n_expert && 2 * needed >= n_expert
    }
}

/// One MoE layer's expert chunks when experts come through the VRAM unit cache: `hit`
/// chunks (experts already in VRAM) from `table`, then `miss` chunks; the counts at
/// `counts` (hits), `counts + 4` (misses), `counts + 8` (all).
pub(crate) struct LayerChunks {
    pub(crate) table: u64,
    pub(crate) counts: u64,
    pub(crate) hit: usize,
    pub(crate) miss: usize,
}

/// Bytes of [`layer_table`]'s header (the counts, padded).
pub(crate) const LAYER_COUNTS_BYTES: usize = 16;

/// What `topk_route` takes of a router.
pub(crate) struct RouterKind<'a> {
    /// Score function id (0 softmax, 1 sigmoid, 2 sqrt-softplus).
    pub(crate) score: i32,
    pub(crate) bias: Option<&'a [f32]>,
    pub(crate) norm: bool,
    pub(crate) scale: f32,
    /// A hashed router's `[n_vocab][k]` experts.
    pub(crate) table: Option<&'a [u32]>,
}

/// A MoE layer's weighted combine (`moe_combine`'s operands) left to the next
/// `residual_norm`: the experts' outputs `d`, the weights `wts`, the shared expert's output
/// `sh` and gate logits `sg` (0: none), `k` slots a token. The default: no combine.
#[derive(Clone, Copy, Default)]
pub(crate) struct Combine {
    pub(crate) d: u64,
    pub(crate) wts: u64,
    pub(crate) sh: u64,
    pub(crate) sg: u64,
    pub(crate) k: i32,
}

impl GpuDecoder {
    /// MoE layer `il` (the CPU's `blocks::moe`) of the normed input into `o`: the router
    /// and its top-k, the shared expert, the routed experts' products (resident, or
    /// through the VRAM unit cache, hits first), the weighted combine; `sg`: the buffer of
    /// the shared expert gate's logits. With `defer` the combine is not launched but
    /// returned, for the caller's `residual_norm` to compute (the same bits).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn moe(
        &self,
        w: &Moe,
        il: usize,
        io: &Io,
        f: &FfnBufs<'_>,
        sg: u64,
        env: &Env<'_>,
        host_ids: &mut Vec<i32>,
        defer: bool,
    ) -> Result<Option<Combine>, ModelError> {
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
        let Io {
            n,
            e,
            ei,
            tokens,
            rows,
            h,
            o,
            ..
        } = *io;
        let FfnBufs {
            g,
            u,
            sh: shb,
            rl,
            ids,
            ids_buf,
            wts,
            dd,
            chunks,
            nchunks,
        } = *f;
        let stream = &self.stream;
        let (ne, kk) = (*n_expert, *top);
        // A decode step's resident experts: topk_route writes the chunk table itself.
        let chunked = self.fuse && n == 1 && kk <= 32 && self.units.is_none();
        self.mv_rows(&[(router, rl)], rows, h)?;
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
            chunks: if chunked { chunks } else { 0 },
            n_chunks: if chunked { nchunks } else { 0 },
        }
        .launch(self, rows_n(n))?;
        let np = n * kk;
        if self.units.is_some() || env.routing.is_some() {
            host_ids.resize(np, 0);
            stream
                .memcpy_dtoh(&ids_buf.slice(0..np), &mut host_ids[..])
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
            self.mv_rows(&gu, rows, h)?;
            self.glu(g, u, n * sh.gate.rows, sh.act)?;
            self.mv_rows(&[(&sh.down, shb)], rows, g)?;
            if let Some(gate) = &sh.scale {
                self.few(gate, h, sg, rows, n)?;
            }
        }
        let len = np * parts[0].rows;
        if self.units.is_some() {
            // Hits first: their gate / up products run while the misses
            // are read and copied; then the misses', then down for all.
            let PlanFfn::Moe { experts, .. } = &self.plan.layers[il].ffn else {
                unreachable!("the plan's layer kinds match")
            };
            let table = |table: u64, count: u64, chunks: usize| Rows {
                table,
                count,
                chunks,
                ..rows
            };
            let gate_up = |rows: Rows| {
                let gu = [(&parts[0], g), (&parts[1], u)];
                self.mv(&gu, rows, h, kk)
            };
            let lc = self.ensure_units(env, il, host_ids, experts, ne, *tab_index, &mut |lc| {
                gate_up(table(lc.table, lc.counts, lc.hit))
            })?;
            let miss_table = lc.table + (lc.hit * CHUNK_BYTES) as u64;
            gate_up(table(miss_table, lc.counts + 4, lc.miss))?;
            self.glu(g, u, len, *act)?;
            let all = table(lc.table, lc.counts + 8, lc.hit + lc.miss);
            self.mv_rows(&[(&parts[2], dd)], all, g)?;
        } else {
            if !chunked {
                kernels::MoeChunks {
                    gids: ids,
                    n_pairs: np as i32,
                    n_expert: ne as i32,
                    chunks,
                    n_chunks: nchunks,
                }
                .launch(self, (1, 1, 1))?;
            }
            let routed = Rows {
                table: chunks,
                count: nchunks,
                chunks: np / MVG_N + ne.min(np),
                ..rows
            };
            let gu = [(&parts[0], g), (&parts[1], u)];
            self.mv(&gu, routed, h, kk)?;
            self.glu(g, u, len, *act)?;
            self.mv_rows(&[(&parts[2], dd)], routed, g)?;
        }
        let sh_or_null = if shared.is_some() { shb } else { 0 };
        let gated = shared.as_ref().is_some_and(|sh| sh.scale.is_some());
        let sg_or_null = if gated { sg } else { 0 };
        if defer {
            return Ok(Some(Combine {
                d: dd,
                wts,
                sh: sh_or_null,
                sg: sg_or_null,
                k: kk as i32,
            }));
        }
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
        Ok(None)
    }
}

/// The rows `i` of a layer's (token, slot) pairs grouped by the unit `ids[i]` chose, in
/// row order; the keys are the units the layer needs, ascending.
pub(crate) fn rows_by_unit(ids: &[i32]) -> BTreeMap<usize, Vec<usize>> {
    let mut m: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, &u) in ids.iter().enumerate() {
        m.entry(u as usize).or_default().push(i);
    }
    m
}

/// A MoE layer's table for the VRAM unit cache, uploaded in one copy: the counts `[hits,
/// misses, all]` (LAYER_COUNTS_BYTES), then the chunks of the `hits` units, then those of
/// the `misses`, up to MVG_N rows each. Which rows share a chunk never changes a row's
/// bits (each row is computed the same way in any chunk). Returns (bytes, hit, miss).
pub(crate) fn layer_table(
    rows_of: &BTreeMap<usize, Vec<usize>>,
    hits: &[usize],
    misses: &[usize],
) -> (Vec<u8>, usize, usize) {
    let mut out = vec![0u8; LAYER_COUNTS_BYTES];
    let push = |units: &[usize], out: &mut Vec<u8>| {
        let mut n = 0;
        for &u in units {
            for c in rows_of[&u].chunks(MVG_N) {
                push_chunk(out, u, c);
                n += 1;
            }
        }
        n
    };
    let hit = push(hits, &mut out);
    let miss = push(misses, &mut out);
    for (k, v) in [hit, miss, hit + miss].into_iter().enumerate() {
        out[4 * k..4 * k + 4].copy_from_slice(&(v as i32).to_le_bytes());
    }
    (out, hit, miss)
}

pub(crate) fn router_kind(r: &Router) -> RouterKind<'_> {
    let score = |f: ScoreFn| match f {
        ScoreFn::Softmax => 0,
        ScoreFn::Sigmoid => 1,
        ScoreFn::SqrtSoftplus => 2,
    };
    match r {
        Router::Softmax { norm } => RouterKind {
            score: 0,
            bias: None,
            norm: *norm,
            scale: 1.0,
            table: None,
        },
        Router::Biased {
            score: f,
            bias,
            norm,
            scale,
        } => RouterKind {
            score: score(*f),
            bias: Some(&bias[..]),
            norm: *norm,
            scale: *scale,
            table: None,
        },
        Router::Hash {
            table,
            score: f,
            norm,
            scale,
        } => RouterKind {
            score: score(*f),
            bias: None,
            norm: *norm,
            scale: *scale,
            table: Some(&table[..]),
        },
    }
}

impl GpuDecoder {
    /// MoE layer `il`'s experts through the VRAM unit cache, hits first: the units its
    /// (token, slot) rows chose (`ids`) are looked up; the hits' rows of the pointer table
    /// and the layer's chunk table (hits' chunks, then misses') are uploaded and
    /// `launch_hits` queues the hits' products on the compute stream; then the misses are
    /// read through the expert source and copied on the copy stream while those run, and
    /// their rows of the pointer table are written. The caller queues the misses' products
    /// after this returns (the copies are done by then).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ensure_units(
        &self,
        env: &Env<'_>,
        il: usize,
        ids: &[i32],
        stacked: &[Stacked; 3],
        n_expert: usize,
        tab_index: usize,
        launch_hits: &mut dyn FnMut(&LayerChunks) -> Result<(), ModelError>,
    ) -> Result<LayerChunks, ModelError> {
        let stream = &self.stream;
        let rows_of = rows_by_unit(ids);
        let needed: Vec<usize> = rows_of.keys().copied().collect();
        let mut uc = lock(self.units.as_ref().expect("cached placement"));
        let uc = &mut *uc;
        let sizes: Vec<usize> = stacked.iter().map(|s| s.expert_bytes()).collect();
        let unit_bytes: usize = sizes.iter().sum();
        let mut offs = [0usize; 3];
        for pi in 1..3 {
            offs[pi] = offs[pi - 1] + sizes[pi - 1];
        }
        let (mut hit_units, mut misses) = (Vec::new(), Vec::new());
        let scan = uc.is_scan(ids.len(), needed.len(), n_expert);
        for &u in &needed {
            uc.lru.tick();
            let hit = if scan {
                uc.lru.get(&(il, u)).is_some()
            } else {
                uc.lru.touch(&(il, u)).is_some()
            };
            if hit {
                hit_units.push(u);
            } else {
                misses.push(u);
            }
        }
        // The previous layer's kernels are done (its ids were downloaded after them).
        uc.transient.clear();
        // The hits' table rows, the chunk table, then the hits' products.
        let (lo, hi) = (tab_index, tab_index + 3 * n_expert);
        let write_rows = |uc: &mut UnitCache, units: &[usize]| -> Result<(), ModelError> {
            for &u in units {
                let slot = match uc.lru.get(&(il, u)) {
                    Some(e) => e,
                    None => {
                        &uc.transient
                            .iter()
                            .find(|t| t.0 == u)
                            .expect("uploaded above")
                            .1
                    }
                };
                let a = slot.device_ptr(stream).0;
                for (pi, off) in offs.iter().enumerate() {
                    uc.tab[tab_index + pi * n_expert + u] = a + *off as u64;
                }
            }
            let mut ptrs = lock(&self.ptrs);
            stream
                .memcpy_htod(&uc.tab[lo..hi], &mut ptrs.slice_mut(lo..hi))
                .map_err(|e| err("pointer table", e))
        };
        write_rows(uc, &hit_units)?;
        let (table, hit, miss) = layer_table(&rows_of, &hit_units, &misses);
        let base = addr(stream, &mut uc.chunks, table.len())?;
        let dev_chunks = uc.chunks.as_mut().expect("grown");
        stream
            .memcpy_htod(&table[..], &mut dev_chunks.slice_mut(0..table.len()))
            .map_err(|e| err("chunk table", e))?;
        let lc = LayerChunks {
            table: base + LAYER_COUNTS_BYTES as u64,
            counts: base,
            hit,
            miss,
        };
        launch_hits(&lc)?;

        // How many of this layer's units the cache can hold at once; the hits are in it.
        let capacity = (uc.lru.budget() / unit_bytes.max(1) as u64) as usize;
        let mut in_cache = hit_units.len();
        let mut evictions = 0u64;
        let mut transient_bytes = 0u64;
        // Time spent copying (not waiting for the expert source's reads).
        let mut copy_ns = 0u64;
        let (mut uploaded, mut pinned, mut staged) = (0u64, 0u64, 0u64);
        let mut failed: Option<ModelError> = None;
        let copy = &self.copy;
        if !misses.is_empty() {
            let mut ring = uc.staging.ring(&self.d.ctx);
            let walked = env
                .experts
                .for_each_batch(env.map, il, &misses, &mut |batch| {
                    for &(i, view) in batch {
                        let u = misses[i];
                        let keep = in_cache < capacity;
                        if keep {
                            // Least recently used, never a unit this layer uses.
                            let protected =
                                |k: &(usize, usize)| k.0 == il && rows_of.contains_key(&k.1);
                            evictions += uc.lru.make_room(unit_bytes as u64, protected).0;
                        }
                        // SAFETY: every byte of the buffer is written by the copies below
                        // (same stream, in order) before the misses' kernels, queued after
                        // this layer's copies are synchronized, read it.
                        let mut slot = match unsafe { copy.alloc::<u8>(unit_bytes) } {
                            Ok(s) => s,
                            Err(e) => {
                                failed = Some(err("expert slot", e));
                                return Err(Stop);
                            }
                        };
                        let mut off = 0;
                        let c0 = std::time::Instant::now();
                        for (pi, &len) in sizes.iter().enumerate() {
                            let src = view.part(pi);
                            if src.len() != len {
                                failed = Some(ModelError::Compute(format!(
                                    "cuda: layer {il} unit {u} part {pi}: {} bytes, expected {len}",
                                    src.len()
                                )));
                                return Err(Stop);
                            }
                            let from_pinned = self.d.host().covers(src.as_ptr() as usize, len);
                            let sent = match ring.as_deref_mut() {
                                Some(r) if !from_pinned => {
                                    staged += len as u64;
                                    let base = slot.device_ptr(copy).0;
                                    // SAFETY: `src` stays readable until this batch's flush
                                    // below (the views live until this closure returns, and
                                    // the ring is abandoned after the walk); the part's
                                    // bytes lie inside the slot, one allocation made on the
                                    // copy stream, which sends the ring.
                                    unsafe { r.stage(copy, src, base, off) }
                                }
                                _ => {
                                    if from_pinned {
                                        pinned += len as u64;
                                    }
                                    copy.memcpy_htod(src, &mut slot.slice_mut(off..off + len))
                                        .map_err(|e| e.to_string())
                                }
                            };
                            if let Err(e) = sent {
                                failed = Some(err("expert upload", e));
                                return Err(Stop);
                            }
                            off += len;
                        }
                        copy_ns += c0.elapsed().as_nanos() as u64;
                        uploaded += unit_bytes as u64;
                        if keep {
                            in_cache += 1;
                            if scan {
                                uc.lru.insert_cold((il, u), slot, unit_bytes as u64);
                            } else {
                                uc.lru.insert((il, u), slot, unit_bytes as u64);
                            }
                        } else {
                            transient_bytes += unit_bytes as u64;
                            uc.transient.push((u, slot));
                        }
                    }
                    // The views are released when this returns: their copies must be done
                    // (the hits' products keep running on the compute stream meanwhile).
                    let c0 = std::time::Instant::now();
                    if let Some(Err(e)) = ring.as_deref_mut().map(|r| r.flush(copy)) {
                        failed = Some(err("expert upload", e));
                        return Err(Stop);
                    }
                    if let Err(e) = copy.synchronize() {
                        failed = Some(err("expert upload", e));
                        return Err(Stop);
                    }
                    copy_ns += c0.elapsed().as_nanos() as u64;
                    Ok(())
                });
            if let Some(r) = ring {
                r.abandon();
            }
            if let Some(e) = failed {
                return Err(e);
            }
            walked?;
            write_rows(uc, &misses)?;
        }
        let peak = uc.lru.held();
        let ring_bytes = uc.staging.bytes();
        let mut g = self.d.lock();
        let s = &mut g.stats;
        s.expert_hits += hit_units.len() as u64;
        s.expert_misses += misses.len() as u64;
        s.expert_evictions += evictions;
        s.expert_upload_bytes += uploaded - transient_bytes;
        s.transient_bytes += transient_bytes;
        s.upload_bytes += uploaded;
        s.upload_pinned_bytes += pinned;
        s.upload_staged_bytes += staged;
        s.staging_bytes = ring_bytes;
        s.expert_bytes = peak;
        s.expert_peak = s.expert_peak.max(peak);
        s.upload_ns += copy_ns;
        Ok(lc)
    }
}

impl Uploader<'_> {
    /// Upload a MoE layer: its router, the routed experts' pointer-table entries (and
    /// their bytes when `experts` is resident), its shared expert.
    pub(crate) fn moe(
        &mut self,
        moe: &MoeWeights,
        st: &[Stacked; 3],
        shared: &Option<Box<PlanShared>>,
        experts: ExpertPlacement,
    ) -> Result<Moe, String> {
        let (router_w, n_expert, k, act) = (&moe.router_w, &moe.n_expert, &moe.k, &moe.act);
        let rk = router_kind(&moe.router);
        let router = self.mat(router_w)?;
        let tab_index = self.tab.len();
        let mut parts = Vec::with_capacity(3);
        for (pi, s) in st.iter().enumerate() {
            let base = match experts {
                ExpertPlacement::Resident => Some(self.bytes(&self.map[s.range.clone()])?),
                ExpertPlacement::Cached => None,
            };
            for e in 0..*n_expert {
                self.tab
                    .push(base.map_or(0, |b| b + (e * s.slice_bytes() + s.sub.start) as u64));
            }
            parts.push(DMat {
                tab: tab_index + pi * n_expert,
                fi: kernel_format(s.ty, s.cols).expect("checked"),
                rows: s.rows,
                cols: s.cols,
                row_bytes: s.ty.row_bytes(s.cols as u64).expect("checked") as i64,
            });
        }
        let shared = match shared {
            Some(sh) => Some(Box::new(DShared {
                gate: self.mat(&sh.w.gate)?,
                up: self.mat(&sh.w.up)?,
                down: self.mat(&sh.w.down)?,
                act: act_id(sh.act),
                scale: sh.gate.as_ref().map(|g| self.few(g)).transpose()?,
            })),
            None => None,
        };
        let bias = match rk.bias {
            Some(b) => self.norm(b)?,
            None => 0,
        };
        let table = match rk.table {
            Some(t) => {
                let v: Vec<i32> = t.iter().map(|&x| x as i32).collect();
                self.ints(&v)?
            }
            None => 0,
        };
        Ok(Moe {
            router,
            norm: rk.norm,
            score: rk.score,
            bias,
            scale: rk.scale,
            table,
            shared,
            n_expert: *n_expert,
            k: *k,
            parts: [parts[0], parts[1], parts[2]],
            tab_index,
            act: act_id(*act),
        })
    }
}

/// What `topk_route` refuses of a hashed router: a table that is not `n_vocab` rows of
/// `k` distinct experts. The reason when not.
pub(crate) fn check_hash_tables(plan: &DecoderPlan) -> Result<(), String> {
    for (il, l) in plan.layers.iter().enumerate() {
        if let PlanFfn::Moe { moe, .. } = &l.ffn {
            if let Some(t) = router_kind(&moe.router).table {
                // A token's k experts must be distinct: the grouped products give a
                // chunk at most one row per token (the decode kernel's 8-row tile).
                let distinct =
                    |row: &[u32]| row.iter().enumerate().all(|(i, x)| !row[..i].contains(x));
                if t.len() != plan.n_vocab * moe.k
                    || t.iter().any(|&x| x as usize >= moe.n_expert)
                    || !t.chunks(moe.k.max(1)).all(distinct)
                {
                    return Err(format!(
                        "layer {il}: a hash router table of {} entries for {} tokens x top-{} of {} distinct experts",
                        t.len(),
                        plan.n_vocab,
                        moe.k,
                        moe.n_expert
                    ));
                }
            }
        }
    }
    Ok(())
}

/// What the MoE kernels refuse: more than [`MAX_EXPERTS`] experts, a top-k outside
/// 1..=n_expert, a router bias of the wrong length, experts in a format with no product
/// kernel. The reason when not.
pub(crate) fn check(plan: &DecoderPlan) -> Result<(), String> {
    let kernel = |ty: sluice_kernels::GgmlType, cols: usize, what: &str| {
        kernel_format(ty, cols)
            .map(|_| ())
            .ok_or_else(|| format!("{what}: {ty:?} with {cols} columns has no GPU kernel"))
    };
    for (il, l) in plan.layers.iter().enumerate() {
        match &l.ffn {
            PlanFfn::Dense { .. } => {}
            PlanFfn::Moe { moe, experts, .. } => {
                let (n_expert, k) = (&moe.n_expert, &moe.k);
                if *n_expert > MAX_EXPERTS || *k == 0 || k > n_expert {
                    return Err(format!("layer {il}: top-{k} of {n_expert} experts"));
                }
                if let Some(bias) = router_kind(&moe.router).bias {
                    if bias.len() != *n_expert {
                        return Err(format!(
                            "layer {il}: a router bias of {} values for {n_expert} experts",
                            bias.len()
                        ));
                    }
                }
                for s in experts {
                    kernel(s.ty, s.cols, &format!("layer {il} experts"))?;
                }
            }
        }
    }
    Ok(())
}

/// What `moe_combine` refuses of layer `il`'s shared expert gate: one not `[1, n_embd]`.
/// The reason when not.
pub(crate) fn check_shared_gate(
    plan: &DecoderPlan,
    il: usize,
    l: &PlanLayer,
) -> Result<(), String> {
    let e = plan.n_embd;
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
    Ok(())
}
