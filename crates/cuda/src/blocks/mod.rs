//! The GPU decoder's blocks, one file per block kind, named as the CPU's
//! (`sluice_models::blocks`): each owns its device weights, and the launch sequence that
//! evaluates it for one forward call (`GpuDecoder::forward` calls them in the plan's
//! order, as `CpuDecoder` calls the CPU blocks).

pub(crate) mod attention;
pub(crate) mod dsv4_attention;
pub(crate) mod ffn;
pub(crate) mod mla;
pub(crate) mod moe;
