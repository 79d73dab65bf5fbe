//! A loaded model: configuration, weights, expert source, and the forward pass.
//!
//! Owns: `Model::load` (GGUF header -> config -> mapped weights) and the pieces the
//! forward pass shares across calls (RoPE tables). Architectures differ only in
//! [`config::ModelConfig`] and in which tensors [`weights::Weights::load`] looks for.

pub mod config;
pub mod forward;
pub mod ops;
pub mod weights;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use sluice_gguf::GgufFile;

use crate::expert::{ExpertSource, ResidentExperts};
use crate::expert_tier::{RoutingRecorder, TraceHeader};
use crate::kv::KvCache;
use crate::streaming::StreamingExperts;
use crate::EngineError;
use config::ModelConfig;
use weights::Weights;

pub use forward::Logits;

/// A model ready to evaluate tokens.
pub struct Model {
    pub gguf: GgufFile,
    pub cfg: ModelConfig,
    pub weights: Weights,
    pub experts: Box<dyn ExpertSource>,
    /// `--record-routing`: every token's chosen experts, per MoE layer.
    routing: Option<Mutex<RoutingRecorder>>,
    rope_global: Vec<f32>,
    rope_swa: Vec<f32>,
}

impl Model {
    /// Open `path`, read its header, check the architecture and map every tensor.
    pub fn load(path: &Path) -> Result<Model, EngineError> {
        let gguf = GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&gguf)?;
        let weights = Weights::load(path, &gguf, &cfg)?;
        let rope_global = ops::rope_inv_freq(cfg.head_dim, cfg.rope_base, cfg.rope_scale);
        let rope_swa = ops::rope_inv_freq(cfg.head_dim, cfg.rope_base_swa, 1.0);
        Ok(Model {
            gguf,
            cfg,
            weights,
            experts: Box::new(ResidentExperts),
            routing: None,
            rope_global,
            rope_swa,
        })
    }

    /// Replace where routed experts come from (e.g. an SSD-streaming cache).
    pub fn set_expert_source(&mut self, source: Box<dyn ExpertSource>) {
        self.experts = source;
    }

    /// Record every token's routing to `path` (a trace for `sluice cache-sim`).
    pub fn record_routing(&mut self, path: &Path) -> Result<(), EngineError> {
        let header = TraceHeader {
            model: self
                .gguf
                .get("general.name")
                .and_then(|v| v.as_str())
                .unwrap_or(self.cfg.arch.name())
                .to_string(),
            n_layer: self.cfg.n_layer as u32,
            n_expert: self.cfg.n_expert as u32,
            top_k: self.cfg.n_expert_used as u32,
            expert_bytes: StreamingExperts::expert_bytes_per_layer(&self.weights),
        };
        let rec = RoutingRecorder::create(path, header)
            .map_err(|e| EngineError::Stream(e.to_string()))?;
        self.routing = Some(Mutex::new(rec));
        Ok(())
    }

    /// Close the routing trace (if recording) and return its path.
    pub fn finish_routing(&mut self) -> Result<Option<PathBuf>, EngineError> {
        match self.routing.take() {
            None => Ok(None),
            Some(m) => {
                let rec = m.into_inner().unwrap_or_else(|p| p.into_inner());
                rec.finish()
                    .map(Some)
                    .map_err(|e| EngineError::Stream(e.to_string()))
            }
        }
    }

    pub(crate) fn routing_recorder(&self) -> Option<&Mutex<RoutingRecorder>> {
        self.routing.as_ref()
    }

    /// A fresh KV cache for up to `n_ctx` positions (capped at the trained context).
    pub fn new_kv(&self, n_ctx: usize) -> KvCache {
        let c = &self.cfg;
        KvCache::new(
            c.n_layer,
            c.n_head_kv * c.head_dim,
            c.n_head_kv * c.head_dim_v,
            n_ctx.min(c.n_ctx_train),
        )
    }
}
