//! The reasoning split: text between a template's reasoning markers (`<think>` ...
//! `</think>`, Gemma 4's `<|channel>thought` ... `<channel|>`) is reasoning, not content.
//!
//! Owns: [`Markers`] (which pair a chat template uses) and [`ReasoningSplit`], a streaming
//! splitter fed generated text piece by piece. A marker may arrive split across pieces
//! (tokens): text that could be the start of the marker being looked for is held back
//! until the next piece decides. Reasoning is recognized only at the start of the answer
//! (before any content), where every reasoning template puts it; a block still open at
//! the end of generation is reasoning, never content. It does not own the API shapes
//! (`reasoning_content`, Anthropic `thinking` blocks): `shape.rs` does.

/// A template's reasoning delimiters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Markers {
    pub open: &'static str,
    pub close: &'static str,
}

/// DeepSeek R1/V3.x/V4, Qwen3, GLM-4.5+/5.x, and the default for templates naming none.
pub const THINK: Markers = Markers {
    open: "<think>",
    close: "</think>",
};

/// Gemma 4's thinking channel (`<|channel>thought\n...<channel|>`).
pub const GEMMA4: Markers = Markers {
    open: "<|channel>thought",
    close: "<channel|>",
};

impl Markers {
    /// The markers the template `source` writes (`<think>` when it writes none: a model
    /// that never reasons never emits it).
    pub fn for_template(source: &str) -> Markers {
        if source.contains("<|channel>") && source.contains("<channel|>") {
            GEMMA4
        } else {
            THINK
        }
    }

    /// Whether a prompt ending in `prompt_tail` leaves the model inside a reasoning block
    /// (the generation prompt opened it: GLM's `<|assistant|><think>`, DeepSeek's thinking
    /// mode `<｜Assistant｜><think>`).
    pub fn opened_by(&self, prompt_tail: &str) -> bool {
        prompt_tail.trim_end().ends_with(self.open)
    }
}

/// One piece of split output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

/// Where the splitter is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace seen: an opening marker may still come.
    Start,
    /// Inside a reasoning block.
    Reasoning,
    /// Right after the closing marker: leading whitespace of the content is dropped.
    AfterClose,
    /// Content; markers are no longer looked for.
    Content,
}

/// Streaming splitter of generated text into reasoning and content.
#[derive(Debug, Clone)]
pub struct ReasoningSplit {
    m: Markers,
    state: State,
    /// Text not yet emitted (a possible marker start, or leading whitespace).
    held: String,
    /// Whether any reasoning text was emitted (leading newlines of reasoning are dropped).
    reasoned: bool,
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker` (on char
/// boundaries).
fn partial_suffix(s: &str, marker: &str) -> usize {
    let max = s.len().min(marker.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && marker.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

impl ReasoningSplit {
    /// A splitter; `inside` when the prompt already opened the reasoning block.
    pub fn new(m: Markers, inside: bool) -> ReasoningSplit {
        ReasoningSplit {
            m,
            state: if inside {
                State::Reasoning
            } else {
                State::Start
            },
            held: String::new(),
            reasoned: false,
        }
    }

    /// Whether the splitter is inside a reasoning block now.
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Reasoning
    }

    fn reasoning(&mut self, out: &mut Vec<Piece>, s: &str) {
        let s = if self.reasoned {
            s
        } else {
            s.trim_start_matches(['\n', '\r'])
        };
        if !s.is_empty() {
            self.reasoned = true;
            out.push(Piece::Reasoning(s.to_string()));
        }
    }

    /// Feed the next piece of text; returns what can be decided now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            match self.state {
                State::Start => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        return out;
                    }
                    if let Some(rest) = t.strip_prefix(self.m.open) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning;
                        continue;
                    }
                    if self.m.open.starts_with(t) {
                        return out; // maybe the marker, wait
                    }
                    self.state = State::Content;
                }
                State::Reasoning => {
                    if let Some(pos) = self.held.find(self.m.close) {
                        let before = self.held[..pos].to_string();
                        let rest = self.held[pos + self.m.close.len()..].to_string();
                        self.reasoning(&mut out, before.trim_end_matches(['\n', '\r']));
                        self.held = rest;
                        self.state = State::AfterClose;
                        continue;
                    }
                    let keep = partial_suffix(&self.held, self.m.close);
                    // Trailing newlines may be the ones before the closing marker (dropped
                    // with it): hold them too.
                    let body = &self.held[..self.held.len() - keep];
                    let cut = body.trim_end_matches(['\n', '\r']).len();
                    let emit = self.held[..cut].to_string();
                    self.held.drain(..cut);
                    self.reasoning(&mut out, &emit);
                    return out;
                }
                State::AfterClose => {
                    let t = self.held.trim_start();
                    if t.is_empty() {
                        self.held.clear();
                        return out;
                    }
                    self.held = t.to_string();
                    self.state = State::Content;
                }
                State::Content => {
                    if !self.held.is_empty() {
                        out.push(Piece::Content(std::mem::take(&mut self.held)));
                    }
                    return out;
                }
            }
        }
    }

    /// End of generation: what is still held. An unclosed block stays reasoning; a
    /// partial opening marker alone is content (it never completed).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Reasoning => {
                let t = held.trim_end_matches(['\n', '\r']);
                self.reasoning(&mut out, t);
            }
            // Whitespace alone is content too (a plain answer is passed through whole).
            State::Start | State::Content => {
                if !held.is_empty() {
                    out.push(Piece::Content(held));
                }
            }
            State::AfterClose => {}
        }
        self.state = State::Content;
        out
    }
}

/// Split a whole text at once (the non-streamed answer): (reasoning, content).
pub fn split_all(m: Markers, inside: bool, text: &str) -> (String, String) {
    let mut s = ReasoningSplit::new(m, inside);
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let (mut r, mut c) = (String::new(), String::new());
    for p in pieces {
        match p {
            Piece::Reasoning(t) => r.push_str(&t),
            Piece::Content(t) => c.push_str(&t),
        }
    }
    (r, c)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feed `chunks` one by one; concatenate reasoning and content.
    fn stream(m: Markers, inside: bool, chunks: &[&str]) -> (String, String) {
        let mut s = ReasoningSplit::new(m, inside);
        let mut pieces = Vec::new();
        for c in chunks {
            pieces.extend(s.push(c));
        }
        pieces.extend(s.finish());
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            match p {
                Piece::Reasoning(t) => r.push_str(&t),
                Piece::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    /// Every way of cutting `text` into two or three pieces gives the same split as the
    /// whole text (markers split across tokens).
    fn all_cuts_agree(m: Markers, inside: bool, text: &str, want: (&str, &str)) {
        let want = (want.0.to_string(), want.1.to_string());
        assert_eq!(split_all(m, inside, text), want, "whole: {text:?}");
        let b: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &i in &b {
            for &j in b.iter().filter(|&&j| j >= i) {
                let got = stream(m, inside, &[&text[..i], &text[i..j], &text[j..]]);
                assert_eq!(got, want, "cuts {i},{j} of {text:?}");
            }
        }
    }

    #[test]
    fn think_block_then_content() {
        all_cuts_agree(
            THINK,
            false,
            "<think>\nThe user greets.\n</think>\n\nHello!",
            ("The user greets.", "Hello!"),
        );
    }

    #[test]
    fn unclosed_block_is_reasoning_never_content() {
        all_cuts_agree(
            THINK,
            false,
            "<think>Let me count: 1, 2, 3",
            ("Let me count: 1, 2, 3", ""),
        );
        // Opened by the prompt (GLM / DeepSeek thinking mode), never closed.
        all_cuts_agree(
            THINK,
            true,
            "still thinking </thi",
            ("still thinking </thi", ""),
        );
    }

    #[test]
    fn opened_by_the_prompt() {
        all_cuts_agree(
            THINK,
            true,
            "weigh options</think>Answer: 4",
            ("weigh options", "Answer: 4"),
        );
        assert!(THINK.opened_by("<|assistant|><think>"));
        assert!(THINK.opened_by("<｜Assistant｜><think>\n"));
        assert!(!THINK.opened_by("<｜Assistant｜></think>"));
    }

    #[test]
    fn no_markers_is_all_content() {
        all_cuts_agree(
            THINK,
            false,
            "  plain <b>answer</b>",
            ("", "  plain <b>answer</b>"),
        );
        // A marker later in the content is content (reasoning comes first or not at all).
        all_cuts_agree(
            THINK,
            false,
            "Use the <think> tag.</think>",
            ("", "Use the <think> tag.</think>"),
        );
        // A partial marker that never completes is content.
        all_cuts_agree(THINK, false, "<thi", ("", "<thi"));
        // A whitespace-only answer is kept as it was generated.
        all_cuts_agree(THINK, false, " \n ", ("", " \n "));
    }

    #[test]
    fn gemma4_channel() {
        all_cuts_agree(
            GEMMA4,
            false,
            "<|channel>thought\nplan it<channel|>The plan.",
            ("plan it", "The plan."),
        );
        assert_eq!(
            Markers::for_template("{{ '<|channel>thought\\n' }}...<channel|>"),
            GEMMA4
        );
        assert_eq!(Markers::for_template("{{ messages }}"), THINK);
    }

    #[test]
    fn empty_block() {
        all_cuts_agree(THINK, false, "<think>\n\n</think>\n\nHi", ("", "Hi"));
    }
}
