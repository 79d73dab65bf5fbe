//! Qwen3.8-Flash-Next (`qwen4exp`), as llama.cpp's converter writes it: 4 low-rank
//! hyper-connection streams in place of every norm, Gated DeltaNet layers and QSA
//! indexed-attention layers (every `full_attention_interval`-th), softmax top-k MoE with
//! a sigmoid-gated shared expert, and one hashed n-gram PLE layer whose big table can stay
//! on disk (a [`RowTable`] group, read through a [`PleRows`] source).
//!
//! Reference: transformers `Qwen4ExpForCausalLM` (../shared/models/qwen4exp.md). Where the
//! converter's file and transformers disagree:
//! - `attention.compress_ratios` all zero (the converter's bug, spec section 4 item 3):
//!   sluice restores the ratio [`DEFAULT_RATIO`] on every attention layer, as transformers
//!   runs the model, and says so once at load. A file with any non-zero ratio is used as
//!   written (ratio 0 on an attention layer = dense causal attention, as llama.cpp).
//! - GDN output gate: sigmoid (the real config; llama.cpp hard-codes it; the file has no key).
//!
//! The CPU runs its [`DecoderPlan`] (`crate::decoder::CpuDecoder`, whose state holds the
//! DeltaNet, QSA and PLE states; `set_row_source` swaps the PLE rows the plan reads).

use std::sync::Arc;

use sluice_gguf::{GgmlType, GgufFile};
use sluice_io::MappedFile;
use sluice_kernels::dequantize_row;
use sluice_tier::{RowTable, StreamableGroups};

use super::Architecture;
use crate::blocks::attention::AttnShape;
use crate::blocks::deltanet::{DeltaShape, DeltaWeights};
use crate::blocks::ffn::{Activation, GluWeights};
use crate::blocks::hyper_lowrank::HcWeights;
use crate::blocks::moe::{expert_group, link_lookahead, MoeWeights, Router, UnitMat};
use crate::blocks::ple::{NgramHash, PleRows, PleWeights, TierRows};
use crate::blocks::qsa::{QsaShape, QsaWeights};
use crate::config::{Hparams, ModelConfig};
use crate::kv::KvCache;
use crate::ops::rope_inv_freq;
use crate::plan::{DecoderPlan, PlanAttn, PlanFfn, PlanLayer, PlanLowRank, PlanPle, PlanShared};
use crate::state::SeqState;
use crate::weights::{Mat, Stacked, Tensors};
use crate::ModelError;

const NAME: &str = "qwen4exp";
/// The compression ratio restored on a file whose ratios are all zero (the real model's).
pub const DEFAULT_RATIO: usize = 4;
/// The PLE table's tensor.
pub const PLE_TABLE: &str = "per_layer_token_embd.weight";

enum Mixer {
    Delta(Box<DeltaWeights>),
    Qsa(Box<QsaWeights>, QsaShape),
}

struct Layer {
    hc_attn: HcWeights,
    hc_ffn: HcWeights,
    mixer: Mixer,
    moe: MoeWeights,
    experts: [Stacked; 3],
    shared: GluWeights,
    /// `[1, E]`
    shared_gate: Mat,
    ple: Option<PleWeights>,
}

/// The PLE table inside the mapped file, read row by row (the default source).
#[derive(Debug, Clone)]
pub struct MappedPleTable {
    pub ty: GgmlType,
    /// Absolute file offset of row 0.
    pub start: usize,
    pub row_bytes: usize,
    pub width: usize,
    pub n_rows: u64,
}

impl PleRows for MappedPleTable {
    fn gather(&self, map: &[u8], ids: &[u64], out: &mut [f32]) -> Result<(), ModelError> {
        for (&id, row) in ids.iter().zip(out.chunks_mut(self.width)) {
            if id >= self.n_rows {
                return Err(ModelError::Compute(format!(
                    "PLE row {id} is outside the table ({} rows)",
                    self.n_rows
                )));
            }
            let s = self.start + id as usize * self.row_bytes;
            dequantize_row(self.ty, &map[s..s + self.row_bytes], row)?;
        }
        Ok(())
    }
}

pub struct Qwen4Exp {
    cfg: ModelConfig,
    n_stream: usize,
    rms_eps: f32,
    delta: DeltaShape,
    rope: Vec<f32>,
    n_head_kv: usize,
    head_dim: usize,
    token_embd: Mat,
    output_hc: HcWeights,
    output: Mat,
    layers: Vec<Layer>,
    hash: Option<NgramHash>,
    table: Option<MappedPleTable>,
    rows: Option<Arc<dyn PleRows>>,
    /// What load decided and wants said once (e.g. restored compress ratios).
    pub notes: Vec<String>,
}

fn array_u64(hp: &Hparams<'_>, k: &str) -> Result<Option<Vec<u64>>, ModelError> {
    let key = format!("{NAME}.{k}");
    let Some(v) = hp.file.get(&key) else {
        return Ok(None);
    };
    let a = v
        .as_array()
        .ok_or_else(|| hp.bad(format!("{key} must be an array")))?;
    a.values
        .iter()
        .map(|x| {
            x.as_u64()
                .or_else(|| x.as_bool().map(u64::from))
                .ok_or_else(|| hp.bad(format!("{key} must hold integers >= 0")))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn hc(
    t: &Tensors<'_>,
    p: &str,
    d: usize,
    r: usize,
    s: usize,
    inject: bool,
) -> Result<HcWeights, ModelError> {
    Ok(HcWeights {
        norm: t.vec(&format!("{p}_norm.weight"), d)?,
        down: t.mat(&format!("{p}_down.weight"), r, d)?,
        up: t.mat(&format!("{p}_up.weight"), d, r)?,
        inject: if inject {
            Some(t.mat(&format!("{p}_inject.weight"), s, d)?)
        } else {
            None
        },
    })
}

/// The shared expert's gate: `{E}` or `{E, 1}` (both spellings occur).
fn shared_gate(t: &Tensors<'_>, name: &str, e: usize) -> Result<Mat, ModelError> {
    let info = t.info(name)?;
    if info.dims.len() == 1 && info.dims[0] as usize == e {
        t.check_type(name, info.ty)?;
        return Ok(Mat {
            ty: info.ty,
            rows: 1,
            cols: e,
            range: t.range(info),
        });
    }
    t.mat(name, 1, e)
}

pub fn load(file: &GgufFile, map: &MappedFile) -> Result<Box<dyn Architecture>, ModelError> {
    let a = load_qwen4exp(file, map)?;
    for n in &a.notes {
        eprintln!("note: {n}");
    }
    Ok(Box::new(a))
}

/// Which of the `n_layer` layers are recurrent (DeltaNet): `attention.recurrent_layers`,
/// else every layer but each `full_attention_interval`-th (default 4).
fn recurrent_layers(hp: &Hparams<'_>, n_layer: usize) -> Result<Vec<bool>, ModelError> {
    Ok(match array_u64(hp, "attention.recurrent_layers")? {
        Some(v) if v.len() >= n_layer => v[..n_layer].iter().map(|&x| x != 0).collect(),
        Some(v) => {
            return Err(hp.bad(format!(
                "attention.recurrent_layers has {} entries, {n_layer} layers",
                v.len()
            )))
        }
        None => {
            let iv = hp.u_or("full_attention_interval", 4)?.max(1);
            (0..n_layer).map(|i| (i + 1) % iv != 0).collect()
        }
    })
}

/// The PLE layer `pl` (a recurrent layer below `n_layer`): its n-gram hash constants
/// (`ple.*`) and the table's place in the file, checked against each other and the
/// embedding width `e`.
fn load_ple(
    hp: &Hparams<'_>,
    t: &Tensors<'_>,
    pl: usize,
    n_layer: usize,
    recurrent: &[bool],
    e: usize,
) -> Result<(NgramHash, MappedPleTable), ModelError> {
    if pl >= n_layer || !recurrent[pl] {
        return Err(hp.bad(format!(
            "PLE layer {pl} must be a recurrent layer < {n_layer}"
        )));
    }
    let ngram = hp.u("ple.ngram_size")?;
    let hpn = hp.u("ple.heads_per_ngram")?;
    let need = |k: &str, n: usize| -> Result<Vec<u64>, ModelError> {
        let v = array_u64(hp, k)?.ok_or_else(|| hp.bad(format!("{NAME}.{k} is missing")))?;
        if v.len() < n {
            return Err(hp.bad(format!("{NAME}.{k} has {} entries, {n} needed", v.len())));
        }
        Ok(v[..n].to_vec())
    };
    if ngram < 2 {
        return Err(hp.bad("ple.ngram_size must be >= 2".into()));
    }
    let nh = (ngram - 1) * hpn;
    let h = NgramHash {
        ngram,
        heads_per_ngram: hpn,
        eos: hp.u("ple.eos_token_id")? as u32,
        multipliers: need("ple.layer_multipliers", ngram)?,
        offsets: need("ple.head_offsets", nh)?,
        vocab_sizes: need("ple.head_vocab_sizes", nh)?,
    };
    let info = t.info(PLE_TABLE)?;
    if info.dims.len() != 2 {
        return Err(t.bad(
            PLE_TABLE,
            format!("expected shape [width, rows], found {:?}", info.dims),
        ));
    }
    let width = info.dims[0] as usize;
    let n_rows = info.dims[1];
    t.check_type(PLE_TABLE, info.ty)?;
    if width * nh != e {
        return Err(hp.bad(format!(
            "PLE rows of {width} x {nh} heads != embedding_length {e}"
        )));
    }
    let max = (0..nh)
        .map(|i| h.offsets[i].saturating_add(h.vocab_sizes[i]))
        .max()
        .unwrap_or(0);
    if h.vocab_sizes.contains(&0) || max > n_rows {
        return Err(hp.bad(format!(
            "PLE head offsets + sizes reach {max}, the table has {n_rows} rows"
        )));
    }
    let range = t.range(info);
    let table = MappedPleTable {
        ty: info.ty,
        start: range.start,
        row_bytes: info.ty.row_bytes(width as u64).unwrap_or(0) as usize,
        width,
        n_rows,
    };
    Ok((h, table))
}

/// Load with the concrete type (tests and the PLE source setter use it).
pub fn load_qwen4exp(file: &GgufFile, map: &MappedFile) -> Result<Qwen4Exp, ModelError> {
    let hp = Hparams::new(file, NAME);
    let e = hp.u("embedding_length")?;
    // Files with the MTP draft layer inside (`nextn_predict_layers`, e.g. ds4's and the
    // GSQ-RCO repackaging) count it in block_count; the main model is the layers before it.
    let n_block = hp.block_count()?;
    let n_mtp = hp.u_or("nextn_predict_layers", 0)?;
    if n_mtp >= n_block {
        return Err(hp.bad(format!(
            "nextn_predict_layers {n_mtp} >= block_count {n_block}"
        )));
    }
    let n_layer = n_block - n_mtp;
    let n_ctx_train = hp.context_length(262_144)?;
    hp.no_rope_scaling()?;
    let n_head = hp.u("attention.head_count")?;
    let n_head_kv = hp.u_or("attention.head_count_kv", n_head)?;
    let head_dim = hp.u_or("attention.key_length", 256)?;
    let rms_eps = hp.f_or("attention.layer_norm_rms_epsilon", 1e-6)?;
    let rope_base = hp.f_or("rope.freq_base", 10_000_000.0)?;
    let n_rot = hp.u_or("rope.dimension_count", head_dim)?;
    let n_expert = hp.u("expert_count")?;
    let k = hp.u("expert_used_count")?;
    let s = hp.u("hyper_connection.count")?;
    let r = hp.u("hyper_connection.low_rank")?;
    let idx_heads = hp.u("attention.indexer.head_count")?;
    let idx_dim = hp.u("attention.indexer.key_length")?;
    let budget = hp.positions("attention.indexer.top_k", None, n_ctx_train)?;
    if budget == 0 {
        // (0 would also let any compress ratio "divide" it)
        return Err(hp.bad(format!("{NAME}.attention.indexer.top_k must be > 0")));
    }
    if n_layer == 0 || e == 0 || s < 2 || r == 0 {
        return Err(hp.bad(
            "block_count, embedding_length, hyper_connection.* must be > 0 (count > 1)".into(),
        ));
    }
    super::check_attention(&hp, n_head, n_head_kv, head_dim, rms_eps, rope_base)?;
    if n_rot == 0 || !n_rot.is_multiple_of(2) || n_rot > head_dim || n_rot > idx_dim {
        return Err(hp.bad(format!(
            "rope.dimension_count {n_rot} must be even, > 0 and fit key_length {head_dim} and the indexer's {idx_dim}"
        )));
    }
    if n_expert == 0 || k == 0 || k > n_expert {
        return Err(hp.bad(format!(
            "expert_used_count {k} must be in 1..=expert_count {n_expert}"
        )));
    }
    let recurrent = recurrent_layers(&hp, n_layer)?;
    let mut notes = Vec::new();
    let mut ratios: Vec<usize> = match array_u64(&hp, "attention.compress_ratios")? {
        Some(v) if v.len() >= n_layer => v[..n_layer].iter().map(|&x| x as usize).collect(),
        Some(v) => {
            return Err(hp.bad(format!(
                "attention.compress_ratios has {} entries, {n_layer} layers",
                v.len()
            )))
        }
        None => vec![0; n_layer],
    };
    if ratios.iter().all(|&x| x == 0) {
        for (i, rr) in ratios.iter_mut().enumerate() {
            if !recurrent[i] {
                *rr = DEFAULT_RATIO;
            }
        }
        notes.push(format!(
            "qwen4exp: attention.compress_ratios are all 0 (a known llama.cpp converter bug); \
             using ratio {DEFAULT_RATIO} on every attention layer as transformers does \
             (llama.cpp runs such a file with dense attention: differs past {budget} tokens)"
        ));
    }
    for (i, &rr) in ratios.iter().enumerate() {
        if rr > 0 && (recurrent[i] || !budget.is_multiple_of(rr)) {
            return Err(hp.bad(format!("layer {i}: compress ratio {rr} on a recurrent layer or not dividing top_k {budget}")));
        }
    }
    let delta = DeltaShape {
        n_k_heads: hp.u("ssm.group_count")?,
        n_v_heads: hp.u("ssm.time_step_rank")?,
        d_k: hp.u("ssm.state_size")?,
        d_v: hp.u("ssm.state_size")?,
        conv_kernel: hp.u("ssm.conv_kernel")?,
        rms_eps,
        gate_sigmoid: true,
    };
    if delta.n_k_heads == 0
        || !delta.n_v_heads.is_multiple_of(delta.n_k_heads)
        || delta.conv_kernel < 1
        || hp.u("ssm.inner_size")? != delta.n_v_heads * delta.d_v
    {
        return Err(hp.bad("ssm.* shapes are inconsistent".into()));
    }
    // PLE.
    let ple_layers: Vec<usize> = array_u64(&hp, "ple.layers")?
        .unwrap_or_default()
        .into_iter()
        .map(|x| x as usize)
        .collect();
    if ple_layers.len() > 1 {
        return Err(hp.bad("more than one PLE layer (one set of hash constants per file)".into()));
    }
    let t = Tensors::new(file, map);
    let n_vocab = hp.n_vocab()?;
    let (hash, table) = match ple_layers.first() {
        Some(&pl) => {
            let (h, table) = load_ple(&hp, &t, pl, n_layer, &recurrent, e)?;
            (Some(h), Some(table))
        }
        None => (None, None),
    };

    let d = s * e;
    let mut layers = Vec::with_capacity(n_layer);
    let mut n_qsa = 0;
    for il in 0..n_layer {
        let n = |x: &str| format!("blk.{il}.{x}.weight");
        let [gate, up, down] = t.glu_experts(il, e, None, n_expert)?;
        let shared = GluWeights::load(&t, il, "_shexp", e, None)?;
        let mixer = if recurrent[il] {
            let cd = delta.conv_dim();
            let hv = delta.n_v_heads;
            Mixer::Delta(Box::new(DeltaWeights {
                qkv: t.mat(&n("attn_qkv"), cd, e)?,
                gate: t.mat(&n("attn_gate"), hv * delta.d_v, e)?,
                beta: t.mat(&n("ssm_beta"), hv, e)?,
                alpha: t.mat(&n("ssm_alpha"), hv, e)?,
                conv: t.vec_shaped(&n("ssm_conv1d"), &[delta.conv_kernel, cd])?,
                dt_bias: t.vec(&format!("blk.{il}.ssm_dt.bias"), hv)?,
                a: t.vec(&format!("blk.{il}.ssm_a"), hv)?,
                norm: t.vec(&n("ssm_norm"), delta.d_v)?,
                out: t.mat(&n("ssm_out"), e, hv * delta.d_v)?,
            }))
        } else {
            n_qsa += 1;
            Mixer::Qsa(
                Box::new(QsaWeights {
                    wq: t.mat(&n("attn_q"), n_head * 2 * head_dim, e)?,
                    wk: t.mat(&n("attn_k"), n_head_kv * head_dim, e)?,
                    wv: t.mat(&n("attn_v"), n_head_kv * head_dim, e)?,
                    wo: t.mat(&n("attn_output"), e, n_head * head_dim)?,
                    q_norm: t.vec(&n("attn_q_norm"), head_dim)?,
                    k_norm: t.vec(&n("attn_k_norm"), head_dim)?,
                    idx_q: t.mat(&n("indexer.q_proj"), idx_heads * idx_dim, e)?,
                    idx_k: t.mat(&n("indexer.k_proj"), idx_dim, e)?,
                    idx_q_norm: t.vec(&n("indexer.q_norm"), idx_dim)?,
                    idx_k_norm: t.vec(&n("indexer.k_norm"), idx_dim)?,
                }),
                QsaShape {
                    n_head,
                    n_head_kv,
                    head_dim,
                    n_rot,
                    idx_heads,
                    idx_dim,
                    budget,
                    ratio: ratios[il],
                    rms_eps,
                },
            )
        };
        let ple = if ple_layers.first() == Some(&il) {
            let kernel = hp.u_or("ple.conv_kernel", 4)?.max(1);
            let ngram = hash.as_ref().map_or(3, |h| h.ngram);
            Some(PleWeights {
                key: t.mat(&n("ple_key"), d, e)?,
                value: t.mat(&n("ple_value"), e, e)?,
                norm_key: t.vec(&n("ple_norm_key"), d)?,
                norm_query: t.vec(&n("ple_norm_query"), d)?,
                norm_conv: t.vec(&n("ple_norm_conv"), d)?,
                conv: t.vec_shaped(&n("ple_conv1d"), &[kernel, d])?,
                kernel,
                dilation: ngram,
            })
        } else {
            None
        };
        layers.push(Layer {
            hc_attn: hc(&t, &format!("blk.{il}.hc_attn"), d, r, s, true)?,
            hc_ffn: hc(&t, &format!("blk.{il}.hc_ffn"), d, r, s, true)?,
            mixer,
            moe: MoeWeights {
                router_w: t.mat(&n("ffn_gate_inp"), n_expert, e)?,
                router: Router::Softmax {
                    norm: hp.b_or("expert_weights_norm", true)?,
                },
                n_expert,
                k,
                gate: UnitMat::from(&gate),
                up: UnitMat::from(&up),
                down: UnitMat::from(&down),
                act: Activation::Silu,
                next: None,
            },
            experts: [gate, up, down],
            shared,
            shared_gate: shared_gate(&t, &n("ffn_gate_inp_shexp"), e)?,
            ple,
        });
    }
    // The MoE input norm is inside the hyper-connection pre-step: no per-channel rescale.
    link_lookahead(
        layers
            .iter_mut()
            .enumerate()
            .map(|(il, l)| (il, &mut l.moe, &[][..])),
    );
    let (token_embd, output) = t.embd_and_output(n_vocab, e)?;
    let cfg = ModelConfig {
        arch: NAME,
        n_layer,
        n_embd: e,
        n_vocab,
        n_ctx_train,
        n_expert,
        n_expert_used: k,
        kv_bytes_per_pos: (n_qsa * (2 * n_head_kv * head_dim + idx_dim) * 4) as u64,
        // DeltaNet conv + recurrent state per layer (the PLE layer's short conv history is
        // not counted).
        state_bytes: ((n_layer - n_qsa) * delta.state_bytes()) as u64,
    };
    let rows: Option<Arc<dyn PleRows>> = table.clone().map(|x| Arc::new(x) as Arc<dyn PleRows>);
    Ok(Qwen4Exp {
        cfg,
        n_stream: s,
        rms_eps,
        delta,
        rope: rope_inv_freq(n_rot, rope_base, 1.0),
        n_head_kv,
        head_dim,
        token_embd,
        output_hc: hc(&t, "output_hc", d, r, s, false)?,
        output,
        layers,
        hash,
        table,
        rows,
        notes,
    })
}

impl Qwen4Exp {
    /// The PLE table in the file (None when the model has no PLE layer).
    pub fn ple_table(&self) -> Option<&MappedPleTable> {
        self.table.as_ref()
    }

    /// The hash constants (None when the model has no PLE layer).
    pub fn ple_hash(&self) -> Option<&NgramHash> {
        self.hash.as_ref()
    }

    /// Read PLE rows through `rows` instead of the mapped file.
    pub fn set_ple_rows(&mut self, rows: Arc<dyn PleRows>) {
        self.rows = Some(rows);
    }
}

impl Architecture for Qwen4Exp {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn set_row_source(&mut self, name: &str, src: Arc<dyn sluice_tier::PleSource>) -> bool {
        match &self.table {
            Some(tb) if name == PLE_TABLE => {
                self.rows = Some(Arc::new(TierRows {
                    src,
                    ty: tb.ty,
                    width: tb.width,
                    row_bytes: tb.row_bytes,
                }));
                true
            }
            _ => false,
        }
    }

    fn groups(&self) -> StreamableGroups {
        StreamableGroups {
            experts: expert_group(
                self.cfg.n_expert,
                self.layers.iter().map(|l| Some(&l.experts)),
                &[],
            ),
            row_tables: self
                .table
                .iter()
                .map(|tb| RowTable {
                    name: PLE_TABLE.to_string(),
                    start: tb.start as u64,
                    row_bytes: tb.row_bytes as u64,
                    n_rows: tb.n_rows,
                })
                .collect(),
        }
    }

    /// The model as a plan: low-rank hyper-connection mixers in place of the norms, Gated
    /// DeltaNet and QSA layers, softmax MoE with the sigmoid-gated shared expert, the PLE
    /// layer through the current row source (`PlanPle`).
    fn plan(&self) -> DecoderPlan {
        let layers = self
            .layers
            .iter()
            .map(|l| PlanLayer {
                hc_lowrank: Some(Box::new([l.hc_attn.clone(), l.hc_ffn.clone()])),
                ple: l.ple.clone().map(Box::new),
                // The mixers normalise: no norms.
                ..PlanLayer::new(
                    Vec::new(),
                    match &l.mixer {
                        Mixer::Delta(w) => PlanAttn::Delta {
                            w: w.clone(),
                            shape: self.delta,
                        },
                        Mixer::Qsa(w, sh) => PlanAttn::Qsa {
                            w: w.clone(),
                            shape: *sh,
                            inv_freq: self.rope.clone(),
                        },
                    },
                    Vec::new(),
                    PlanFfn::moe(
                        &l.moe,
                        &l.experts,
                        Some(PlanShared {
                            gate: Some(l.shared_gate.clone()),
                            ..PlanShared::new(l.shared.clone(), Activation::Silu)
                        }),
                    ),
                )
            })
            .collect();
        let qsa = self.layers.iter().find_map(|l| match &l.mixer {
            Mixer::Qsa(_, sh) => Some(*sh),
            Mixer::Delta(_) => None,
        });
        // The QSA layers' attention as a kernel would see it (without one, as many query
        // heads as KV heads: a consistent shape nothing attends with).
        let shape = AttnShape {
            n_head: qsa.map_or(self.n_head_kv, |q| q.n_head),
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
            rms_eps: self.rms_eps,
        };
        DecoderPlan {
            lowrank: Some(PlanLowRank {
                n_stream: self.n_stream,
                head: self.output_hc.clone(),
            }),
            ple: match (&self.hash, &self.rows) {
                (Some(hash), Some(rows)) => Some(PlanPle {
                    hash: hash.clone(),
                    rows: rows.clone(),
                }),
                _ => None,
            },
            // The output mixer normalises: no output norm.
            ..DecoderPlan::new(
                &self.cfg,
                shape,
                self.token_embd.clone(),
                Vec::new(),
                self.output.clone(),
                layers,
            )
        }
    }

    fn new_state(&self, n_ctx: usize) -> SeqState {
        // QSA layers' keys and values in the KV cache; the DeltaNet, QSA and PLE states live
        // in the CPU decoder's state (`Model::new_state`).
        let kvd = self.n_head_kv * self.head_dim;
        SeqState::new(KvCache::new(self.cfg.n_layer, kvd, kvd, n_ctx))
    }
}
