//! The inference engine: architectures, KV cache, expert tier, tokenizer, sampler.
pub mod expert_tier;
