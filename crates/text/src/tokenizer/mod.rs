//! Text <-> token ids for GGUF models, following llama.cpp's `llama-vocab.cpp`.
//!
//! Owns: building a [`Tokenizer`] from GGUF metadata (`tokenizer.ggml.*`) or plain vocab
//! data, encoding (special-token partitioning, SentencePiece bigram merges with byte
//! fallback, byte-level BPE with per-`tokenizer.ggml.pre` pre-tokenizers, Gemma 4's
//! SentencePiece-style BPE), decoding (pieces, whitespace unescaping, llama.cpp's
//! space clean-up) and streaming decoding that never splits a UTF-8 character.

mod bpe;
mod load;
mod pretokenize;
mod spm;
mod stream;
mod vocab;

pub use pretokenize::PreTokenizer;
pub use stream::StreamDecoder;

use bpe::BpeConfig;
use std::collections::{BTreeSet, HashMap};
use vocab::Vocab;

/// Token attribute bits (llama.cpp's `llama_token_attr`).
pub mod attr {
    pub const UNDEFINED: u32 = 0;
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
    pub const LSTRIP: u32 = 1 << 7;
    pub const RSTRIP: u32 = 1 << 8;
}

/// Errors building a tokenizer; each names the file (or source) and the offending key.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{file}: missing tokenizer key {key}")]
    MissingKey { file: String, key: &'static str },
    #[error("{file}: tokenizer key {key}: expected {expected}, found {found}")]
    WrongType {
        file: String,
        key: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("{file}: unsupported tokenizer.ggml.model '{model}' (supported: llama, gpt2, gemma4)")]
    UnsupportedModel { file: String, model: String },
    #[error("{file}: unsupported tokenizer.ggml.pre '{pre}'")]
    UnsupportedPre { file: String, pre: String },
    #[error("{file}: {key} has {found} entries, expected at least {expected} (one per token)")]
    LengthMismatch {
        file: String,
        key: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("{file}: tokenizer.ggml.tokens is empty")]
    EmptyVocab { file: String },
}

/// Plain vocabulary data, as stored under `tokenizer.ggml.*` (ids not yet validated).
#[derive(Debug, Clone, Default)]
pub struct VocabData {
    /// `tokenizer.ggml.model`: `llama` (SentencePiece), `gpt2` (byte-level BPE) or `gemma4`.
    pub model: String,
    /// `tokenizer.ggml.pre`: the BPE pre-tokenizer name.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub scores: Option<Vec<f32>>,
    /// llama.cpp token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// BPE merges, `"left right"`, in rank order.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `general.name` (llama.cpp sets Phi-3's strip attributes by name).
    pub name: Option<String>,
}

/// Special token ids, each only if present in the vocab.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub sep: Option<u32>,
    pub pad: Option<u32>,
    pub fim_pad: Option<u32>,
    pub fim_rep: Option<u32>,
    pub fim_sep: Option<u32>,
}

#[derive(Debug, Clone)]
enum Kind {
    Spm,
    Bpe(Box<BpeConfig>),
}

/// Sorted (byte, child) edges and the token ending at this node, if any.
type TrieNode = (Vec<(u8, u32)>, Option<u32>);

/// A byte trie over special-token texts, to find which ones occur in a text quickly.
#[derive(Debug, Clone, Default)]
struct SpecialTrie {
    nodes: Vec<TrieNode>,
}

impl SpecialTrie {
    fn insert(&mut self, text: &[u8], id: u32) {
        if self.nodes.is_empty() {
            self.nodes.push((Vec::new(), None));
        }
        let mut node = 0usize;
        for &b in text {
            let edges = &self.nodes[node].0;
            node = match edges.binary_search_by_key(&b, |e| e.0) {
                Ok(i) => edges[i].1 as usize,
                Err(i) => {
                    let child = self.nodes.len() as u32;
                    self.nodes[node].0.insert(i, (b, child));
                    self.nodes.push((Vec::new(), None));
                    child as usize
                }
            };
        }
        self.nodes[node].1.get_or_insert(id);
    }

    /// Marks `present[v]` for the value `v` of every text occurring anywhere in `text`.
    fn occurring(&self, text: &[u8], present: &mut [bool]) {
        if self.nodes.is_empty() {
            return;
        }
        for start in 0..text.len() {
            let mut node = 0usize;
            for &b in &text[start..] {
                let edges = &self.nodes[node].0;
                match edges.binary_search_by_key(&b, |e| e.0) {
                    Ok(i) => node = edges[i].1 as usize,
                    Err(_) => break,
                }
                if let Some(id) = self.nodes[node].1 {
                    present[id as usize] = true;
                }
            }
        }
    }
}

/// A tokenizer for one model's vocabulary.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    kind: Kind,
    special: SpecialIds,
    eog: BTreeSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    escape_whitespaces: bool,
    clean_spaces: bool,
    /// Control, user-defined and unknown tokens, longest text first.
    special_cache: Vec<u32>,
    special_trie: SpecialTrie,
    /// Each token's piece with special tokens rendered (llama.cpp's piece cache).
    pieces: Vec<Vec<u8>>,
    unicode_to_byte: HashMap<char, u8>,
}

enum Fragment {
    Text(usize, usize),
    Token(u32),
}

/// C `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

impl Tokenizer {
    /// Builds a tokenizer from plain vocab data; `source` names it in errors.
    pub fn from_vocab(data: VocabData, source: &str) -> Result<Tokenizer, TokenizerError> {
        vocab::build(data, source)
    }

    fn finish_build(&mut self) {
        let table = pretokenize::byte_to_unicode_table();
        self.unicode_to_byte = table
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        for (i, &id) in self.special_cache.iter().enumerate() {
            self.special_trie
                .insert(self.vocab.texts[id as usize].as_bytes(), i as u32);
        }
        self.pieces = (0..self.vocab.texts.len() as u32)
            .map(|id| self.compute_piece(id))
            .collect();
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.vocab.texts.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.special.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.special.eos
    }
    pub fn eot(&self) -> Option<u32> {
        self.special.eot
    }
    /// All special ids (bos, eos, eot, eom, unk, sep, pad, fim).
    pub fn special_ids(&self) -> SpecialIds {
        self.special
    }
    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// True for tokens that end generation (EOS, EOT, `<end_of_turn>`, `<|im_end|>`, ...).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }
    /// The end-of-generation ids.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }
    /// The token's vocab text (with SentencePiece `▁` or GPT-2 byte symbols), if in range.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.texts.get(id as usize).map(String::as_str)
    }
    /// The token's attribute bits (see [`attr`]); 0 when out of range.
    pub fn token_attr(&self, id: u32) -> u32 {
        self.vocab
            .attrs
            .get(id as usize)
            .copied()
            .unwrap_or(attr::UNDEFINED)
    }
    /// The id of the token whose vocab text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.token_id(text)
    }
    /// True for control and unknown tokens (not rendered by default when decoding).
    pub fn is_control(&self, id: u32) -> bool {
        self.token_attr(id) & (attr::CONTROL | attr::UNKNOWN) != 0
    }

    /// Encodes `text`. `add_special` adds BOS/EOS as the model asks; `parse_special` turns
    /// control-token texts in `text` (e.g. `<start_of_turn>`) into their ids (user-defined
    /// tokens are always matched, as in llama.cpp).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        let frags = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.special.bos);
        }
        match &self.kind {
            Kind::Spm => {
                let mut prev_special = true;
                let mut buf = String::new();
                for f in &frags {
                    match *f {
                        Fragment::Text(s, e) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push('\u{2581}');
                            }
                            push_escaped(&mut buf, &text[s..e]);
                            spm::tokenize(&self.vocab, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Kind::Bpe(cfg) => {
                let mut buf = String::new();
                for f in &frags {
                    match *f {
                        Fragment::Text(s, e) if self.escape_whitespaces => {
                            buf.clear();
                            push_escaped(&mut buf, &text[s..e]);
                            bpe::tokenize(&self.vocab, cfg, &buf, &mut out);
                        }
                        Fragment::Text(s, e) => {
                            bpe::tokenize(&self.vocab, cfg, &text[s..e], &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.special.eos);
        }
        out
    }

    /// Splits `text` at special-token texts, longest tokens first (llama.cpp's
    /// `tokenizer_st_partition`).
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = vec![Fragment::Text(0, text.len())];
        if text.is_empty() {
            return Vec::new();
        }
        // Only special tokens occurring at all need the (llama.cpp-order) partition pass.
        let mut present = vec![false; self.special_cache.len()];
        self.special_trie.occurring(text.as_bytes(), &mut present);
        let bytes = text.as_bytes();
        for (i, &id) in self.special_cache.iter().enumerate() {
            if !present[i] {
                continue;
            }
            let a = self.vocab.attrs[id as usize];
            if !parse_special && a & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let pat = self.vocab.texts[id as usize].as_str();
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(s, e) = f else {
                    next.push(f);
                    continue;
                };
                let mut off = s;
                while let Some(rel) = text[off..e].find(pat) {
                    let m = off + rel;
                    let mut left_end = m;
                    if a & attr::LSTRIP != 0 {
                        while left_end > off && is_c_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > off {
                        next.push(Fragment::Text(off, left_end));
                    }
                    next.push(Fragment::Token(id));
                    off = m + pat.len();
                    if a & attr::RSTRIP != 0 {
                        while off < e && is_c_space(bytes[off]) {
                            off += 1;
                        }
                    }
                }
                if off < e {
                    next.push(Fragment::Text(off, e));
                }
            }
            frags = next;
        }
        frags
    }

    fn compute_piece(&self, id: u32) -> Vec<u8> {
        let a = self.vocab.attrs[id as usize];
        let text = &self.vocab.texts[id as usize];
        if a & (attr::CONTROL | attr::UNKNOWN | attr::USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if a & attr::NORMAL != 0 {
            return match &self.kind {
                Kind::Bpe(_) if !self.escape_whitespaces => self.decode_byte_level(text),
                _ => text.replace('\u{2581}', " ").into_bytes(),
            };
        }
        if a & attr::BYTE != 0 {
            // `<0xNN>`
            if let Some(b) = text.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                return vec![b];
            }
        }
        Vec::new()
    }

    fn decode_byte_level(&self, text: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match self.unicode_to_byte.get(&c) {
                Some(&b) => out.push(b),
                None => {
                    out.extend_from_slice(b"[UNK_BYTE_0x");
                    let mut tmp = [0u8; 4];
                    for b in c.encode_utf8(&mut tmp).bytes() {
                        out.extend_from_slice(format!("{b:02x}").as_bytes());
                    }
                    out.extend_from_slice(text.as_bytes());
                    out.push(b']');
                }
            }
        }
        out
    }

    /// The raw bytes a token stands for, with special tokens rendered as their text
    /// (empty for out-of-range ids, unused and undefined tokens).
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        self.piece(id).to_vec()
    }

    /// Like [`Tokenizer::token_to_piece`] without copying.
    pub fn piece(&self, id: u32) -> &[u8] {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// llama.cpp's `llama_detokenize`: concatenated pieces as bytes. `remove_special` drops a
    /// leading BOS / trailing EOS the model adds; `unparse_special` renders control tokens.
    /// The leading space of SentencePiece's space prefix is removed, and vocabs flagged
    /// `clean_spaces` get llama.cpp's clean-up of spaces before punctuation.
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> Vec<u8> {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && Some(ids[0]) == self.special.bos {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special
            && self.add_eos
            && !ids.is_empty()
            && Some(ids[ids.len() - 1]) == self.special.eos
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if !unparse_special && self.is_control(id) {
                remove_space = false;
                continue;
            }
            let mut p = self.piece(id);
            if remove_space && p.first() == Some(&b' ') {
                p = &p[1..];
            }
            remove_space = false;
            text.extend_from_slice(p);
        }
        if self.clean_spaces {
            text = clean_up_spaces(&text);
        }
        text
    }

    /// Decodes ids to text (control tokens omitted; invalid UTF-8 replaced by U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.detokenize(ids, false, false)).into_owned()
    }

    /// A streaming decoder over this vocabulary.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder::new(self)
    }
}

fn push_escaped(buf: &mut String, s: &str) {
    for c in s.chars() {
        buf.push(if c == ' ' { '\u{2581}' } else { c });
    }
}

/// llama.cpp's three in-place clean-up passes (`clean_up_tokenization_spaces`), ported
/// literally (including its quirk of zeroing the space after a lone `' `).
fn clean_up_spaces(text: &[u8]) -> Vec<u8> {
    let mut t = text.to_vec();
    // 1: " ?", " !", " .", " ," lose the space.
    let n = t.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    // 2: a lone apostrophe between spaces, " ' ", loses both spaces.
    let n = t.len();
    let mut total = usize::from(n > 0);
    let mut i = 1;
    while i < n {
        let x = t[i];
        if x == b'\'' && i + 1 < n && t[i - 1] == b' ' && t[i + 1] == b' ' {
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }
    t.truncate(total);
    // 3: " 's", " 'm", " 're", " 've" lose the space.
    let n = t.len();
    let mut total = usize::from(n > 0);
    for i in 1..n {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < n {
            let x1 = t[i + 1];
            if matches!(x1, b's' | b'm')
                || (i + 2 < n && matches!((x1, t[i + 2]), (b'r', b'e') | (b'v', b'e')))
            {
                total -= 1;
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
    t
}

#[cfg(test)]
mod tests;
