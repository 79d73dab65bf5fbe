//! A loaded model: the mapped file, its architecture, where its experts come from.
//!
//! Owns: `Model::load` (GGUF header -> registered architecture -> mapped weights -> the
//! architecture's plan in a [`CpuDecoder`]), the expert source (resident or streaming), the
//! routing recorder, and [`Model::forward`]: the checks and bookkeeping every architecture
//! shares (token range, context room, positions, trace batches, certain-unit prefetch, the
//! expert tier's token clock, which rows get logits), then the CPU decoder or the device
//! backend.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sluice_gguf::GgufFile;
use sluice_io::MappedFile;
use sluice_tier::{
    ExpertSource, Geometry, RoutingRecorder, RoutingReplay, RoutingTrace, StreamError,
    StreamableGroups, TraceError, TraceHeader,
};

use crate::arch::{self, Architecture};
use crate::blocks::{lock, Batch, Env};
use crate::compute::{Compute, Cpu};
use crate::config::ModelConfig;
use crate::decoder::CpuDecoder;
use crate::expert::ResidentExperts;
use crate::plan::{DecoderPlan, DeviceForward};
use crate::state::SeqState;
use crate::ModelError;

/// Which positions of a chunk need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (generation).
    Last,
    /// Every position (perplexity, `--dump-logits`).
    All,
    /// None (prompt chunks before the last).
    None,
}

/// A model ready to evaluate tokens.
pub struct Model {
    pub gguf: GgufFile,
    pub cfg: ModelConfig,
    pub map: MappedFile,
    /// Tensor groups that may live outside RAM (routed experts, row tables).
    pub groups: StreamableGroups,
    arch: Box<dyn Architecture>,
    /// The CPU's forward pass: the architecture's plan run with the blocks.
    cpu: CpuDecoder,
    experts: Box<dyn ExpertSource>,
    compute: Box<dyn Compute>,
    /// A backend running the whole forward pass on its device (`--gpu`), when set.
    device: Option<Box<dyn DeviceForward>>,
    /// `--record-routing`: every token's chosen experts, per MoE layer.
    routing: Option<Mutex<RoutingRecorder>>,
    /// `--replay-routing`: experts taken from a recorded trace instead of the routers.
    replay: Option<RoutingReplay>,
}

impl Model {
    /// Open `path`, read its header, find its architecture and locate every tensor.
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        let gguf = GgufFile::open(path)?;
        let name = gguf.architecture()?;
        let load = arch::find(name).ok_or_else(|| ModelError::UnknownArch {
            path: path.to_path_buf(),
            found: name.to_string(),
        })?;
        let map = MappedFile::open(path)?;
        if (map.bytes().len() as u64) < gguf.file_size {
            return Err(ModelError::BadTensor {
                path: path.to_path_buf(),
                name: "(file)".into(),
                what: format!(
                    "file shrank while loading: {} bytes mapped, {} expected",
                    map.bytes().len(),
                    gguf.file_size
                ),
            });
        }
        let arch = load(&gguf, &map)?;
        let cfg = arch.config().clone();
        let groups = arch.groups();
        let cpu = CpuDecoder::new(arch.plan());
        Ok(Model {
            cpu,
            experts: Box::new(ResidentExperts::new(groups.experts.clone())),
            compute: Box::new(Cpu),
            device: None,
            gguf,
            cfg,
            map,
            groups,
            arch,
            routing: None,
            replay: None,
        })
    }

    /// Replace where routed experts come from (e.g. an SSD-streaming cache).
    pub fn set_expert_source(&mut self, source: Box<dyn ExpertSource>) {
        self.experts = source;
    }

    /// Read the row table `name` through `src` (e.g. the PLE table's `--ple-io` reader);
    /// false if the model has no such table.
    pub fn set_row_source(
        &mut self,
        name: &str,
        src: std::sync::Arc<dyn sluice_tier::PleSource>,
    ) -> bool {
        if !self.arch.set_row_source(name, src) {
            return false;
        }
        // The plan holds the row source: the CPU decoder runs the new one.
        self.cpu = CpuDecoder::new(self.arch.plan());
        true
    }

    /// Replace the compute backend.
    pub fn set_compute(&mut self, compute: Box<dyn Compute>) {
        self.compute = compute;
    }

    /// The architecture's forward pass as data, for a device backend: the plan the CPU
    /// decoder runs (every architecture has one; the `Option` is the device backends' API).
    pub fn plan(&self) -> Option<DecoderPlan> {
        Some(self.cpu.plan().clone())
    }

    /// Run every forward pass through `device` (built from [`Model::plan`]) instead of the
    /// CPU decoder; the expert source, routing trace and token checks stay as they are.
    pub fn set_device_forward(&mut self, device: Box<dyn DeviceForward>) {
        self.device = Some(device);
    }

    /// The device backend's name, when one runs the forward pass.
    pub fn device_forward(&self) -> Option<&'static str> {
        self.device.as_ref().map(|d| d.name())
    }

    /// Record every token's routing to `path` (a trace for `sluice cache-sim`).
    pub fn record_routing(&mut self, path: &Path) -> Result<(), ModelError> {
        let header = TraceHeader {
            model: self
                .gguf
                .get("general.name")
                .and_then(|v| v.as_str())
                .unwrap_or(self.cfg.arch)
                .to_string(),
            n_layer: self.cfg.n_layer as u32,
            n_expert: self.cfg.n_expert as u32,
            top_k: self.cfg.n_expert_used as u32,
            expert_bytes: self.groups.experts.unit_bytes_per_layer(),
        };
        let rec = RoutingRecorder::create(path, header).map_err(StreamError::from)?;
        self.routing = Some(Mutex::new(rec));
        Ok(())
    }

    /// The routing geometry (layers, routed-expert layers, experts, top-k) a trace of this
    /// model has, and a trace must have to replay on it.
    pub fn routing_geometry(&self) -> Geometry {
        Geometry {
            n_layer: self.cfg.n_layer as u32,
            n_expert: self.cfg.n_expert as u32,
            top_k: self.cfg.n_expert_used as u32,
            moe_layers: self
                .groups
                .experts
                .unit_bytes_per_layer()
                .iter()
                .enumerate()
                .filter(|(_, &b)| b > 0)
                .map(|(l, _)| l as u32)
                .collect(),
        }
    }

    /// Take every token's experts from `trace` (read from `path`) instead of the routers,
    /// batch after batch from its first token (wrapping at its end): an IO benchmark of a
    /// real access pattern on a file of the same routing geometry (refused otherwise, naming
    /// both). Logits are then not the model's. Certain (hash-routed) prefetch is off while
    /// replaying.
    pub fn replay_routing(
        &mut self,
        trace: RoutingTrace,
        path: &Path,
    ) -> Result<&RoutingReplay, TraceError> {
        let r = RoutingReplay::new(trace, path, &self.routing_geometry())?;
        Ok(self.replay.insert(r))
    }

    /// The trace being replayed, if any.
    pub fn routing_replay(&self) -> Option<&RoutingReplay> {
        self.replay.as_ref()
    }

    /// Close the routing trace (if recording) and return its path.
    pub fn finish_routing(&mut self) -> Result<Option<PathBuf>, ModelError> {
        match self.routing.take() {
            None => Ok(None),
            Some(m) => {
                let rec = m.into_inner().unwrap_or_else(|p| p.into_inner());
                Ok(Some(rec.finish().map_err(StreamError::from)?))
            }
        }
    }

    /// A fresh sequence state for up to `n_ctx` positions (capped at the trained
    /// context); the KV cache rounds to f16 like llama.cpp's default unless `kv_f32`.
    pub fn new_state(&self, n_ctx: usize, kv_f32: bool) -> SeqState {
        let mut s = self.arch.new_state(n_ctx.min(self.cfg.n_ctx_train));
        s.extra = self.cpu.new_state();
        s.kv.set_f16(!kv_f32);
        s
    }

    /// Start reading the routed units certain to be needed for `tokens` (e.g. a whole
    /// prompt's hash-routed experts at the start of prefill). Never changes a result; a
    /// no-op for resident experts, architectures without certain units, and with
    /// certain prefetch turned off in the source.
    pub fn prefetch_certain(&self, tokens: &[u32]) {
        let n_vocab = self.cfg.n_vocab;
        if tokens.iter().any(|&t| t as usize >= n_vocab) {
            return; // forward refuses these with a proper error
        }
        for (layer, units) in self.arch.certain_units(tokens) {
            self.experts.prefetch(layer, &units);
        }
    }

    /// Evaluate `tokens` at the positions following those already in `state`, update it,
    /// and return logits as `mode` asks (row-major `[rows, n_vocab]`).
    pub fn forward(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        mode: Logits,
    ) -> Result<Vec<f32>, ModelError> {
        let t_len = tokens.len();
        if t_len == 0 {
            return Ok(Vec::new());
        }
        state.kv.check_room(t_len)?;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= self.cfg.n_vocab) {
            return Err(ModelError::TokenOutOfRange {
                id,
                n_vocab: self.cfg.n_vocab,
            });
        }
        let pos0 = state.len();
        let batch = Batch {
            tokens,
            positions: (pos0..pos0 + t_len).collect(),
        };
        let moe = self.cfg.n_expert > 0;
        let routing = self.routing.as_ref().filter(|_| moe);
        if let Some(rec) = routing {
            lock(rec)
                .begin_batch(t_len as u32)
                .map_err(StreamError::from)?;
        }
        let rows: Vec<usize> = match mode {
            Logits::None => Vec::new(),
            Logits::Last => vec![t_len - 1],
            Logits::All => (0..t_len).collect(),
        };
        // Certain units start reading now, while the first layers compute (not while
        // replaying a trace: the trace, not the token ids, says which units are used).
        let replay = self.replay.as_ref().filter(|_| moe);
        if replay.is_none() {
            self.prefetch_certain(tokens);
        }
        let env = Env {
            map: self.map.bytes(),
            compute: self.compute.as_ref(),
            experts: self.experts.as_ref(),
            routing,
            replay: replay.map(|r| r.begin_batch(t_len)),
        };
        let logits = match &self.device {
            Some(d) => d.forward(&env, &batch, state, &rows),
            None => self.cpu.forward(&env, &batch, state, &rows),
        }
        .map_err(|e| match e {
            ModelError::NonFinite {
                position, stage, ..
            } => ModelError::NonFinite {
                path: self.gguf.path.clone(),
                position,
                stage,
            },
            e => e,
        })?;
        state.kv.advance(t_len);
        if let Some(rec) = routing {
            lock(rec).end_batch().map_err(StreamError::from)?;
        }
        self.experts.end_tokens(t_len);
        Ok(logits)
    }
}
