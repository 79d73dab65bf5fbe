//! The tokenizer metadata of a synthetic model: a small built-in byte-level BPE vocabulary,
//! or every `tokenizer.*` key copied from another GGUF (e.g. llama.cpp's vocab files).
//!
//! Owns: the token list, types and merges written under `tokenizer.*`, and padding the
//! token list with `[PADn]` tokens when the model's vocabulary is larger (as llama.cpp's
//! converter does for Qwen).

use std::path::Path;

use sluice_gguf::{GgufFile, MetaArray, MetaType, MetaValue};

use super::SynthError;

/// GGUF token types (llama.cpp `llama_token_type`).
const TOKEN_NORMAL: i32 = 1;
const TOKEN_CONTROL: i32 = 3;
const TOKEN_UNUSED: i32 = 5;

/// The built-in vocabulary's special tokens (Qwen's), appended after bytes and merges.
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A few common English merges in GPT-2 byte-level form; each one's halves exist earlier.
const MERGES: [&str; 35] = [
    "Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r", "Ġ s", "a t", "Ġ w", "Ġ o", "e n",
    "Ġ c", "i t", "i s", "a n", "o r", "e s", "Ġ b", "e d", "Ġ f", "in g", "Ġ p", "o u", "Ġa n",
    "a l", "a r", "Ġt o", "Ġ m", "Ġo f", "Ġ in", "Ġ d", "Ġ h", "Ġan d",
];

/// `tokenizer.*` metadata and the number of tokens it defines.
#[derive(Debug, Clone)]
pub struct Vocab {
    pub metadata: Vec<(String, MetaValue)>,
    pub n_tokens: usize,
    /// Where it came from, for messages.
    pub source: String,
}

/// GPT-2's reversible byte -> printable character map.
fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap_or('?')
    }
}

fn str_array(v: Vec<String>) -> MetaValue {
    MetaValue::Array(MetaArray {
        elem_type: MetaType::String,
        values: v.into_iter().map(MetaValue::Str).collect(),
    })
}

fn i32_array(v: Vec<i32>) -> MetaValue {
    MetaValue::Array(MetaArray {
        elem_type: MetaType::I32,
        values: v.into_iter().map(MetaValue::I32).collect(),
    })
}

impl Vocab {
    /// 256 byte tokens, 35 merges, 3 specials; model `gpt2`, pre-tokenizer `qwen2`.
    pub fn builtin() -> Vocab {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_to_char(b).to_string()).collect();
        tokens.extend(MERGES.iter().map(|m| m.replace(' ', "")));
        let n_normal = tokens.len();
        tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
        let mut types = vec![TOKEN_NORMAL; n_normal];
        types.extend([TOKEN_CONTROL; SPECIALS.len()]);
        let eos = n_normal as u32;
        let n_tokens = tokens.len();
        let metadata = vec![
            ("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())),
            ("tokenizer.ggml.pre".into(), MetaValue::Str("qwen2".into())),
            ("tokenizer.ggml.tokens".into(), str_array(tokens)),
            ("tokenizer.ggml.token_type".into(), i32_array(types)),
            (
                "tokenizer.ggml.merges".into(),
                str_array(MERGES.iter().map(|s| s.to_string()).collect()),
            ),
            ("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(eos)),
            (
                "tokenizer.ggml.padding_token_id".into(),
                MetaValue::U32(eos),
            ),
            ("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(eos)),
            (
                "tokenizer.ggml.add_bos_token".into(),
                MetaValue::Bool(false),
            ),
        ];
        Vocab {
            metadata,
            n_tokens,
            source: "built-in byte-level vocabulary".into(),
        }
    }

    /// Every `tokenizer.*` key of `path`, in file order.
    pub fn from_gguf(path: &Path) -> Result<Vocab, SynthError> {
        let f = GgufFile::open(path)?;
        let metadata: Vec<(String, MetaValue)> = f
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect();
        let n_tokens = f
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.values.len())
            .ok_or_else(|| SynthError::Vocab {
                path: path.to_path_buf(),
                what: "no tokenizer.ggml.tokens array".into(),
            })?;
        if n_tokens == 0 {
            return Err(SynthError::Vocab {
                path: path.to_path_buf(),
                what: "tokenizer.ggml.tokens is empty".into(),
            });
        }
        Ok(Vocab {
            metadata,
            n_tokens,
            source: path.display().to_string(),
        })
    }

    /// Grow the token list to `n` with `[PADi]` tokens of type UNUSED (scores 0).
    pub fn pad_to(&mut self, n: usize) -> Result<(), SynthError> {
        if n < self.n_tokens {
            return Err(SynthError::Config(format!(
                "--vocab {n} is smaller than the {} tokens of the {}",
                self.n_tokens, self.source
            )));
        }
        let old = self.n_tokens;
        for (key, value) in &mut self.metadata {
            let MetaValue::Array(a) = value else { continue };
            if a.values.len() != old {
                continue;
            }
            match key.as_str() {
                "tokenizer.ggml.tokens" => {
                    a.values
                        .extend((old..n).map(|i| MetaValue::Str(format!("[PAD{i}]"))));
                }
                "tokenizer.ggml.token_type" => {
                    let pad = match a.elem_type {
                        MetaType::I32 => MetaValue::I32(TOKEN_UNUSED),
                        MetaType::U32 => MetaValue::U32(TOKEN_UNUSED as u32),
                        _ => continue,
                    };
                    a.values.resize(n, pad);
                }
                "tokenizer.ggml.scores" if a.elem_type == MetaType::F32 => {
                    a.values.resize(n, MetaValue::F32(0.0));
                }
                _ => {}
            }
        }
        self.n_tokens = n;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_matches_gpt2() {
        assert_eq!(byte_to_char(b'a'), 'a');
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
        assert_eq!(byte_to_char(0), 'Ā');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_to_char).collect();
        assert_eq!(all.len(), 256);
    }
}
