//! Chat prompt rendering: the model's Jinja `tokenizer.chat_template` run with minijinja
//! (messages, add_generation_prompt, bos_token/eos_token, `raise_exception`, Python string
//! methods like `.strip()`/`.startswith()`), or a built-in template when the file has none:
//! Gemma's turn format for `gemma*` architectures, ChatML for the rest.
//!
//! The rendered text may contain special-token texts (and the BOS text when the template
//! writes `bos_token`): encode it with `parse_special = true`, and with `add_special = false`
//! when it already starts with the BOS text (see [`ChatTemplate::encode_prompt`]).

use crate::tokenizer::Tokenizer;
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use sluice_gguf::GgufFile;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or whatever the template knows, e.g. `tool`).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// Errors compiling or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template ({source_name}): {message}")]
    Template {
        source_name: String,
        message: String,
    },
}

/// Gemma's official template (system prompt folded into the first user turn,
/// `assistant` shown as `model`, contents trimmed).
pub const GEMMA_TEMPLATE: &str = r#"{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}
"#;

/// ChatML (`<|im_start|>role\ncontent<|im_end|>\n`), the fallback for other models.
pub const CHATML_TEMPLATE: &str = r#"{%- for message in messages -%}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<|im_start|>assistant\n' }}
{%- endif -%}
"#;

/// A chat template plus the BOS/EOS texts it may reference.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    source_name: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// A template from Jinja source; `source_name` names it in errors.
    pub fn new(source: &str, source_name: &str, bos_token: &str, eos_token: &str) -> Self {
        ChatTemplate {
            source: source.to_string(),
            source_name: source_name.to_string(),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        }
    }

    /// The file's `tokenizer.chat_template`, else built-in Gemma (arch `gemma*`) or ChatML.
    /// BOS/EOS texts come from the tokenizer.
    pub fn from_gguf(f: &GgufFile, tok: &Tokenizer) -> Self {
        let text = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
        let (bos, eos) = (text(tok.bos()), text(tok.eos()));
        if let Some(src) = f.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            return ChatTemplate::new(
                src,
                &format!("{}: tokenizer.chat_template", f.path.display()),
                &bos,
                &eos,
            );
        }
        let arch = f.architecture().unwrap_or("");
        if arch.starts_with("gemma") {
            ChatTemplate::new(GEMMA_TEMPLATE, "built-in gemma", &bos, &eos)
        } else {
            ChatTemplate::new(CHATML_TEMPLATE, "built-in chatml", &bos, &eos)
        }
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation; `add_generation_prompt` appends the assistant turn opener.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let err = |e: JinjaError| {
            let mut message = e.to_string();
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                message.push_str(": ");
                message.push_str(&s.to_string());
                src = s.source();
            }
            ChatError::Template {
                source_name: self.source_name.clone(),
                message,
            }
        };
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template("chat", &self.source).map_err(err)?;
        let tmpl = env.get_template("chat").map_err(err)?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(err)
    }

    /// Renders and encodes a prompt: special-token texts become their ids, and BOS is added
    /// only if the rendered text does not already start with it.
    pub fn encode_prompt(
        &self,
        tok: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ChatError> {
        let text = self.render(messages, add_generation_prompt)?;
        let has_bos = !self.bos_token.is_empty() && text.starts_with(&self.bos_token);
        Ok(tok.encode(&text, !has_bos, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", " Hello! "),
            ChatMessage::new("user", "Bye"),
        ]
    }

    #[test]
    fn gemma_builtin_folds_system_into_first_user_turn() {
        let t = ChatTemplate::new(GEMMA_TEMPLATE, "gemma", "<bos>", "<eos>");
        // Gemma's documented format.
        let want = "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
                    <start_of_turn>model\nHello!<end_of_turn>\n\
                    <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n";
        assert_eq!(t.render(&conv(), true).unwrap(), want);
        let bad = [ChatMessage::new("assistant", "x")];
        let e = t.render(&bad, true).unwrap_err().to_string();
        assert!(e.contains("alternate"), "{e}");
    }

    #[test]
    fn chatml_builtin() {
        let t = ChatTemplate::new(CHATML_TEMPLATE, "chatml", "", "");
        let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                    <|im_start|>assistant\n Hello! <|im_end|>\n<|im_start|>user\nBye<|im_end|>\n";
        assert_eq!(t.render(&conv(), false).unwrap(), want);
    }

    #[test]
    fn filters_and_syntax_errors() {
        let t = ChatTemplate::new(
            "{{ messages[0] | tojson }}|{{ '  x '.strip() }}|{{ bos_token }}",
            "t",
            "<s>",
            "</s>",
        );
        assert_eq!(
            t.render(&[ChatMessage::new("user", "a\"b")], false)
                .unwrap(),
            r#"{"role":"user","content":"a\"b"}|x|<s>"#
        );
        let t = ChatTemplate::new("{% if %}", "broken.jinja", "", "");
        assert!(t
            .render(&[], false)
            .unwrap_err()
            .to_string()
            .contains("broken.jinja"));
    }
}
