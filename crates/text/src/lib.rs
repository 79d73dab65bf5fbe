//! Text in and out of a model: tokenizers built from GGUF metadata and chat templates.
//!
//! Owns: [`tokenizer`] (SentencePiece and byte-level BPE with llama.cpp's pre-tokenizers,
//! streaming decode), [`chat`] (minijinja chat templates, built-in fallbacks) and [`stop`]
//! (stop strings over streamed text). Knows
//! nothing about weights or compute.

pub mod chat;
pub mod stop;
pub mod tokenizer;
