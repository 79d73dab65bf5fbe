//! SentencePiece-style tokenization (llama.cpp's `llm_tokenizer_spm`): start from single
//! UTF-8 characters, repeatedly merge the adjacent pair whose concatenation is the vocab
//! token with the highest score (ties: leftmost), then emit each final piece as its token or,
//! if it is not in the vocab, as byte-fallback tokens.

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
    score: f32,
    size: usize,
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
    /// Max-heap order: higher score first, then lower left index.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Tokenizes already-escaped text (spaces replaced by U+2581) and appends ids to `out`.
pub(crate) fn tokenize(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        symbols.push(Symbol {
            prev: i.checked_sub(1),
            next: None,
            start,
            len: c.len_utf8(),
        });
    }
    let n = symbols.len();
    for (i, s) in symbols.iter_mut().enumerate() {
        s.next = (i + 1 < n).then_some(i + 1);
    }
    if n == 0 {
        return;
    }

    let mut queue = BinaryHeap::new();
    let try_add = |symbols: &[Symbol],
                   queue: &mut BinaryHeap<Bigram>,
                   left: Option<usize>,
                   right: Option<usize>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let l = symbols[left];
        let r = symbols[right];
        let piece = &text[l.start..l.start + l.len + r.len];
        if let Some(id) = vocab.token_id(piece) {
            queue.push(Bigram {
                left,
                right,
                score: vocab.score(id),
                size: piece.len(),
            });
        }
    };

    for i in 1..n {
        try_add(&symbols, &mut queue, Some(i - 1), Some(i));
    }

    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if let Some(nx) = r.next {
            symbols[nx].prev = Some(b.left);
        }
        let prev = symbols[b.left].prev;
        let next = symbols[b.left].next;
        try_add(&symbols, &mut queue, prev, Some(b.left));
        try_add(&symbols, &mut queue, Some(b.left), next);
    }

    let mut i = Some(0);
    while let Some(idx) = i {
        let s = symbols[idx];
        let piece = &text[s.start..s.start + s.len];
        match vocab.token_id(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    if let Some(id) = vocab.byte_token(b) {
                        out.push(id);
                    }
                }
            }
        }
        i = s.next;
    }
}
