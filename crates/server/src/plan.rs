//! What a chat request asks for beyond plain text, worked out against the loaded model:
//! the prompt (with tools when the conversation uses them), how its answer is read
//! ([`ShapeCfg`]: reasoning markers, tool-call format) and the grammar its sampling is
//! constrained by (compiled here, so a bad schema is a 400 before anything is queued).
//!
//! Owns: [`Plan`], [`chat`] (OpenAI) and [`messages`] (Anthropic), and the per-model
//! [`Constrainer`] built at first use. Plain requests keep the prompt `routes.rs` renders
//! (the caller's closure), so their tokens are exactly what they were before tools.

use std::sync::Arc;

use serde_json::Value;
use sluice_engine::text::chat::ChatMessage;

use crate::agent::{self, Choice};
use crate::api::{ApiError, ChatRequest, Flavor, MessagesRequest};
use crate::constrain::{Constrainer, JobConstraint, Spec};
use crate::reasoning::Markers;
use crate::shape::ShapeCfg;
use crate::toolcall::{Format, ToolDef};
use crate::Ready;

/// A request worked out.
pub(crate) struct Plan {
    pub prompt: Vec<u32>,
    pub shape: ShapeCfg,
    pub constraint: Option<JobConstraint>,
    /// Control tokens the answer's reader needs as text (see [`marker_ids`]).
    pub show: Vec<u32>,
}

/// Ids of control tokens whose text is a reasoning or tool-call marker (Gemma 4's
/// `<|channel>` / `<|tool_call>` / `<|"|>`, `<think>` where a vocabulary marks them as
/// control): the decoder omits control tokens, and the split and the call parsers must
/// see them.
pub(crate) fn marker_ids(tok: &sluice_engine::text::tokenizer::Tokenizer) -> Vec<u32> {
    crate::toolcall::MARKER_TEXTS
        .iter()
        .filter_map(|t| tok.token_id(t))
        .filter(|&id| tok.is_control(id) && !tok.is_eog(id))
        .collect()
}

/// The model's constraint compiler (its vocabulary's trie, built once).
fn constrainer(ready: &Ready, f: Flavor) -> Result<Arc<Constrainer>, ApiError> {
    ready
        .constrainer
        .get_or_init(|| {
            let n = ready.shared.loaded.model.cfg.n_vocab;
            Constrainer::new(ready.shared.tok.clone(), n).map(Arc::new)
        })
        .clone()
        .map_err(|e| ApiError::internal(f, format!("constrained decoding is unavailable: {e}")))
}

/// Whether the prompt's end opened a reasoning block.
fn opened(ready: &Ready, m: &Markers, prompt: &[u32]) -> bool {
    let tail = &prompt[prompt.len().saturating_sub(8)..];
    let text = ready.shared.tok.detokenize(tail, false, true);
    m.opened_by(&String::from_utf8_lossy(&text))
}

/// Everything after the prompt: the shape and the constraint.
fn finish_plan(
    ready: &Ready,
    f: Flavor,
    prompt: Vec<u32>,
    defs: Vec<ToolDef>,
    choice: &Choice,
    output: Option<Spec>,
    output_field: &'static str,
) -> Result<Plan, ApiError> {
    let src = ready.template.source();
    let markers = Markers::for_template(src);
    let inside = opened(ready, &markers, &prompt);
    let format = Format::detect(src);
    let forced = agent::forced_call(format, &defs, choice, inside.then_some(markers.close));
    let (spec, field) = match (forced, output) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                f,
                format!(
                    "`{output_field}` cannot be combined with a forced tool call (`tool_choice`)"
                ),
            )
            .param(output_field))
        }
        (Some(s), None) => (Some(s), "tool_choice"),
        (None, s) => (s, output_field),
    };
    let constraint = match spec {
        None => None,
        // The first use builds the vocabulary trie (seconds for a 262k vocabulary) and a
        // schema compiles in milliseconds: off the async workers' hot path.
        Some(s) => Some(tokio::task::block_in_place(|| {
            constrainer(ready, f)?
                .compile(&s)
                .map_err(|e| ApiError::bad_request(f, format!("`{field}`: {e}")).param(field))
        })?),
    };
    let tools = (!defs.is_empty() && *choice != Choice::None).then_some((format, defs));
    let show = marker_ids(&ready.shared.tok);
    Ok(Plan {
        show,
        prompt,
        shape: ShapeCfg {
            markers,
            inside,
            tools,
        },
        constraint,
    })
}

/// Render `msgs` (template messages) with `defs` offered.
fn tool_prompt(
    ready: &Ready,
    f: Flavor,
    msgs: Vec<Value>,
    offered: &[ToolDef],
) -> Result<Vec<u32>, ApiError> {
    let native = Format::template_renders_tools(ready.template.source());
    let msgs = agent::template_messages(msgs, offered, native);
    let tools = if native {
        agent::template_tools(offered)
    } else {
        Value::Array(Vec::new())
    };
    crate::template::encode_with_tools(&ready.template, &ready.shared.tok, &msgs, &tools)
        .map_err(|e| ApiError::bad_request(f, e))
}

/// An OpenAI chat request. `plain` renders the prompt of a conversation without tools.
pub(crate) fn chat(
    ready: &Ready,
    req: &ChatRequest,
    msgs: &[ChatMessage],
    plain: impl FnOnce() -> Result<Vec<u32>, ApiError>,
) -> Result<Plan, ApiError> {
    let f = Flavor::OpenAi;
    let bad = |e: String, p: &'static str| ApiError::bad_request(f, e).param(p);
    let defs =
        agent::openai_tools(req.tools.as_deref().unwrap_or(&[])).map_err(|e| bad(e, "tools"))?;
    let choice =
        agent::openai_choice(req.tool_choice.as_ref()).map_err(|e| bad(e, "tool_choice"))?;
    agent::check_choice(&choice, &defs).map_err(|e| bad(e, "tool_choice"))?;
    let output =
        agent::output_spec(req.response_format.as_ref(), req.grammar.as_deref()).map_err(|e| {
            bad(
                e,
                if req.grammar.is_some() {
                    "grammar"
                } else {
                    "response_format"
                },
            )
        })?;
    let output_field = if req.grammar.is_some() {
        "grammar"
    } else {
        "response_format"
    };
    let uses_tools = !defs.is_empty()
        || req
            .messages
            .iter()
            .any(|m| m.extra.contains_key("tool_calls"));
    let prompt = if uses_tools {
        let mut values = Vec::with_capacity(req.messages.len());
        for (m, src) in msgs.iter().zip(&req.messages) {
            let mut o = src.extra.clone();
            o.insert("role".into(), Value::String(m.role.clone()));
            o.insert("content".into(), Value::String(m.content.clone()));
            values.push(Value::Object(o));
        }
        let offered: &[ToolDef] = if choice == Choice::None { &[] } else { &defs };
        tool_prompt(ready, f, values, offered)?
    } else {
        plain()?
    };
    finish_plan(ready, f, prompt, defs, &choice, output, output_field)
}

/// An Anthropic messages request. `plain` renders the prompt of a conversation without
/// tools.
pub(crate) fn messages(
    ready: &Ready,
    req: &MessagesRequest,
    system: Option<String>,
    plain: impl FnOnce() -> Result<Vec<u32>, ApiError>,
) -> Result<Plan, ApiError> {
    let f = Flavor::Anthropic;
    let bad = |e: String, p: &'static str| ApiError::bad_request(f, e).param(p);
    let defs = agent::anthropic_tools(req.tools.as_ref()).map_err(|e| bad(e, "tools"))?;
    let choice =
        agent::anthropic_choice(req.tool_choice.as_ref()).map_err(|e| bad(e, "tool_choice"))?;
    agent::check_choice(&choice, &defs).map_err(|e| bad(e, "tool_choice"))?;
    let has_blocks = req.messages.iter().any(|m| {
        m.content.as_array().is_some_and(|a| {
            a.iter().any(|b| {
                matches!(
                    b.get("type").and_then(Value::as_str),
                    Some("tool_use" | "tool_result")
                )
            })
        })
    });
    let prompt = if !defs.is_empty() || has_blocks {
        let pairs: Vec<(String, Value)> = req
            .messages
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect();
        let msgs = agent::anthropic_messages(system, &pairs).map_err(|e| bad(e, "messages"))?;
        let offered: &[ToolDef] = if choice == Choice::None { &[] } else { &defs };
        tool_prompt(ready, f, msgs, offered)?
    } else {
        plain()?
    };
    let output = agent::output_spec(None, req.grammar.as_deref()).map_err(|e| bad(e, "grammar"))?;
    finish_plan(ready, f, prompt, defs, &choice, output, "grammar")
}
