//! Tensors located in the mapped GGUF file.
//!
//! Owns: [`Tensors`], which finds a tensor by its llama.cpp name, checks its type and
//! shape and returns where it lives ([`Mat`], stacked expert tensors [`Stacked`]); small
//! F32 vectors (norms) are copied out once at load time, their whole shape checked, not
//! only their element count; matrices stay in the map. Which
//! tensors exist is each architecture's business (`arch/`).

use std::ops::Range;

use sluice_gguf::{GgmlType, GgufFile, TensorInfo};
use sluice_io::MappedFile;

use sluice_tier::StackedPart;

use crate::ModelError as EngineError;

/// A 2-D weight matrix `[rows, cols]` (ggml dims `[cols, rows]`) inside the file.
#[derive(Debug, Clone)]
pub struct Mat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub range: Range<usize>,
}

/// A stacked 3-D expert tensor `[n_expert, rows, cols]` (ggml dims `[cols, rows, n_expert]`),
/// or one matrix inside each expert's slice of such a tensor (the gate or up half of a merged
/// `ffn_gate_up_exps`).
#[derive(Debug, Clone)]
pub struct Stacked {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub n_expert: usize,
    /// The whole tensor in the file.
    pub range: Range<usize>,
    /// This matrix within one expert's slice (`0..slice` for a plain stacked tensor).
    pub sub: Range<usize>,
}

impl Mat {
    /// The matrix's bytes in the mapped file.
    pub fn bytes<'a>(&self, map: &'a [u8]) -> &'a [u8] {
        &map[self.range.clone()]
    }
}

impl Stacked {
    /// This tensor as one matrix of a streamable unit.
    pub fn part(&self, name: &str) -> StackedPart {
        StackedPart {
            name: name.to_string(),
            start: (self.range.start + self.sub.start) as u64,
            stride: self.slice_bytes() as u64,
            bytes_per_unit: self.expert_bytes() as u64,
        }
    }

    /// Bytes between consecutive experts (one expert's slice of the whole tensor).
    pub fn slice_bytes(&self) -> usize {
        (self.range.end - self.range.start) / self.n_expert
    }

    /// Bytes of this matrix for one expert.
    pub fn expert_bytes(&self) -> usize {
        self.sub.end - self.sub.start
    }

    /// Absolute file range of this matrix of expert `e`.
    pub fn expert_range(&self, e: usize) -> Range<usize> {
        let start = self.range.start + e * self.slice_bytes() + self.sub.start;
        start..start + self.expert_bytes()
    }
}

/// Looks tensors up by name and checks them.
pub struct Tensors<'a> {
    pub file: &'a GgufFile,
    pub map: &'a MappedFile,
}

impl<'a> Tensors<'a> {
    pub fn new(file: &'a GgufFile, map: &'a MappedFile) -> Tensors<'a> {
        Tensors { file, map }
    }

    /// `token_embd.weight` and `output.weight` (`[n_vocab, n_embd]`), the output being the
    /// embedding when the model ties them.
    pub fn embd_and_output(
        &self,
        n_vocab: usize,
        n_embd: usize,
    ) -> Result<(Mat, Mat), EngineError> {
        let embd = self.mat("token_embd.weight", n_vocab, n_embd)?;
        let output = if self.has("output.weight") {
            self.mat("output.weight", n_vocab, n_embd)?
        } else {
            embd.clone()
        };
        Ok((embd, output))
    }

    /// Whether the file has a tensor called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo, EngineError> {
        self.file
            .tensor(name)
            .ok_or_else(|| EngineError::MissingTensor {
                path: self.file.path.clone(),
                name: name.to_string(),
            })
    }

    pub fn bad(&self, name: &str, what: String) -> EngineError {
        EngineError::BadTensor {
            path: self.file.path.clone(),
            name: name.to_string(),
            what,
        }
    }

    pub fn check_type(&self, name: &str, ty: GgmlType) -> Result<(), EngineError> {
        if sluice_kernels::is_supported(ty) {
            Ok(())
        } else {
            Err(self.bad(
                name,
                format!("tensor type {ty} is not supported by sluice's kernels yet"),
            ))
        }
    }

    pub fn range(&self, t: &TensorInfo) -> Range<usize> {
        let r = self.file.tensor_range(t);
        r.start as usize..r.end as usize
    }

    pub fn mat(&self, name: &str, rows: usize, cols: usize) -> Result<Mat, EngineError> {
        let m = self.mat_any_rows(name, cols)?;
        if m.rows != rows {
            return Err(self.bad(name, format!("expected {rows} rows, found {}", m.rows)));
        }
        Ok(m)
    }

    pub fn mat_any_rows(&self, name: &str, cols: usize) -> Result<Mat, EngineError> {
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

    pub fn stacked(
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

    pub fn stacked_any_rows(
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
        let range = self.range(t);
        let slice = (range.end - range.start) / n_expert;
        Ok(Stacked {
            ty: t.ty,
            rows: t.dims[1] as usize,
            cols,
            n_expert,
            range,
            sub: 0..slice,
        })
    }

    /// Whether layer `il` has routed GLU experts (separate or merged gate/up).
    pub fn has_glu_experts(&self, il: usize) -> bool {
        self.has(&format!("blk.{il}.ffn_gate_exps.weight"))
            || self.has(&format!("blk.{il}.ffn_gate_up_exps.weight"))
    }

    /// The routed GLU experts of the MTP blocks `blocks` (layers past the decoder, never
    /// run: described so they stream and never sit resident), each with its layer index;
    /// a block without routed experts is skipped.
    pub fn mtp_glu_experts(
        &self,
        blocks: Range<usize>,
        n_embd: usize,
        ff: Option<usize>,
        n_expert: usize,
    ) -> Result<Vec<(usize, [Stacked; 3])>, EngineError> {
        blocks
            .filter(|il| self.has_glu_experts(*il))
            .map(|il| Ok((il, self.glu_experts(il, n_embd, ff, n_expert)?)))
            .collect()
    }

    /// Layer `il`'s routed GLU experts `[gate, up, down]` over `n_embd` inputs, `ff` rows per
    /// expert when given (else read from the file). Accepts separate `ffn_gate_exps` /
    /// `ffn_up_exps` or one merged `ffn_gate_up_exps` (`[n_embd, 2 ff, n_expert]`, each
    /// expert's gate rows then its up rows, as llama.cpp's `build_moe_ffn` splits it).
    pub fn glu_experts(
        &self,
        il: usize,
        n_embd: usize,
        ff: Option<usize>,
        n_expert: usize,
    ) -> Result<[Stacked; 3], EngineError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let merged = n("ffn_gate_up_exps");
        let (gate, up) = if self.has(&merged) {
            let m = self.stacked_any_rows(&merged, n_embd, n_expert)?;
            let slice = m.slice_bytes();
            if m.rows % 2 != 0 || ff.is_some_and(|f| m.rows != 2 * f) {
                let want = ff.map_or("an even number of".to_string(), |f| (2 * f).to_string());
                return Err(self.bad(
                    &merged,
                    format!(
                        "expected {want} rows per expert (gate then up), found {}",
                        m.rows
                    ),
                ));
            }
            let half = |sub: Range<usize>| Stacked {
                rows: m.rows / 2,
                sub,
                ..m.clone()
            };
            (half(0..slice / 2), half(slice / 2..slice))
        } else {
            let gate = match ff {
                Some(f) => self.stacked(&n("ffn_gate_exps"), f, n_embd, n_expert)?,
                None => self.stacked_any_rows(&n("ffn_gate_exps"), n_embd, n_expert)?,
            };
            let up = self.stacked(&n("ffn_up_exps"), gate.rows, n_embd, n_expert)?;
            (gate, up)
        };
        let down = self.stacked(&n("ffn_down_exps"), n_embd, gate.rows, n_expert)?;
        Ok([gate, up, down])
    }

    /// A 1-D vector of `len` floats (a norm, a bias), copied out.
    pub fn vec(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        self.vec_shaped(name, &[len])
    }

    /// A small tensor of shape `dims` (ggml order, innermost first) copied out as floats,
    /// row-major. The shape must match, not only the element count (`[128, 2]` is not a
    /// `[256]` norm); dimensions of size 1 are ignored on both sides (`[4, 1, 64, 1]` is a
    /// `[4, 64]` convolution, as llama.cpp's converters write some).
    pub fn vec_shaped(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>, EngineError> {
        let t = self.info(name)?;
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).filter(|&d| d != 1).collect();
        let found: Vec<u64> = t.dims.iter().copied().filter(|&d| d != 1).collect();
        if want != found {
            return Err(self.bad(name, format!("expected shape {dims:?}, found {:?}", t.dims)));
        }
        let len: usize = dims.iter().product();
        self.check_type(name, t.ty)?;
        let mut out = vec![0.0f32; len];
        sluice_kernels::dequantize_row(t.ty, &self.map.bytes()[self.range(t)], &mut out)
            .map_err(|e| self.bad(name, e.to_string()))?;
        Ok(out)
    }

    pub fn opt_vec(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, EngineError> {
        match self.file.tensor(name) {
            Some(_) => self.vec(name, len).map(Some),
            None => Ok(None),
        }
    }
}
