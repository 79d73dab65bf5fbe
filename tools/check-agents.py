#!/usr/bin/env python3
"""Tool calls and structured output through the official `openai` and `anthropic` clients
(issue 33). Run by tools/test-server-clients.sh against a running `sluice serve` (BASE, key
`test-key`). The oracle is the `jsonschema` package: forced tool-call arguments and
`json_schema` answers must validate against the schema the request gave; streamed answers
must equal the whole ones."""
import json
import os

import anthropic
import jsonschema
import openai

base = os.environ["BASE"]
oa = openai.OpenAI(base_url=base + "/v1", api_key="test-key", timeout=120)
an = anthropic.Anthropic(base_url=base, api_key="test-key", timeout=120)

params = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast of a city", "parameters": params}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"], "additionalProperties": False}}},
]
msgs = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
    r = oa.chat.completions.create(model="x", messages=msgs, tools=tools, tool_choice=choice,
                                   max_tokens=120, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    assert ch.message.tool_calls and len(ch.message.tool_calls) == 1, ch.message
    call = ch.message.tool_calls[0]
    if isinstance(choice, dict):
        assert call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, by_name[call.function.name])
    # Streamed: the same call.
    name, arg_text, finish = None, "", None
    for c in oa.chat.completions.create(model="x", messages=msgs, tools=tools, tool_choice=choice,
                                        max_tokens=120, temperature=0, stream=True):
        if not c.choices:
            continue
        d = c.choices[0].delta
        for tc in d.tool_calls or []:
            name = tc.function.name or name
            arg_text += tc.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls", finish
    assert (name, json.loads(arg_text)) == (call.function.name, args), (name, arg_text, call)
    print(f"openai tool_choice={choice!r}: {call.function.name}({call.function.arguments})")

# The tool result goes back and the model answers.
turn2 = msgs + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
    {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sunny", "high": 21})},
]
r = oa.chat.completions.create(model="x", messages=turn2, tools=tools, max_tokens=24, temperature=0)
assert r.choices[0].finish_reason in ("stop", "length", "tool_calls"), r

# Structured output: json_schema (strict) validates; streamed == whole.
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
rf = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}}
pm = [{"role": "user", "content": "Describe a person as JSON."}]
r = oa.chat.completions.create(model="x", messages=pm, response_format=rf, max_tokens=200, temperature=0)
text = r.choices[0].message.content
assert r.choices[0].finish_reason == "stop", r
jsonschema.validate(json.loads(text), schema)
streamed = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
    model="x", messages=pm, response_format=rf, max_tokens=200, temperature=0, stream=True) if c.choices)
assert streamed == text, (streamed, text)
print(f"openai json_schema: {text}")

# A schema that cannot be compiled: 400 naming the field.
try:
    oa.chat.completions.create(model="x", messages=pm, max_tokens=8, response_format={
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}})
    raise SystemExit("a bad schema was accepted")
except openai.BadRequestError as e:
    assert "response_format" in str(e), e

# Anthropic: tool_choice any -> a tool_use block whose input validates; streamed the same.
atools = [{"name": t["function"]["name"], "description": t["function"]["description"],
           "input_schema": t["function"]["parameters"]} for t in tools]
m = an.messages.create(model="x", max_tokens=120, messages=msgs, tools=atools, tool_choice={"type": "any"},
                       extra_body={"temperature": 0})
assert m.stop_reason == "tool_use", m
tu = [b for b in m.content if b.type == "tool_use"]
assert len(tu) == 1, m.content
jsonschema.validate(tu[0].input, by_name[tu[0].name])
with an.messages.stream(model="x", max_tokens=120, messages=msgs, tools=atools, tool_choice={"type": "any"},
                        extra_body={"temperature": 0}) as s:
    final = s.get_final_message()
stu = [b for b in final.content if b.type == "tool_use"]
assert len(stu) == 1 and (stu[0].name, stu[0].input) == (tu[0].name, tu[0].input), (final.content, tu)
assert final.stop_reason == "tool_use", final
# tool_result back in.
m2 = an.messages.create(model="x", max_tokens=16, tools=atools, extra_body={"temperature": 0}, messages=msgs + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": tu[0].id, "name": tu[0].name, "input": tu[0].input}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu[0].id, "content": "sunny, 21 C"}]}])
assert m2.content, m2
print(f"anthropic tool_choice any: {tu[0].name}({json.dumps(tu[0].input)})")
print("agents (tools, json_schema): ok")
