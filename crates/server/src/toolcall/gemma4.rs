//! Gemma 4 (its template's `format_argument`): `<|tool_call>call:NAME{k:V,...}<tool_call|>`,
//! one block per call. Strings are delimited by `<|"|>` (no escaping inside), keys are bare
//! or `<|"|>`-delimited, numbers / `true` / `false` / `null` bare, mappings `{...}` (keys
//! sorted by the template) and lists `[...]`.

use serde_json::{Map, Number, Value};

use super::{Malformed, ToolCall};

const OPEN: &str = "<|tool_call>call:";
const CLOSE: &str = "<tool_call|>";
const Q: &str = "<|\"|>";

struct P<'a> {
    s: &'a str,
}

impl P<'_> {
    fn err<T>(&self, what: &str) -> Result<T, Malformed> {
        Err(Malformed(format!(
            "{what} at `{}`",
            self.s.chars().take(16).collect::<String>()
        )))
    }

    fn eat(&mut self, t: &str) -> bool {
        self.s = self.s.trim_start();
        match self.s.strip_prefix(t) {
            Some(r) => {
                self.s = r;
                true
            }
            None => false,
        }
    }

    fn string(&mut self) -> Result<String, Malformed> {
        let end = match self.s.find(Q) {
            Some(e) => e,
            None => return self.err("an unclosed string"),
        };
        let v = self.s[..end].to_string();
        self.s = &self.s[end + Q.len()..];
        Ok(v)
    }

    fn key(&mut self) -> Result<String, Malformed> {
        if self.eat(Q) {
            return self.string();
        }
        let end = self.s.find(':').unwrap_or(self.s.len());
        let k = self.s[..end].trim();
        if k.is_empty() || k.contains(['{', '}', ',', '<']) {
            return self.err("expected a key");
        }
        self.s = &self.s[end..];
        Ok(k.to_string())
    }

    fn mapping(&mut self) -> Result<Map<String, Value>, Malformed> {
        // after `{`
        let mut m = Map::new();
        if self.eat("}") {
            return Ok(m);
        }
        loop {
            let k = self.key()?;
            if !self.eat(":") {
                return self.err("expected `:`");
            }
            let v = self.value()?;
            m.insert(k, v);
            if self.eat(",") {
                continue;
            }
            if self.eat("}") {
                return Ok(m);
            }
            return self.err("expected `,` or `}`");
        }
    }

    fn value(&mut self) -> Result<Value, Malformed> {
        if self.eat(Q) {
            return self.string().map(Value::String);
        }
        if self.eat("{") {
            return self.mapping().map(Value::Object);
        }
        if self.eat("[") {
            let mut a = Vec::new();
            if self.eat("]") {
                return Ok(Value::Array(a));
            }
            loop {
                a.push(self.value()?);
                if self.eat(",") {
                    continue;
                }
                if self.eat("]") {
                    return Ok(Value::Array(a));
                }
                return self.err("expected `,` or `]`");
            }
        }
        let end = self.s.find([',', '}', ']']).unwrap_or(self.s.len());
        let word = self.s[..end].trim();
        self.s = &self.s[end..];
        match word {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            "null" | "None" => Ok(Value::Null),
            w => match serde_json::from_str::<Number>(w) {
                Ok(n) => Ok(Value::Number(n)),
                Err(_) => Err(Malformed(format!("`{w}` is not a value"))),
            },
        }
    }
}

pub(super) fn parse(block: &str) -> Result<Vec<ToolCall>, Malformed> {
    let mut calls = Vec::new();
    let mut rest = block.trim();
    while !rest.is_empty() {
        let r = rest
            .strip_prefix(OPEN)
            .ok_or_else(|| Malformed(format!("expected `{OPEN}`")))?;
        let brace = r
            .find('{')
            .ok_or_else(|| Malformed("a call has no `{`".into()))?;
        let name = r[..brace].trim();
        if name.is_empty() {
            return Err(Malformed("a call has no function name".into()));
        }
        let mut p = P { s: &r[brace + 1..] };
        let args = p.mapping()?;
        let tail = p.s.trim_start();
        rest = match tail.strip_prefix(CLOSE) {
            Some(t) => t.trim_start(),
            None if tail.is_empty() => "",
            None => return Err(Malformed(format!("expected `{CLOSE}`"))),
        };
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: args,
        });
    }
    Ok(calls)
}
