//! Constrained decoding: grammars that restrict which tokens may be sampled, through
//! `llguidance` (the engine llama.cpp, vLLM and SGLang use).
//!
//! Owns: [`Constrainer`] (built once per model: the token trie of the model's vocabulary
//! and llguidance's parser factory), [`Spec`] (a JSON schema or a Lark grammar, and GBNF
//! translated to Lark by `gbnf.rs`), compiling a spec (errors are a 400 naming the problem)
//! and [`JobConstraint`], the per-request state the generate loop asks for the mask before
//! each sample and tells each sampled token. Masking sets forbidden logits to -inf before
//! the sampler runs, so greedy and seeded sampling stay deterministic. The time of each
//! mask is recorded (`mask_secs`) for the cost report. It does not own which spec a request
//! asks for (`agent.rs`).
//!
//! The trie holds each token's bytes; control tokens get llguidance's special marker
//! (0xFF + their text) so plain text in a grammar never matches them (except reasoning and
//! tool-call markers, which answers show as text), and the model's end-of-generation
//! tokens are the grammar's EOS (allowed where the grammar may end).

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use sluice_engine::text::tokenizer::Tokenizer;

/// The tokenizer as llguidance sees it.
struct Env {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(t) => self.tok.encode(t, false, false),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    /// Not canonical for llguidance: the model may spell text with any tokens, and a
    /// marker held as one control token (`<think>`) is not what `tokenize_bytes` (no
    /// special tokens parsed) gives; canonical would forbid it (regression test below).
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// What a request constrains its output to.
#[derive(Debug, Clone)]
pub enum Spec {
    /// A JSON schema (`response_format`, forced tool arguments).
    JsonSchema(Value),
    /// A Lark grammar (llguidance's dialect; may embed `%json {...}`).
    Lark(String),
}

/// The per-model constraint compiler.
pub struct Constrainer {
    factory: ParserFactory,
    n_logits: usize,
}

impl Constrainer {
    /// Build the trie of `tok`'s vocabulary for a model with `n_logits` outputs.
    pub fn new(tok: Arc<Tokenizer>, n_logits: usize) -> Result<Constrainer, String> {
        let n = tok.n_vocab().max(n_logits);
        // Marker tokens are shown as text in answers (`plan.rs`): grammars match them as text.
        let shown = crate::plan::marker_ids(&tok);
        let mut words: Vec<Vec<u8>> = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let piece = tok.piece(id);
            if (tok.is_control(id) && !shown.contains(&id)) || tok.is_eog(id) {
                let text = tok.token_text(id).unwrap_or("");
                let mut w = Vec::with_capacity(text.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(text.as_bytes());
                words.push(if text.is_empty() { Vec::new() } else { w });
            } else {
                words.push(piece.to_vec());
            }
        }
        let eog: Vec<u32> = tok.eog_ids().collect();
        let eos = tok.eos().or(eog.first().copied()).unwrap_or(0);
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tok.bos();
        let mut trie = TokTrie::from(&info, &words);
        if !eog.is_empty() {
            trie = trie.with_eos_tokens(&eog);
        }
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Grammar warnings and errors come back through `compile`, not stderr.
        factory.quiet();
        Ok(Constrainer { factory, n_logits })
    }

    /// Compile `spec` into a fresh per-request constraint; the error says what is wrong
    /// with the schema or grammar.
    pub fn compile(&self, spec: &Spec) -> Result<JobConstraint, String> {
        let grammar = match spec {
            Spec::JsonSchema(schema) => {
                // No free whitespace between JSON tokens: small models otherwise fill
                // max_tokens with newlines inside a valid object.
                let mut schema = schema.clone();
                if let Value::Object(o) = &mut schema {
                    o.entry("x-guidance")
                        .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
                } else if !schema.is_boolean() {
                    return Err("the JSON schema must be an object".into());
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Spec::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(JobConstraint {
            matcher,
            n_logits: self.n_logits,
            mask_secs: Vec::new(),
        })
    }
}

/// One request's grammar state.
pub struct JobConstraint {
    matcher: Matcher,
    n_logits: usize,
    /// Seconds each mask took (the cost per constrained token).
    pub mask_secs: Vec<f64>,
}

impl JobConstraint {
    /// Set the logits of tokens the grammar forbids now to -inf.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let t0 = Instant::now();
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("constrained decoding: {e}"))?;
        // 32 tokens per mask word; whole allowed words are skipped.
        let words = mask.as_slice();
        let n = logits.len().min(self.n_logits);
        for (k, chunk) in logits[..n].chunks_mut(32).enumerate() {
            let w = words.get(k).copied().unwrap_or(0);
            if w == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if w & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        // Outputs past the model's logits count (never in the trie) stay forbidden.
        for l in logits[n..].iter_mut() {
            *l = f32::NEG_INFINITY;
        }
        self.mask_secs.push(t0.elapsed().as_secs_f64());
        Ok(())
    }

    /// The sampled token; afterwards `done` says whether the grammar is complete.
    pub fn commit(&mut self, id: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| format!("constrained decoding: {e}"))
    }

    /// Whether the grammar has ended (nothing but end-of-generation may follow).
    pub fn done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
/// Whether `spec` accepts exactly `text` (byte-level vocabulary: every byte a token).
pub(crate) fn byte_level_accepts(spec: &Spec, text: &str) -> Result<bool, String> {
    use llguidance::api::TopLevelGrammar;
    use llguidance::toktrie::ApproximateTokEnv;
    let env = ApproximateTokEnv::single_byte_env();
    let f = llguidance::ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    let g = match spec {
        Spec::Lark(s) => TopLevelGrammar::from_lark(s.clone()),
        Spec::JsonSchema(v) => TopLevelGrammar::from_json_schema(v.clone()),
    };
    let mut m = llguidance::Matcher::new(f.create_parser(g));
    if let Some(e) = m.get_error() {
        return Err(e);
    }
    let toks = env.tokenize_bytes(text.as_bytes());
    Ok(m.consume_tokens(&toks).is_ok() && m.is_accepting().unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_engine::text::tokenizer::VocabData;

    /// A byte-level vocabulary where `<think>` / `</think>` are control tokens (as some
    /// GGUFs mark them) and `<|end|>` ends generation.
    fn vocab() -> Tokenizer {
        let tokens = [
            "Ġ", "h", "i", "hi", "<", "t", "k", ">", "/", "n", "<think>", "</think>", "<|end|>",
        ];
        let data = VocabData {
            model: "gpt2".into(),
            pre: Some("qwen2".into()),
            token_types: Some(vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3]),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            merges: vec!["h i".into()],
            // (BPE vocabularies default BOS / EOS to id 11, here `</think>`.)
            bos: Some(12),
            eos: Some(12),
            ..Default::default()
        };
        Tokenizer::from_vocab(data, "test").unwrap()
    }

    fn allowed(c: &mut JobConstraint, n: usize) -> Vec<u32> {
        let mut l = vec![0.0f32; n];
        c.apply(&mut l).unwrap();
        (0..n as u32).filter(|&i| l[i as usize] == 0.0).collect()
    }

    /// Marker tokens held as control are matched as their text by a grammar, other
    /// control tokens never, the end-of-generation token only where the grammar may end;
    /// the grammar stops once complete.
    #[test]
    fn markers_match_as_text_and_eos_only_at_the_end() {
        let tok = Arc::new(vocab());
        assert_eq!(crate::plan::marker_ids(&tok), vec![10, 11]);
        let n = tok.n_vocab();
        let c = Constrainer::new(tok.clone(), n).unwrap();
        let mut j = c
            .compile(&Spec::Lark(
                "start: \"<think>\" \"hi\" \"</think>\" (\"hi\")?".into(),
            ))
            .unwrap();
        // `<think>` as one control token, or spelled with "<" (then "t", ...).
        assert_eq!(allowed(&mut j, n), vec![4, 10]);
        j.commit(10).unwrap();
        assert_eq!(allowed(&mut j, n), vec![1, 3]);
        j.commit(3).unwrap();
        assert_eq!(allowed(&mut j, n), vec![4, 11]);
        j.commit(11).unwrap();
        // The optional tail or the end.
        assert_eq!(allowed(&mut j, n), vec![1, 3, 12]);
        assert!(!j.done());
        j.commit(3).unwrap();
        assert!(j.done());
        assert_eq!(j.mask_secs.len(), 4);
        // A bad grammar is an error naming the problem.
        let e = c.compile(&Spec::Lark("start: nope".into())).err().unwrap();
        assert!(e.contains("nope"), "{e}");
        let e = c
            .compile(&Spec::JsonSchema(serde_json::json!(3)))
            .err()
            .unwrap();
        assert!(e.contains("object"), "{e}");
    }
}
