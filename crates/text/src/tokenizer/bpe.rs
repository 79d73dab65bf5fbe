//! Byte-pair-encoding tokenization (llama.cpp's `llm_tokenizer_bpe`): pre-tokenize into
//! words, map bytes to GPT-2's printable code points (unless the vocab is SentencePiece-style
//! BPE like Gemma 4), then within each word repeatedly apply the lowest-ranked merge
//! (ties: leftmost) and emit each final piece as its token or per-byte fallback tokens.

use super::Vocab;
use std::cmp::Ordering;
use std::collections::BinaryHeap;

#[derive(Clone, Copy)]
struct Symbol {
    prev: Option<usize>,
    next: Option<usize>,
    start: usize,
    len: usize,
}

struct Bigram {
    left: usize,
    right: usize,
    rank: u32,
    left_len: usize,
    right_len: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: lowest rank first, then lowest left index.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Tokenizes one raw-text fragment (no special tokens inside) and appends ids to `out`.
pub(crate) fn tokenize(vocab: &Vocab, bpe: &BpeConfig, text: &str, out: &mut Vec<u32>) {
    let mut word = String::new();
    let mut symbols: Vec<Symbol> = Vec::new();
    let mut queue: BinaryHeap<Bigram> = BinaryHeap::new();
    for range in bpe.pre.split(text) {
        let raw = &text[range];
        word.clear();
        if bpe.byte_encode {
            for &b in raw.as_bytes() {
                word.push(bpe.byte_to_char[b as usize]);
            }
        } else {
            word.push_str(raw);
        }
        let word = word.as_str();

        symbols.clear();
        queue.clear();
        let whole_token =
            if bpe.ignore_merges || (bpe.newline_words && word.bytes().all(|b| b == b'\n')) {
                vocab.token_id(word)
            } else {
                None
            };
        if whole_token.is_some() {
            symbols.push(Symbol {
                prev: None,
                next: None,
                start: 0,
                len: word.len(),
            });
        } else {
            let n = word.chars().count();
            for (i, (start, c)) in word.char_indices().enumerate() {
                symbols.push(Symbol {
                    prev: i.checked_sub(1),
                    next: (i + 1 < n).then_some(i + 1),
                    start,
                    len: c.len_utf8(),
                });
            }
        }

        let add = |symbols: &[Symbol],
                   queue: &mut BinaryHeap<Bigram>,
                   left: Option<usize>,
                   right: Option<usize>| {
            let (Some(left), Some(right)) = (left, right) else {
                return;
            };
            let (l, r) = (symbols[left], symbols[right]);
            let ls = &word[l.start..l.start + l.len];
            let rs = &word[r.start..r.start + r.len];
            if let Some(rank) = vocab.merge_rank(ls, rs) {
                queue.push(Bigram {
                    left,
                    right,
                    rank,
                    left_len: l.len,
                    right_len: r.len,
                });
            }
        };
        for i in 1..symbols.len() {
            add(&symbols, &mut queue, Some(i - 1), Some(i));
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale entry: one side was merged away or grew since the pair was queued.
            if l.len == 0 || r.len == 0 || l.len != b.left_len || r.len != b.right_len {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(nx) = r.next {
                symbols[nx].prev = Some(b.left);
            }
            let (prev, next) = (symbols[b.left].prev, symbols[b.left].next);
            add(&symbols, &mut queue, prev, Some(b.left));
            add(&symbols, &mut queue, Some(b.left), next);
        }

        for s in symbols.iter().filter(|s| s.len > 0) {
            let piece = &word[s.start..s.start + s.len];
            if let Some(id) = vocab.token_id(piece) {
                out.push(id);
                continue;
            }
            for &b in piece.as_bytes() {
                let id = if bpe.byte_encode {
                    // llama.cpp looks up each byte of the encoded piece as a one-byte string.
                    if b.is_ascii() {
                        vocab.token_id(std::str::from_utf8(&[b]).unwrap_or(""))
                    } else {
                        None
                    }
                } else {
                    vocab.byte_token(b)
                };
                if let Some(id) = id {
                    out.push(id);
                }
            }
        }
    }
}

/// How a BPE vocab pre-tokenizes and encodes words.
#[derive(Debug, Clone)]
pub(crate) struct BpeConfig {
    pub pre: super::PreTokenizer,
    /// GPT-2 byte-to-unicode encoding of words (false for SentencePiece-style BPE).
    pub byte_encode: bool,
    /// A word that is itself a token is emitted whole (llama3-style `ignore_merges`).
    pub ignore_merges: bool,
    /// Gemma 4: a word made only of newlines is emitted whole when it is a token.
    pub newline_words: bool,
    pub byte_to_char: [char; 256],
}
