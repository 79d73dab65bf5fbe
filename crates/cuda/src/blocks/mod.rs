//! The GPU decoder's blocks, one file per block kind, named as the CPU's
//! (`sluice_models::blocks`): each owns its device weights (and their upload, an
//! `Uploader` method), what its kernels take, its per-sequence state where it has one (its
//! own type, with its allocation, copy and device addresses; a variant of
//! `forward::state::LayerState`), and the launch sequence that evaluates it for one forward
//! call (a `GpuDecoder` method taking its group of `forward::Call`; `GpuDecoder::run` calls
//! them in the plan's order, as `CpuDecoder` calls the CPU blocks).

pub(crate) mod attention;
pub(crate) mod deltanet;
pub(crate) mod dsa_indexer;
pub(crate) mod dsv4_attention;
pub(crate) mod ffn;
pub(crate) mod hyper;
pub(crate) mod hyper_lowrank;
pub(crate) mod kda;
pub(crate) mod mla;
pub(crate) mod mla_pooled;
pub(crate) mod moe;
pub(crate) mod ple;
pub(crate) mod qsa;
