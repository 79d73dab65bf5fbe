//! Tool calls in generated text: each chat template's own call syntax parsed into
//! [`ToolCall`]s (a function name and its arguments as a JSON object).
//!
//! Owns: [`Format`] (which syntax a template writes, detected from its source as llama.cpp
//! does), the per-format parsers (`hermes.rs`: Qwen/Hermes `<tool_call>{json}</tool_call>`;
//! `dsml.rs`: DeepSeek V3.2/V4 DSML; `glm.rs`: GLM-4.5+/5.x `<arg_key>`/`<arg_value>`;
//! `gemma4.rs`: Gemma 4 `<|tool_call>call:name{...}<tool_call|>`; `json.rs`: the fallback
//! for templates without tool support, a bare `{"name", "arguments"}` object) and
//! [`ToolStream`], which separates streamed content from a call block (content before the
//! block's opening marker is sent as it comes; the block is held and parsed at the end).
//! A block that does not parse is given back as content, never dropped. It does not own
//! prompts (`template.rs`, `agent.rs`) or constrained decoding (`constrain.rs`).

mod dsml;
mod gemma4;
mod glm;
mod hermes;
mod json;

use serde_json::{Map, Value};

/// One parsed call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// Always a JSON object.
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    /// The arguments as the JSON text OpenAI's `function.arguments` carries.
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }
}

/// A tool-call syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Qwen 2.5/3, Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
    /// DeepSeek V3.2 / V4: `<｜DSML｜tool_calls>` (V3.2: `function_calls`) with
    /// `<｜DSML｜invoke name="...">` and `<｜DSML｜parameter name="..." string="true|false">`.
    Dsml,
    /// GLM-4.5 .. 5.x: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`.
    Glm,
    /// Gemma 4: `<|tool_call>call:name{key:<|"|>text<|"|>,n:1}<tool_call|>`.
    Gemma4,
    /// A template that does not describe tools (Gemma 3, ...): the tools are described in
    /// a system message and the answer is one JSON object `{"name": ..., "arguments": ...}`.
    Json,
}

/// Reasoning and tool-call marker texts a vocabulary may hold as single tokens, all
/// syntaxes together. A vocabulary that marks one as a control token still has it shown
/// as text (`plan.rs`) and matched as text by grammars (`constrain.rs`).
pub const MARKER_TEXTS: &[&str] = &[
    "<think>",
    "</think>",
    "<|channel>",
    "<channel|>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "｜DSML｜",
    "<|tool_call>",
    "<tool_call|>",
    "<|\"|>",
];

/// A tool definition as the parsers need it: name and parameter schema.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: String,
    /// JSON schema of the arguments (an object schema; `{}` when not given).
    pub parameters: Value,
}

impl ToolDef {
    /// The schema type of parameter `key` (`"string"`, ...), when the schema says.
    pub fn param_type(&self, key: &str) -> Option<&str> {
        self.parameters
            .get("properties")?
            .get(key)?
            .get("type")?
            .as_str()
    }
}

/// Why a call block did not parse (it is given back as content).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Malformed(pub String);

impl Format {
    /// The syntax a chat template writes, detected from its source (the strings llama.cpp's
    /// `common/chat.cpp` looks for).
    pub fn detect(template: &str) -> Format {
        if template.contains("dsml_token") || template.contains("｜DSML｜") {
            Format::Dsml
        } else if template.contains("<|tool_call>") {
            Format::Gemma4
        } else if template.contains("<arg_key>") {
            Format::Glm
        } else if template.contains("<tool_call>") {
            Format::Hermes
        } else {
            Format::Json
        }
    }

    /// Whether the template renders `tools` itself (else `agent.rs` describes them in a
    /// system message).
    pub fn template_renders_tools(template: &str) -> bool {
        Format::detect(template) != Format::Json && template.contains("tools")
    }

    /// The text that opens a call block (None: the whole answer is the block).
    pub fn opener(&self) -> Option<&'static str> {
        match self {
            Format::Hermes | Format::Glm => Some("<tool_call>"),
            Format::Dsml => Some("<｜DSML｜"),
            Format::Gemma4 => Some("<|tool_call>"),
            Format::Json => None,
        }
    }

    /// Parse a call block (from its opener to the end of the answer). Calls of tools not
    /// in `tools` are malformed (when `tools` is not empty).
    pub fn parse(&self, block: &str, tools: &[ToolDef]) -> Result<Vec<ToolCall>, Malformed> {
        let calls = match self {
            Format::Hermes => hermes::parse(block)?,
            Format::Dsml => dsml::parse(block)?,
            Format::Glm => glm::parse(block, tools)?,
            Format::Gemma4 => gemma4::parse(block)?,
            Format::Json => json::parse(block)?,
        };
        if calls.is_empty() {
            return Err(Malformed("no call in the block".into()));
        }
        if !tools.is_empty() {
            for c in &calls {
                if !tools.iter().any(|t| t.name == c.name) {
                    return Err(Malformed(format!("no tool named `{}`", c.name)));
                }
            }
        }
        Ok(calls)
    }
}

/// What [`ToolStream`] lets through.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolPiece {
    Content(String),
    Calls(Vec<ToolCall>),
}

/// Separates content from a call block in streamed content.
#[derive(Debug, Clone)]
pub struct ToolStream {
    format: Format,
    tools: Vec<ToolDef>,
    /// Held text: a possible opener start, or the block.
    held: String,
    in_block: bool,
    /// Only whitespace seen so far (the `Json` format needs the object to come first).
    at_start: bool,
}

/// Length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    let max = s.len().min(marker.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && marker.starts_with(&s[s.len() - k..]))
        .unwrap_or(0)
}

impl ToolStream {
    pub fn new(format: Format, tools: Vec<ToolDef>) -> ToolStream {
        ToolStream {
            format,
            tools,
            held: String::new(),
            in_block: false,
            at_start: true,
        }
    }

    /// Feed content; returns the content that is certainly not part of a call block.
    pub fn push(&mut self, text: &str) -> Vec<ToolPiece> {
        self.held.push_str(text);
        if self.in_block {
            return Vec::new();
        }
        let Some(opener) = self.format.opener() else {
            // Json: a block is an answer whose first non-blank character is `{` (or a
            // ``` fence); anything else is content as it comes.
            if self.at_start {
                let t = self.held.trim_start();
                if t.is_empty() {
                    return Vec::new();
                }
                self.at_start = false;
                if t.starts_with('{') || "```".starts_with(t) || t.starts_with("```") {
                    self.in_block = true;
                    return Vec::new();
                }
            }
            return vec![ToolPiece::Content(std::mem::take(&mut self.held))];
        };
        let mut out = Vec::new();
        if let Some(pos) = self.held.find(opener) {
            let before: String = self.held.drain(..pos).collect();
            if !before.is_empty() {
                out.push(ToolPiece::Content(before));
            }
            self.in_block = true;
            return out;
        }
        let keep = partial_suffix(&self.held, opener);
        let emit: String = self.held.drain(..self.held.len() - keep).collect();
        if !emit.is_empty() {
            out.push(ToolPiece::Content(emit));
        }
        out
    }

    /// End of the answer: the parsed calls, or the held text as content when it does not
    /// parse (with the reason, for the log).
    pub fn finish(&mut self) -> (Vec<ToolPiece>, Option<Malformed>) {
        let held = std::mem::take(&mut self.held);
        if !self.in_block {
            let out = if held.is_empty() {
                vec![]
            } else {
                vec![ToolPiece::Content(held)]
            };
            return (out, None);
        }
        match self.format.parse(&held, &self.tools) {
            Ok(calls) => (vec![ToolPiece::Calls(calls)], None),
            Err(e) => (vec![ToolPiece::Content(held)], Some(e)),
        }
    }
}

/// Parse a whole answer at once: (content, calls).
pub fn parse_all(format: Format, tools: &[ToolDef], text: &str) -> (String, Vec<ToolCall>) {
    let mut s = ToolStream::new(format, tools.to_vec());
    let mut pieces = s.push(text);
    pieces.extend(s.finish().0);
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            ToolPiece::Content(t) => content.push_str(&t),
            ToolPiece::Calls(c) => calls.extend(c),
        }
    }
    (content, calls)
}

#[cfg(test)]
mod tests;
