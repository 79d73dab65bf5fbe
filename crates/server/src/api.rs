//! Request bodies of the OpenAI and Anthropic APIs, and their error objects.
//!
//! Owns: the serde types of `/v1/chat/completions`, `/v1/completions` and `/v1/messages`
//! (unknown fields are ignored, as clients send many; a known field of the wrong type is a
//! 400; a known field whose feature is not implemented is a 400 naming it, never silently
//! ignored: each type's `unsupported`), the translation of their sampling fields into a
//! [`SamplerConfig`], and [`ApiError`], which renders as an OpenAI-style or
//! Anthropic-style error object.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use sluice_engine::sampler::SamplerConfig;

/// Which API's error shape to answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub flavor: Flavor,
    /// OpenAI `type` (`invalid_request_error`, ...).
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
    pub retry_after: Option<u64>,
    /// Close the connection after this answer (`Connection: close`): the request's body
    /// was not read to its end.
    pub close: bool,
}

impl ApiError {
    pub fn bad_request(flavor: Flavor, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            flavor,
            kind: "invalid_request_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            close: false,
        }
    }

    pub fn param(mut self, p: &'static str) -> ApiError {
        self.param = Some(p);
        self
    }

    pub fn code(mut self, c: &'static str) -> ApiError {
        self.code = Some(c);
        self
    }

    pub fn status(mut self, s: StatusCode, kind: &'static str) -> ApiError {
        self.status = s;
        self.kind = kind;
        self
    }

    /// Answer with `Connection: close`.
    pub fn close(mut self) -> ApiError {
        self.close = true;
        self
    }

    pub fn overloaded(flavor: Flavor, message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            flavor,
            kind: match flavor {
                Flavor::OpenAi => "server_error",
                Flavor::Anthropic => "overloaded_error",
            },
            message: message.into(),
            param: None,
            code: None,
            retry_after: Some(retry_after),
            close: false,
        }
    }

    pub fn internal(flavor: Flavor, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            flavor,
            kind: match flavor {
                Flavor::OpenAi => "server_error",
                Flavor::Anthropic => "api_error",
            },
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
            close: false,
        }
    }

    /// The JSON error object.
    pub fn body(&self) -> Value {
        match self.flavor {
            Flavor::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.kind,
                    "param": self.param,
                    "code": self.code,
                }
            }),
            Flavor::Anthropic => {
                let kind = match self.status {
                    StatusCode::UNAUTHORIZED => "authentication_error",
                    StatusCode::NOT_FOUND => "not_found_error",
                    StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                    StatusCode::REQUEST_TIMEOUT => "timeout_error",
                    StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
                    s if s.is_server_error() => "api_error",
                    _ => "invalid_request_error",
                };
                json!({"type": "error", "error": {"type": kind, "message": self.message}})
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if self.close {
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}

/// Parse a JSON body into `T`; syntax and type errors become a 400 naming the problem.
pub fn parse<T: serde::de::DeserializeOwned>(flavor: Flavor, body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(flavor, "the request body is empty"));
    }
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Data => "invalid request",
            _ => "malformed JSON",
        };
        ApiError::bad_request(flavor, format!("{what}: {e}"))
    })
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(v) => v,
        }
    }
}

/// A content part (`{"type":"text","text":...}`); other part types are refused.
#[derive(Debug, Deserialize, Clone)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// Message content: a string, a list of parts, or null (assistant messages with tool calls).
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl Content {
    /// The text of the content (parts concatenated); non-text parts are an error.
    pub fn text(&self, flavor: Flavor) -> Result<String, ApiError> {
        match self {
            Content::Text(s) => Ok(s.clone()),
            Content::Parts(parts) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::bad_request(flavor, "a text part has no `text`"))
                        }
                        (k, _) => {
                            return Err(ApiError::bad_request(
                                flavor,
                                format!(
                                    "content parts of type `{k}` are not supported (text only)"
                                ),
                            ))
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Debug, Deserialize, Clone)]
pub struct ChatMessageIn {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// `tool_calls`, `tool_call_id`, `name`, ...: passed to templates when tools are used.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize, Clone, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by the endpoints (llama.cpp's extensions `top_k`, `min_p`,
/// `repeat_penalty` included).
#[derive(Debug, Deserialize, Clone, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
}

impl Sampling {
    /// The sampler settings: given values, else llama.cpp server's defaults; the seed
    /// from the clock when not given.
    pub fn config(&self, flavor: Flavor) -> Result<SamplerConfig, ApiError> {
        let mut c = SamplerConfig::default();
        let finite = |v: Option<f32>, name: &'static str, lo: f32, hi: f32| match v {
            Some(x) if !x.is_finite() || x < lo || x > hi => Err(ApiError::bad_request(
                flavor,
                format!("`{name}` must be between {lo} and {hi}"),
            )
            .param(name)),
            _ => Ok(v),
        };
        if let Some(t) = finite(self.temperature, "temperature", 0.0, 100.0)? {
            c.temperature = t;
        }
        if let Some(p) = finite(self.top_p, "top_p", 0.0, 1.0)? {
            c.top_p = p;
        }
        if let Some(p) = finite(self.min_p, "min_p", 0.0, 1.0)? {
            c.min_p = p;
        }
        if let Some(k) = self.top_k {
            c.top_k = k as usize;
        }
        if let Some(p) = finite(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)? {
            c.frequency_penalty = p;
        }
        if let Some(p) = finite(self.presence_penalty, "presence_penalty", -2.0, 2.0)? {
            c.presence_penalty = p;
        }
        if let Some(p) = finite(self.repeat_penalty, "repeat_penalty", 0.0, 10.0)? {
            c.repeat_penalty = p;
        }
        c.validate().map_err(|m| ApiError::bad_request(flavor, m))?;
        c.seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        Ok(c)
    }
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize, Clone)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    #[serde(flatten)]
    pub sampling: Sampling,
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    /// Tool definitions, passed to the chat template (`agent.rs`).
    pub tools: Option<Vec<Value>>,
    /// `auto` / `none` / `required` / a named function (`agent.rs`).
    pub tool_choice: Option<Value>,
    /// `text` / `json_object` / `json_schema` (constrained decoding).
    pub response_format: Option<Value>,
    /// llama-server's `grammar`: GBNF (or llguidance Lark).
    pub grammar: Option<String>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
}

/// A 400 naming a field this server does not implement.
fn not_supported(flavor: Flavor, field: &'static str, why: &str) -> ApiError {
    ApiError::bad_request(flavor, format!("`{field}` is not supported{why}")).param(field)
}

impl ChatRequest {
    /// Fields given that would be ignored: a 400 naming the first.
    pub fn unsupported(&self) -> Result<(), ApiError> {
        if self.top_logprobs.is_some() && !self.logprobs {
            return Err(ApiError::bad_request(
                Flavor::OpenAi,
                "`top_logprobs` needs `logprobs`: true",
            )
            .param("top_logprobs"));
        }
        Ok(())
    }
}

/// `prompt` of `/v1/completions`: a string or a list of one string.
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum Prompt {
    One(String),
    Many(Vec<String>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize, Clone)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<u64>,
    #[serde(flatten)]
    pub sampling: Sampling,
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    /// Not implemented: refused when given (null is accepted).
    pub logprobs: Option<Value>,
    pub suffix: Option<Value>,
    pub best_of: Option<Value>,
}

impl CompletionRequest {
    /// Fields given that would be ignored: a 400 naming the first.
    pub fn unsupported(&self) -> Result<(), ApiError> {
        let f = Flavor::OpenAi;
        if self.echo {
            return Err(not_supported(f, "echo", ""));
        }
        if self.logprobs.is_some() {
            return Err(not_supported(f, "logprobs", " on /v1/completions"));
        }
        if self.suffix.as_ref().is_some_and(|v| v.as_str() != Some("")) {
            return Err(not_supported(f, "suffix", " (no fill-in-the-middle)"));
        }
        if self.best_of.as_ref().is_some_and(|v| v.as_u64() != Some(1)) {
            return Err(not_supported(f, "best_of", " (only 1)"));
        }
        Ok(())
    }
}

/// Anthropic `system`: a string or text blocks.
#[derive(Debug, Deserialize, Clone)]
#[serde(untagged)]
pub enum System {
    Text(String),
    Blocks(Vec<ContentPart>),
}

#[derive(Debug, Deserialize, Clone)]
pub struct AnthropicMessage {
    pub role: String,
    /// A string or content blocks (`text`, and `tool_use` / `tool_result`, read by
    /// `agent.rs`).
    pub content: Value,
}

impl AnthropicMessage {
    /// The text of a message without tool blocks.
    pub fn text(&self, flavor: Flavor) -> Result<String, ApiError> {
        let c: Content = serde_json::from_value(self.content.clone()).map_err(|e| {
            ApiError::bad_request(flavor, format!("invalid request: messages: content: {e}"))
        })?;
        c.text(flavor)
    }
}

/// `POST /v1/messages`.
#[derive(Debug, Deserialize, Clone)]
pub struct MessagesRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub max_tokens: u64,
    pub messages: Vec<AnthropicMessage>,
    pub system: Option<System>,
    #[serde(flatten)]
    pub sampling: Sampling,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    /// Tool definitions and choice (`agent.rs`).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    /// Not implemented: refused when given (null and a disabled `thinking` are accepted).
    pub thinking: Option<Value>,
    /// llama-server's `grammar` (GBNF or Lark), as on the chat API.
    pub grammar: Option<String>,
}

impl MessagesRequest {
    /// Fields given that would be ignored: a 400 naming the first. A last message from
    /// the assistant (a prefill the answer should continue) is refused too.
    pub fn unsupported(&self) -> Result<(), ApiError> {
        let f = Flavor::Anthropic;
        if self
            .thinking
            .as_ref()
            .is_some_and(|t| t.get("type").and_then(Value::as_str) != Some("disabled"))
        {
            return Err(not_supported(f, "thinking", " (extended thinking)"));
        }
        if self.messages.last().is_some_and(|m| m.role == "assistant") {
            return Err(ApiError::bad_request(
                f,
                "a last message from the assistant (prefill) is not supported: end with a user message",
            )
            .param("messages"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_are_400() {
        let e = parse::<ChatRequest>(Flavor::OpenAi, br#"{"messages": "hi"}"#).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = parse::<ChatRequest>(Flavor::OpenAi, b"{not json").unwrap_err();
        assert!(e.message.contains("malformed"), "{}", e.message);
        let e = parse::<ChatRequest>(Flavor::OpenAi, br#"{"messages": [], "temperature": "hot"}"#)
            .unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let r: ChatRequest = parse(
            Flavor::OpenAi,
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"stop":"x","unknown":1}"#,
        )
        .unwrap();
        assert_eq!(
            r.messages[0]
                .content
                .as_ref()
                .unwrap()
                .text(Flavor::OpenAi)
                .unwrap(),
            "a"
        );
        let e = parse::<MessagesRequest>(Flavor::Anthropic, br#"{"messages": []}"#).unwrap_err();
        assert_eq!(e.body()["type"], "error");
    }

    #[test]
    fn sampling_ranges() {
        let s = Sampling {
            temperature: Some(f32::NAN),
            ..Default::default()
        };
        assert!(s.config(Flavor::OpenAi).is_err());
        let s = Sampling {
            temperature: Some(0.0),
            seed: Some(7),
            ..Default::default()
        };
        let c = s.config(Flavor::OpenAi).unwrap();
        assert_eq!((c.temperature, c.seed), (0.0, 7));
    }

    /// Fields whose feature is missing are refused, naming the field (issue 35 item 15);
    /// before, all of these were answered 200 as if the field had not been sent.
    #[test]
    fn unsupported_fields_are_400_naming_them() {
        let check = |e: ApiError, field: &str| {
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains(field), "{}", e.message);
            assert!(e.message.contains("not supported") || e.message.contains("needs"));
        };
        let completion = |extra: &str| -> CompletionRequest {
            parse(
                Flavor::OpenAi,
                format!(r#"{{"prompt": "a"{extra}}}"#).as_bytes(),
            )
            .unwrap()
        };
        assert!(completion("").unsupported().is_ok());
        for (extra, field) in [
            (r#", "echo": true"#, "echo"),
            (r#", "logprobs": 3"#, "logprobs"),
            (r#", "logprobs": 0"#, "logprobs"),
            (r#", "suffix": "end""#, "suffix"),
            (r#", "best_of": 2"#, "best_of"),
        ] {
            check(completion(extra).unsupported().unwrap_err(), field);
        }
        // Values that ask for nothing are fine.
        for extra in [
            r#", "logprobs": null, "suffix": null, "best_of": null, "echo": false"#,
            r#", "suffix": "", "best_of": 1"#,
        ] {
            assert!(completion(extra).unsupported().is_ok(), "{extra}");
        }

        let chat = |extra: &str| -> ChatRequest {
            parse(
                Flavor::OpenAi,
                format!(r#"{{"messages": [{{"role": "user", "content": "a"}}]{extra}}}"#)
                    .as_bytes(),
            )
            .unwrap()
        };
        check(
            chat(r#", "top_logprobs": 2"#).unsupported().unwrap_err(),
            "top_logprobs",
        );
        check(
            chat(r#", "top_logprobs": 2, "logprobs": false"#)
                .unsupported()
                .unwrap_err(),
            "top_logprobs",
        );
        assert!(chat(r#", "top_logprobs": 2, "logprobs": true"#)
            .unsupported()
            .is_ok());
        assert!(chat("").unsupported().is_ok());

        let messages = |extra: &str, last: &str| -> MessagesRequest {
            parse(
                Flavor::Anthropic,
                format!(
                    r#"{{"max_tokens": 8, "messages": [{{"role": "user", "content": "a"}}{last}]{extra}}}"#
                )
                .as_bytes(),
            )
            .unwrap()
        };
        assert!(messages("", "").unsupported().is_ok());
        // Tools are accepted since issue 33.
        let tool = r#", "tools": [{"name": "f", "input_schema": {"type": "object"}}]"#;
        assert!(messages(tool, "").unsupported().is_ok());
        let thinking = r#", "thinking": {"type": "enabled", "budget_tokens": 1024}"#;
        check(
            messages(
                r#", "thinking": {"type": "enabled", "budget_tokens": 1024}"#,
                "",
            )
            .unsupported()
            .unwrap_err(),
            "thinking",
        );
        let e = messages("", r#", {"role": "assistant", "content": "The answer is"}"#)
            .unsupported()
            .unwrap_err();
        assert!(e.message.contains("prefill"), "{}", e.message);
        assert!(
            messages(r#", "tools": [], "thinking": {"type": "disabled"}"#, "")
                .unsupported()
                .is_ok()
        );
        // The error object is Anthropic's shape.
        let e = messages(thinking, "").unsupported().unwrap_err();
        assert_eq!(e.body()["type"], "error");
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn repeat_penalty_zero_is_400() {
        // `run` refuses --repeat-penalty 0; the server must too (it emitted <bos> forever).
        let s = Sampling {
            repeat_penalty: Some(0.0),
            ..Default::default()
        };
        let e = s.config(Flavor::OpenAi).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.contains("repeat_penalty"), "{}", e.message);
        let s = Sampling {
            repeat_penalty: Some(1.1),
            ..Default::default()
        };
        assert_eq!(s.config(Flavor::OpenAi).unwrap().repeat_penalty, 1.1);
    }
}
