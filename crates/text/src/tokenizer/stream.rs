//! Incremental decoding for generation: feed ids one at a time, get back only complete
//! UTF-8 text; bytes of a character split across tokens wait for the rest.

use super::Tokenizer;

/// Streams token ids to text without ever emitting half a UTF-8 character.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
    render_special: bool,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder that omits control tokens (like [`Tokenizer::decode`]).
    pub fn new(tok: &'a Tokenizer) -> Self {
        StreamDecoder {
            tok,
            pending: Vec::new(),
            render_special: false,
        }
    }

    /// Renders control tokens as their text (e.g. `<end_of_turn>`) when `on`.
    pub fn render_special(mut self, on: bool) -> Self {
        self.render_special = on;
        self
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        if self.render_special || !self.tok.is_control(id) {
            self.pending.extend_from_slice(self.tok.piece(id));
        }
        self.take_complete()
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: whatever is still pending, with U+FFFD for incomplete characters.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The prefix up to `valid` was just checked to be UTF-8.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Invalid bytes in the middle can never become valid: replace them.
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start = valid + n;
                        }
                        // An incomplete character at the end: keep it for the next token.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
