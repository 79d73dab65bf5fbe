//! The shape of an answer: generated text split into reasoning, content and tool calls,
//! streamed or whole, the same either way.
//!
//! Owns: [`Shaper`] (the reasoning split, then the tool-call stream over the content) and
//! [`Out`]. The API framing of each piece (`delta.reasoning_content`, `delta.tool_calls`,
//! Anthropic `thinking` / `tool_use` blocks) stays in `routes.rs`. Content is never lost:
//! a call block that does not parse is given back as content.

use crate::reasoning::{Markers, Piece, ReasoningSplit};
use crate::toolcall::{Format, ToolCall, ToolDef, ToolPiece, ToolStream};

/// One piece of an answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    Reasoning(String),
    Content(String),
    Calls(Vec<ToolCall>),
}

/// How a request's answer is read.
#[derive(Debug, Clone)]
pub struct ShapeCfg {
    pub markers: Markers,
    /// The prompt opened a reasoning block.
    pub inside: bool,
    /// Calls are parsed in this format (None: `tool_choice` none, or no tools).
    pub tools: Option<(Format, Vec<ToolDef>)>,
}

/// Streaming splitter of one answer.
#[derive(Debug, Clone)]
pub struct Shaper {
    split: ReasoningSplit,
    tools: Option<ToolStream>,
}

impl Shaper {
    pub fn new(cfg: ShapeCfg) -> Shaper {
        Shaper {
            split: ReasoningSplit::new(cfg.markers, cfg.inside),
            tools: cfg.tools.map(|(f, defs)| ToolStream::new(f, defs)),
        }
    }

    fn route(&mut self, pieces: Vec<Piece>, out: &mut Vec<Out>) {
        for p in pieces {
            match p {
                Piece::Reasoning(t) => out.push(Out::Reasoning(t)),
                Piece::Content(t) => match &mut self.tools {
                    None => out.push(Out::Content(t)),
                    Some(ts) => {
                        for q in ts.push(&t) {
                            out.push(match q {
                                ToolPiece::Content(c) => Out::Content(c),
                                ToolPiece::Calls(c) => Out::Calls(c),
                            });
                        }
                    }
                },
            }
        }
    }

    /// The next piece of generated text.
    pub fn push(&mut self, text: &str) -> Vec<Out> {
        let mut out = Vec::new();
        let pieces = self.split.push(text);
        self.route(pieces, &mut out);
        out
    }

    /// End of generation: everything still held.
    pub fn finish(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        let pieces = self.split.finish();
        self.route(pieces, &mut out);
        if let Some(ts) = &mut self.tools {
            let (pieces, bad) = ts.finish();
            if let Some(e) = bad {
                eprintln!(
                    "sluice serve: a tool-call block did not parse ({}); sent as content",
                    e.0
                );
            }
            for q in pieces {
                out.push(match q {
                    ToolPiece::Content(c) => Out::Content(c),
                    ToolPiece::Calls(c) => Out::Calls(c),
                });
            }
        }
        out
    }
}

/// A whole answer: (reasoning, content, calls).
pub fn whole(cfg: ShapeCfg, text: &str) -> (String, String, Vec<ToolCall>) {
    let mut s = Shaper::new(cfg);
    let mut v = s.push(text);
    v.extend(s.finish());
    let (mut r, mut c, mut k) = (String::new(), String::new(), Vec::new());
    for o in v {
        match o {
            Out::Reasoning(t) => r.push_str(&t),
            Out::Content(t) => c.push_str(&t),
            Out::Calls(x) => k.extend(x),
        }
    }
    (r, c, k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::THINK;
    use serde_json::json;

    #[test]
    fn reasoning_then_call_streamed_equals_whole() {
        let cfg = ShapeCfg {
            markers: THINK,
            inside: false,
            tools: Some((
                Format::Hermes,
                vec![ToolDef {
                    name: "f".into(),
                    description: String::new(),
                    parameters: json!({}),
                }],
            )),
        };
        let text = "<think>call f</think>\n\nOk.<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let (r, c, k) = whole(cfg.clone(), text);
        assert_eq!((r.as_str(), c.as_str()), ("call f", "Ok."));
        assert_eq!(k.len(), 1);
        assert_eq!(k[0].arguments_json(), "{\"x\":1}");
        // Token-sized pieces.
        let mut s = Shaper::new(cfg);
        let mut got = Vec::new();
        for ch in text.chars() {
            got.extend(s.push(&ch.to_string()));
        }
        got.extend(s.finish());
        let (mut r2, mut c2, mut k2) = (String::new(), String::new(), Vec::new());
        for o in got {
            match o {
                Out::Reasoning(t) => r2.push_str(&t),
                Out::Content(t) => c2.push_str(&t),
                Out::Calls(x) => k2.extend(x),
            }
        }
        assert_eq!((r2, c2, k2), (r, c, k));
    }
}
