//! The vocabulary tables (token texts, scores, attributes, lookup maps, merge ranks) and
//! building a [`Tokenizer`] from plain vocab data the way llama.cpp's `llama_vocab::load`
//! does: per-model defaults, special ids, end-of-generation detection, the special-token
//! cache and the token-to-piece cache.

use super::bpe::BpeConfig;
use super::pretokenize::{byte_to_unicode_table, PreTokenizer};
use super::{attr, Kind, SpecialIds, Tokenizer, TokenizerError, VocabData};
use std::collections::{BTreeSet, HashMap};

/// Lookup tables shared by the SPM and BPE algorithms.
#[derive(Debug, Clone, Default)]
pub(crate) struct Vocab {
    pub texts: Vec<String>,
    pub scores: Vec<f32>,
    pub attrs: Vec<u32>,
    pub token_to_id: HashMap<String, u32>,
    /// Interned strings appearing in merges, and (left, right) -> rank.
    merge_parts: HashMap<String, u32>,
    merges: HashMap<(u32, u32), u32>,
    /// Byte-fallback token for each byte (`<0xNN>`), if the vocab has one.
    byte_tokens: Vec<Option<u32>>,
}

impl Vocab {
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }
    pub fn score(&self, id: u32) -> f32 {
        self.scores[id as usize]
    }
    pub fn byte_token(&self, b: u8) -> Option<u32> {
        self.byte_tokens[b as usize]
    }
    pub fn merge_rank(&self, left: &str, right: &str) -> Option<u32> {
        let l = *self.merge_parts.get(left)?;
        let r = *self.merge_parts.get(right)?;
        self.merges.get(&(l, r)).copied()
    }
}

/// llama.cpp's `LLAMA_TOKEN_TYPE_*` values in `tokenizer.ggml.token_type`.
fn type_to_attr(t: i32) -> u32 {
    match t {
        1 => attr::NORMAL,
        2 => attr::UNKNOWN,
        3 => attr::CONTROL,
        4 => attr::USER_DEFINED,
        5 => attr::UNUSED,
        6 => attr::BYTE,
        _ => attr::UNDEFINED,
    }
}

struct PreInfo {
    pre: PreTokenizer,
    ignore_merges: bool,
    clean_spaces: bool,
    add_bos: bool,
    escape_whitespaces: bool,
    byte_encode: bool,
}

fn pre_info(name: &str) -> Option<PreInfo> {
    let base = |pre| PreInfo {
        pre,
        ignore_merges: false,
        clean_spaces: true,
        add_bos: false,
        escape_whitespaces: false,
        byte_encode: true,
    };
    Some(match name {
        "" | "default" => base(PreTokenizer::Default),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => PreInfo {
            ignore_merges: true,
            add_bos: true,
            ..base(PreTokenizer::JoyAi)
        },
        "dbrx" | "smaug-bpe" | "chatglm-bpe" => base(PreTokenizer::Llama3),
        // GLM-4.x / GLM-5.x: llama.cpp's CHATGLM4 regex is llama3's; no BOS; whole words
        // found in the vocabulary skip the merges.
        "glm4" | "glm5" => PreInfo {
            ignore_merges: true,
            ..base(PreTokenizer::Llama3)
        },
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "exaone4"
        | "trillion" => base(PreTokenizer::Gpt2),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => {
            base(PreTokenizer::Starcoder)
        }
        "command-r" | "smollm" => PreInfo {
            clean_spaces: false,
            ..base(PreTokenizer::Starcoder)
        },
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => PreInfo {
            clean_spaces: false,
            ..base(PreTokenizer::Qwen2)
        },
        "stablelm2" | "megrez" => base(PreTokenizer::Qwen2),
        "qwen35" => PreInfo {
            clean_spaces: false,
            ..base(PreTokenizer::Qwen35)
        },
        "joyai-llm" => PreInfo {
            clean_spaces: false,
            ..base(PreTokenizer::JoyAi)
        },
        "gemma4" => PreInfo {
            escape_whitespaces: true,
            byte_encode: false,
            ..base(PreTokenizer::Newlines)
        },
        _ => return None,
    })
}

fn in_range(id: Option<u32>, n: usize) -> Option<u32> {
    id.filter(|&i| (i as usize) < n)
}

pub(crate) fn build(data: VocabData, source: &str) -> Result<Tokenizer, TokenizerError> {
    let n = data.tokens.len();
    if n == 0 {
        return Err(TokenizerError::EmptyVocab {
            file: source.to_string(),
        });
    }
    let check_len = |key: &'static str, len: usize| {
        if len < n {
            Err(TokenizerError::LengthMismatch {
                file: source.to_string(),
                key,
                expected: n,
                found: len,
            })
        } else {
            Ok(())
        }
    };
    if let Some(s) = &data.scores {
        check_len("tokenizer.ggml.scores", s.len())?;
    }
    if let Some(t) = &data.token_types {
        check_len("tokenizer.ggml.token_type", t.len())?;
    }

    // Per-model defaults (llama.cpp llama_vocab::impl::load).
    let mut special = SpecialIds::default();
    let mut add_space_prefix = false;
    let mut add_bos;
    let mut add_eos = false;
    let mut clean_spaces = false;
    let mut escape_whitespaces = true;
    let kind_model = data.model.as_str();
    let mut bpe_info = None;
    match kind_model {
        "llama" => {
            special.bos = Some(1);
            special.eos = Some(2);
            special.unk = Some(0);
            add_space_prefix = true;
            add_bos = true;
        }
        "gpt2" | "gemma4" => {
            let pre_name = if kind_model == "gemma4" {
                "gemma4"
            } else {
                data.pre.as_deref().unwrap_or("")
            };
            let info = pre_info(pre_name).ok_or_else(|| TokenizerError::UnsupportedPre {
                file: source.to_string(),
                pre: pre_name.to_string(),
            })?;
            if kind_model == "gpt2" {
                special.bos = Some(11);
                special.eos = Some(11);
            }
            clean_spaces = info.clean_spaces;
            escape_whitespaces = info.escape_whitespaces;
            add_bos = info.add_bos;
            bpe_info = Some(info);
        }
        other => {
            return Err(TokenizerError::UnsupportedModel {
                file: source.to_string(),
                model: other.to_string(),
            })
        }
    }
    if let Some(v) = data.add_space_prefix {
        add_space_prefix = v;
    }

    // Token table.
    let mut vocab = Vocab {
        byte_tokens: vec![None; 256],
        ..Default::default()
    };
    vocab.texts.reserve(n);
    vocab.token_to_id.reserve(n);
    for (i, t) in data.tokens.into_iter().enumerate() {
        let t = if t.is_empty() {
            format!("[EMPTY_{i}]")
        } else {
            t
        };
        vocab.token_to_id.insert(t.clone(), i as u32);
        vocab.texts.push(t);
    }
    vocab.scores = match data.scores {
        Some(mut s) => {
            s.truncate(n);
            s
        }
        None => vec![0.0; n],
    };
    vocab.attrs = match &data.token_types {
        Some(t) => t[..n].iter().map(|&t| type_to_attr(t)).collect(),
        None => vec![attr::NORMAL; n],
    };
    for b in 0..=255u8 {
        let hex = format!("<0x{b:02X}>");
        vocab.byte_tokens[b as usize] = vocab.token_id(&hex).or_else(|| {
            // SPM falls back to the byte itself as a one-character token.
            if kind_model == "llama" && b.is_ascii() {
                vocab.token_id(std::str::from_utf8(&[b]).unwrap_or(""))
            } else {
                None
            }
        });
    }
    if bpe_info.is_some() {
        for m in &data.merges {
            // llama.cpp splits at the first space after position 0.
            let Some(pos) = m
                .as_bytes()
                .iter()
                .skip(1)
                .position(|&b| b == b' ')
                .map(|p| p + 1)
            else {
                continue;
            };
            let (l, r) = (&m[..pos], &m[pos + 1..]);
            let next = vocab.merge_parts.len() as u32;
            let li = *vocab.merge_parts.entry(l.to_string()).or_insert(next);
            let next = vocab.merge_parts.len() as u32;
            let ri = *vocab.merge_parts.entry(r.to_string()).or_insert(next);
            let rank = vocab.merges.len() as u32;
            vocab.merges.entry((li, ri)).or_insert(rank);
        }
    }

    // Special ids: defaults out of range are dropped; metadata overrides when in range.
    special.bos = in_range(special.bos, n);
    special.eos = in_range(special.eos, n);
    special.unk = in_range(special.unk, n);
    let over = |d: Option<u32>, m: Option<u32>| in_range(m, n).or(d);
    special.bos = over(special.bos, data.bos);
    special.eos = over(special.eos, data.eos);
    special.eot = over(None, data.eot);
    special.eom = over(None, data.eom);
    special.unk = over(special.unk, data.unk);
    special.sep = over(None, data.sep);
    special.pad = over(None, data.pad);
    if let Some(v) = data.add_bos {
        add_bos = v;
    }
    if let Some(v) = data.add_eos {
        add_eos = v;
    }
    if kind_model == "gemma4" {
        add_bos = true;
    }
    // GLM (llama.cpp: special_bos_id = NULL): never a BOS, whatever the file says.
    if kind_model == "gpt2" && matches!(data.pre.as_deref(), Some("glm4" | "glm5" | "chatglm-bpe"))
    {
        add_bos = false;
    }

    detect_special(&mut vocab, &mut special);
    let eog = detect_eog(&mut vocab, &special);

    // Per-model token attributes by general.name (only Phi-3 affects tokenization here).
    let name = data.name.unwrap_or_default().to_lowercase();
    let is_special = |a: u32| a & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0;
    let mut special_cache: Vec<u32> = (0..n as u32)
        .filter(|&i| is_special(vocab.attrs[i as usize]))
        .collect();
    if name.contains("phi-3") || name.contains("phi3") {
        for &id in &special_cache {
            vocab.attrs[id as usize] |= attr::RSTRIP;
        }
        for (t, on) in [
            ("</s>", true),
            ("<unk>", false),
            ("<s>", false),
            ("<|endoftext|>", false),
        ] {
            if let Some(id) = vocab.token_id(t) {
                let a = &mut vocab.attrs[id as usize];
                *a = if on {
                    *a | attr::RSTRIP
                } else {
                    *a & !attr::RSTRIP
                };
            }
        }
    }
    special_cache.sort_by(|&a, &b| {
        vocab.texts[b as usize]
            .len()
            .cmp(&vocab.texts[a as usize].len())
            .then(a.cmp(&b))
    });

    let kind = match bpe_info {
        None => Kind::Spm,
        Some(info) => Kind::Bpe(Box::new(BpeConfig {
            pre: info.pre,
            byte_encode: info.byte_encode,
            ignore_merges: info.ignore_merges,
            newline_words: kind_model == "gemma4",
            byte_to_char: byte_to_unicode_table(),
        })),
    };
    let mut tok = Tokenizer {
        vocab,
        kind,
        special,
        eog,
        add_bos,
        add_eos,
        add_space_prefix,
        escape_whitespaces,
        clean_spaces,
        special_cache,
        special_trie: super::SpecialTrie::default(),
        pieces: Vec::new(),
        unicode_to_byte: HashMap::new(),
    };
    tok.finish_build();
    Ok(tok)
}

const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Finds EOT/EOM/FIM ids by text when metadata lacks them and marks them control
/// (llama.cpp's "auto-detect special tokens by text"), then marks unused control tokens.
fn detect_special(vocab: &mut Vocab, special: &mut SpecialIds) {
    let mark = |vocab: &mut Vocab, texts: &[&str], slot: &mut Option<u32>| {
        if slot.is_some() {
            return;
        }
        // llama.cpp iterates an unordered map: with several candidates present the pick is
        // unspecified there; here the lowest id wins.
        let found = (0..vocab.texts.len()).find(|&i| texts.contains(&vocab.texts[i].as_str()));
        if let Some(i) = found {
            *slot = Some(i as u32);
            vocab.attrs[i] |= attr::CONTROL;
        }
    };
    mark(vocab, EOT_TEXTS, &mut special.eot);
    mark(vocab, &["<|eom_id|>"], &mut special.eom);
    mark(
        vocab,
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        &mut special.fim_pad,
    );
    mark(
        vocab,
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        &mut special.fim_rep,
    );
    mark(vocab, &["<|file_sep|>"], &mut special.fim_sep);
    for (t, a) in vocab.texts.iter().zip(vocab.attrs.iter_mut()) {
        if *a & attr::CONTROL != 0 && t.contains("unused") {
            *a |= attr::UNUSED;
        }
    }
    // gpt-oss: always render these tokens.
    for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(id) = vocab.token_id(t) {
            vocab.attrs[id as usize] = attr::USER_DEFINED;
        }
    }
}

const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// The set of end-of-generation ids (llama.cpp's `special_eog_ids`).
fn detect_eog(vocab: &mut Vocab, special: &SpecialIds) -> BTreeSet<u32> {
    let mut eog = BTreeSet::new();
    eog.extend(special.fim_pad);
    eog.extend(special.fim_rep);
    eog.extend(special.fim_sep);
    for (i, t) in vocab.texts.iter().enumerate() {
        if EOG_TEXTS.contains(&t.as_str()) {
            eog.insert(i as u32);
            vocab.attrs[i] |= attr::CONTROL;
        }
    }
    eog.extend(special.eos);
    eog.extend(special.eot);
    eog.extend(special.eom);
    let find = |eog: &BTreeSet<u32>, t: &str| {
        eog.iter()
            .copied()
            .find(|&id| vocab.texts[id as usize] == t)
    };
    let has = |eog: &BTreeSet<u32>, t: &str| find(eog, t).is_some();
    let has_call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
    if let Some(end) = find(&eog, "<|end|>") {
        if has_call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
            eog.remove(&end);
            vocab.attrs[end as usize] = attr::USER_DEFINED;
        }
    }
    if has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>") {
        if let Some(s) = find(&eog, "</s>") {
            eog.remove(&s);
            vocab.attrs[s as usize] = attr::NORMAL;
        }
    }
    eog
}
