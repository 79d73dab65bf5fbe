//! The inference engine: architectures, KV cache, expert tier, tokenizer, sampler.

pub mod chat;
pub mod sampler;
pub mod tokenizer;
