#!/usr/bin/env bash
# Talks to `sluice serve` with the official `openai` and `anthropic` Python packages (PyPI,
# installed into ${SLUICE_CACHE:-~/.cache/sluice}/venv-clients): chat and completions,
# streamed and not, Messages streamed and not, a second turn that reuses the first's prefix;
# then, for a model given as argument, tools/check-agents.py: a forced tool call (`tool_choice` required / named / Anthropic
# `any`) whose arguments validate against the schema (the `jsonschema` package), streamed
# and not the same, and `json_schema` output that validates.
#   tools/test-server-clients.sh [MODEL.gguf]   (default: the tiny qwen3moe fixture)
# Starts the server on a free loopback port with target/release/sluice and stops it after.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-tests/fixtures/qwen3moe/a-q8_0.gguf}"
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
venv="$cache/venv-clients"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check openai anthropic jsonschema >&2
. tools/lib/serve.sh
serve_sluice "$model" --api-key test-key --parallel 2
BASE="$base" timeout 300 "$venv/bin/python" - <<'PY'
import os
import openai, anthropic
base = os.environ["BASE"]
oa = openai.OpenAI(base_url=base + "/v1", api_key="test-key", timeout=120)
msgs = [{"role": "user", "content": "Hello there"}]
r = oa.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0)
text = r.choices[0].message.content
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
parts, usage = [], None
for ch in oa.chat.completions.create(model="x", messages=msgs, max_tokens=16, temperature=0,
                                      stream=True, stream_options={"include_usage": True}):
    if ch.choices and ch.choices[0].delta.content:
        parts.append(ch.choices[0].delta.content)
    if ch.usage:
        usage = ch.usage
assert "".join(parts) == text, ("".join(parts), text)
assert usage and usage.completion_tokens == r.usage.completion_tokens
c = oa.completions.create(model="x", prompt="The quick brown fox", max_tokens=8, temperature=0)
assert c.choices[0].text is not None
msgs2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
r2 = oa.chat.completions.create(model="x", messages=msgs2, max_tokens=8, temperature=0)
cached = r2.usage.prompt_tokens_details.cached_tokens
assert cached and cached > 0, r2.usage
try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong").models.list()
    raise SystemExit("a wrong key was accepted")
except openai.AuthenticationError:
    pass
an = anthropic.Anthropic(base_url=base, api_key="test-key", timeout=120)
m = an.messages.create(model="x", max_tokens=16, messages=msgs, extra_body={"temperature": 0})
atext = m.content[0].text
with an.messages.stream(model="x", max_tokens=16, messages=msgs, extra_body={"temperature": 0}) as s:
    streamed = "".join(s.text_stream)
    final = s.get_final_message()
assert streamed == atext, (streamed, atext)
assert final.usage.output_tokens == m.usage.output_tokens
print(f"openai + anthropic clients: ok (chat {text!r}, cached tokens on turn 2: {cached})")
PY
if [ $# -ge 1 ]; then
  BASE="$base" timeout 300 "$venv/bin/python" tools/check-agents.py
else
  # The tiny fixture's context (256 tokens) cannot hold tool definitions.
  echo "tools/check-agents.py: skipped for the tiny fixture (give a model, e.g. Gemma 3 270M)"
fi
