//! The model's tensors, located in the mapped GGUF file.
//!
//! Owns: finding each tensor the architectures need by its llama.cpp name, checking its
//! type and shape, and handing out zero-copy byte slices. Small F32 vectors (norms) are
//! copied out once at load time; matrices stay in the map.

use std::ops::Range;
use std::path::Path;

use sluice_gguf::{GgmlType, GgufFile, TensorInfo};
use sluice_io::MappedFile;

use super::config::{Arch, ModelConfig};
use crate::EngineError;

/// A 2-D weight matrix `[rows, cols]` (ggml dims `[cols, rows]`) inside the file.
#[derive(Debug, Clone)]
pub struct Mat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub range: Range<usize>,
}

/// A stacked 3-D expert tensor `[n_expert, rows, cols]` (ggml dims `[cols, rows, n_expert]`).
#[derive(Debug, Clone)]
pub struct Stacked {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n_expert: usize,
    pub range: Range<usize>,
}

impl Stacked {
    /// Bytes of one expert's slice.
    pub fn expert_bytes(&self) -> usize {
        (self.range.end - self.range.start) / self.n_expert
    }

    /// Absolute file range of expert `e`.
    pub fn expert_range(&self, e: usize) -> Range<usize> {
        let n = self.expert_bytes();
        let start = self.range.start + e * n;
        start..start + n
    }
}

/// The routed experts of one MoE layer.
#[derive(Debug, Clone)]
pub struct ExpertTensors {
    /// `[n_expert, n_ff_exp, n_embd]`
    pub gate: Stacked,
    /// `[n_expert, n_ff_exp, n_embd]`
    pub up: Stacked,
    /// `[n_expert, n_embd, n_ff_exp]`
    pub down: Stacked,
}

/// The feed-forward half of a layer.
#[derive(Debug, Clone)]
pub enum Ffn {
    /// Gemma 3: `down(gelu(gate x) * up x)`.
    Dense { gate: Mat, up: Mat, down: Mat },
    /// Qwen3 MoE: softmax router over `router` (`[n_expert, n_embd]`), top-k SwiGLU experts.
    Moe { router: Mat, experts: ExpertTensors },
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// `[n_head * head_dim, n_embd]`
    pub wq: Mat,
    /// `[n_head_kv * head_dim, n_embd]`
    pub wk: Mat,
    /// `[n_head_kv * head_dim_v, n_embd]`
    pub wv: Mat,
    /// `[n_embd, n_head * head_dim_v]`
    pub wo: Mat,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// Gemma 3 only: norm applied to the attention output before the residual add.
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// Gemma 3 only: norm applied to the FFN output before the residual add.
    pub post_ffn_norm: Option<Vec<f32>>,
    pub ffn: Ffn,
}

/// Every tensor of a model, plus the mapped file they live in.
pub struct Weights {
    pub map: MappedFile,
    /// `[n_vocab, n_embd]`
    pub token_embd: Mat,
    pub output_norm: Vec<f32>,
    /// `[n_vocab, n_embd]`; the token embedding when the model ties them.
    pub output: Mat,
    pub layers: Vec<Layer>,
}

impl Weights {
    /// The bytes of a matrix.
    pub fn bytes(&self, m: &Mat) -> &[u8] {
        &self.map.bytes()[m.range.clone()]
    }

    /// Map `path` and locate every tensor `cfg` needs.
    pub fn load(path: &Path, file: &GgufFile, cfg: &ModelConfig) -> Result<Weights, EngineError> {
        let map = MappedFile::open(path)?;
        if (map.bytes().len() as u64) < file.file_size {
            return Err(EngineError::BadTensor {
                path: path.to_path_buf(),
                name: "(file)".into(),
                what: format!(
                    "file shrank while loading: {} bytes mapped, {} expected",
                    map.bytes().len(),
                    file.file_size
                ),
            });
        }
        let (token_embd, output_norm, output, layers) = {
            let t = Loader { file, map: &map };
            Self::locate(&t, file, cfg)?
        };
        Ok(Weights {
            map,
            token_embd,
            output_norm,
            output,
            layers,
        })
    }

    /// Every tensor `cfg` needs: (token_embd, output_norm, output, layers).
    fn locate(
        t: &Loader<'_>,
        file: &GgufFile,
        cfg: &ModelConfig,
    ) -> Result<(Mat, Vec<f32>, Mat, Vec<Layer>), EngineError> {
        let (e, hd, hdv) = (cfg.n_embd, cfg.head_dim, cfg.head_dim_v);
        let token_embd = t.mat("token_embd.weight", cfg.n_vocab, e)?;
        let output = match file.tensor("output.weight") {
            Some(_) => t.mat("output.weight", cfg.n_vocab, e)?,
            None => token_embd.clone(),
        };
        let output_norm = t.vec("output_norm.weight", e)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{il}.{s}.weight");
            let ffn = match cfg.arch {
                Arch::Gemma3 => {
                    let gate = t.mat_any_rows(&n("ffn_gate"), e)?;
                    let ff = gate.rows;
                    Ffn::Dense {
                        up: t.mat(&n("ffn_up"), ff, e)?,
                        down: t.mat(&n("ffn_down"), e, ff)?,
                        gate,
                    }
                }
                Arch::Qwen3Moe => {
                    let gate = t.stacked_any_rows(&n("ffn_gate_exps"), e, cfg.n_expert)?;
                    let ff = gate.rows;
                    Ffn::Moe {
                        router: t.mat(&n("ffn_gate_inp"), cfg.n_expert, e)?,
                        experts: ExpertTensors {
                            up: t.stacked(&n("ffn_up_exps"), ff, e, cfg.n_expert)?,
                            down: t.stacked(&n("ffn_down_exps"), e, ff, cfg.n_expert)?,
                            gate,
                        },
                    }
                }
            };
            let gemma = cfg.arch == Arch::Gemma3;
            layers.push(Layer {
                attn_norm: t.vec(&n("attn_norm"), e)?,
                wq: t.mat(&n("attn_q"), cfg.n_head * hd, e)?,
                wk: t.mat(&n("attn_k"), cfg.n_head_kv * hd, e)?,
                wv: t.mat(&n("attn_v"), cfg.n_head_kv * hdv, e)?,
                wo: t.mat(&n("attn_output"), e, cfg.n_head * hdv)?,
                q_norm: t.opt_vec(&n("attn_q_norm"), hd)?,
                k_norm: t.opt_vec(&n("attn_k_norm"), hd)?,
                post_attn_norm: if gemma {
                    Some(t.vec(&n("post_attention_norm"), e)?)
                } else {
                    None
                },
                ffn_norm: t.vec(&n("ffn_norm"), e)?,
                post_ffn_norm: if gemma {
                    Some(t.vec(&n("post_ffw_norm"), e)?)
                } else {
                    None
                },
                ffn,
            });
        }
        Ok((token_embd, output_norm, output, layers))
    }
}

/// Looks tensors up by name and checks them.
struct Loader<'a> {
    file: &'a GgufFile,
    map: &'a MappedFile,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.file
            .tensor(name)
            .ok_or_else(|| EngineError::MissingTensor {
                path: self.file.path.clone(),
                name: name.to_string(),
            })
    }

    fn bad(&self, name: &str, what: String) -> EngineError {
        EngineError::BadTensor {
            path: self.file.path.clone(),
            name: name.to_string(),
            what,
        }
    }

    fn check_type(&self, name: &str, ty: GgmlType) -> Result<(), EngineError> {
        if sluice_kernels::is_supported(ty) {
            Ok(())
        } else {
            Err(self.bad(
                name,
                format!("tensor type {ty} is not supported by sluice's kernels yet"),
            ))
        }
    }

    fn range(&self, t: &TensorInfo) -> Range<usize> {
        let r = self.file.tensor_range(t);
        r.start as usize..r.end as usize
    }

    fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat, EngineError> {
        let m = self.mat_any_rows(name, cols)?;
        if m.rows != rows {
            return Err(self.bad(name, format!("expected {rows} rows, found {}", m.rows)));
        }
        Ok(m)
    }

    fn mat_any_rows(&self, name: &str, cols: usize) -> Result<Mat, EngineError> {
        let t = self.info(name)?;
        if t.dims.len() != 2 || t.dims[0] as usize != cols {
            return Err(self.bad(
                name,
                format!("expected shape [{cols}, rows], found {:?}", t.dims),
            ));
        }
        self.check_type(name, t.ty)?;
        Ok(Mat {
            ty: t.ty,
            rows: t.dims[1] as usize,
            cols,
            range: self.range(t),
        })
    }

    fn stacked(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        n_expert: usize,
    ) -> Result<Stacked, EngineError> {
        let s = self.stacked_any_rows(name, cols, n_expert)?;
        if s.rows != rows {
            return Err(self.bad(
                name,
                format!("expected {rows} rows per expert, found {}", s.rows),
            ));
        }
        Ok(s)
    }

    fn stacked_any_rows(
        &self,
        name: &str,
        cols: usize,
        n_expert: usize,
    ) -> Result<Stacked, EngineError> {
        let t = self.info(name)?;
        if t.dims.len() != 3 || t.dims[0] as usize != cols || t.dims[2] as usize != n_expert {
            return Err(self.bad(
                name,
                format!(
                    "expected shape [{cols}, rows, {n_expert}], found {:?}",
                    t.dims
                ),
            ));
        }
        self.check_type(name, t.ty)?;
        Ok(Stacked {
            ty: t.ty,
            rows: t.dims[1] as usize,
            cols,
            n_expert,
            range: self.range(t),
        })
    }

    fn vec(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let t = self.info(name)?;
        if t.n_elements() != len as u64 {
            return Err(self.bad(name, format!("expected {len} elements, found {:?}", t.dims)));
        }
        self.check_type(name, t.ty)?;
        let mut out = vec![0.0f32; len];
        sluice_kernels::dequantize_row(t.ty, &self.map.bytes()[self.range(t)], &mut out)
            .map_err(|e| self.bad(name, e.to_string()))?;
        Ok(out)
    }

    fn opt_vec(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, EngineError> {
        match self.file.tensor(name) {
            Some(_) => self.vec(name, len).map(Some),
            None => Ok(None),
        }
    }
}
