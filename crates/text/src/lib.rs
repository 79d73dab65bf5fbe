//! Text in and out of a model: tokenizers built from GGUF metadata and chat templates.
//!
//! Owns: [`tokenizer`] (SentencePiece and byte-level BPE with llama.cpp's pre-tokenizers,
//! streaming decode) and [`chat`] (minijinja chat templates, built-in fallbacks). Knows
//! nothing about weights or compute.

pub mod chat;
pub mod tokenizer;
