//! Chat templates with tool definitions: when a request carries `tools` (or messages with
//! `tool_calls`), the model's own Jinja template is rendered here with `tools` and the
//! messages' extra fields passed through, for templates that use them (Qwen3, Llama 3.x,
//! ...). Requests without tools go through `sluice_text::chat::ChatTemplate` unchanged.
//! Same environment as the text crate: `raise_exception`, Python string methods.

use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::Value;
use sluice_engine::text::chat::ChatTemplate;
use sluice_engine::text::tokenizer::Tokenizer;

/// Render `source` with `messages` (JSON objects) and `tools`.
pub fn render(
    source: &str,
    bos: &str,
    eos: &str,
    messages: &[Value],
    tools: &Value,
    add_generation_prompt: bool,
) -> Result<String, String> {
    let err = |e: JinjaError| {
        let mut m = format!("chat template: {e}");
        let mut src = std::error::Error::source(&e);
        while let Some(s) = src {
            m.push_str(": ");
            m.push_str(&s.to_string());
            src = s.source();
        }
        m
    };
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_template("chat", source).map_err(err)?;
    let t = env.get_template("chat").map_err(err)?;
    t.render(minijinja::context! {
        messages => messages,
        tools => tools,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos,
        eos_token => eos,
    })
    .map_err(err)
}

/// Render with tools and encode as `ChatTemplate::encode_prompt` does (BOS added only when
/// the text does not start with it; special-token texts parsed).
pub fn encode_with_tools(
    template: &ChatTemplate,
    tok: &Tokenizer,
    messages: &[Value],
    tools: &Value,
) -> Result<Vec<u32>, String> {
    let text_of = |id: Option<u32>| id.and_then(|i| tok.token_text(i)).unwrap_or("").to_string();
    let (bos, eos) = (text_of(tok.bos()), text_of(tok.eos()));
    let text = render(template.source(), &bos, &eos, messages, tools, true)?;
    let has_bos = !bos.is_empty() && text.starts_with(&bos);
    Ok(tok.encode(&text, !has_bos, true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tools_and_tool_calls_reach_the_template() {
        let src = "{%- if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif -%}\
                   {%- for m in messages %}<{{ m.role }}>{{ m.content }}\
                   {%- if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.function.name }}]{% endfor %}{% endif %}\
                   {%- if m.tool_call_id %}(id {{ m.tool_call_id }}){% endif %}{% endfor %}\
                   {%- if add_generation_prompt %}<assistant>{% endif %}";
        let msgs = vec![
            json!({"role": "user", "content": "weather?"}),
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}),
            json!({"role": "tool", "content": "sunny", "tool_call_id": "c1"}),
        ];
        let tools =
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]);
        let out = render(src, "", "", &msgs, &tools, true).unwrap();
        assert_eq!(
            out,
            "TOOLS:get_weather;\n<user>weather?<assistant>[call get_weather]<tool>sunny(id c1)<assistant>"
        );
        let e = render(
            "{{ raise_exception('no') }}",
            "",
            "",
            &[],
            &Value::Null,
            true,
        )
        .unwrap_err();
        assert!(e.contains("no"), "{e}");
    }
}
