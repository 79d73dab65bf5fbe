#!/usr/bin/env python3
"""Decode tok/s with and without constrained decoding, through a running `sluice serve`.

  BASE=http://127.0.0.1:PORT [KEY=...] python3 tools/bench-constrained.py [ROUNDS]

Alternates a plain chat request and the same request with a non-trivial `json_schema`
(greedy, streamed). Decode rate = (completion tokens - 1) / (time of the last chunk -
time of the first chunk), so prefill is excluded. Prints the median of each and the
ratio, and the load average (the machine may be shared): compare the ratio, not the
absolute rates, across runs. Standard library only."""
import json
import os
import statistics
import sys
import time
import urllib.request

base = os.environ["BASE"]
key = os.environ.get("KEY")
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "bio": {"type": "string", "maxLength": 400},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "bio", "address"],
    "additionalProperties": False,
}


def run(constrained):
    body = {"messages": [{"role": "user", "content": "Write a long biography of a person, as JSON."}],
            "max_tokens": 128, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": "Bearer " + key} if key else {})})
    first = last = None
    n = 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            v = json.loads(line[6:])
            if v.get("usage"):
                n = v["usage"]["completion_tokens"]
            if v.get("choices") and v["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
    return (n - 1) / (last - first) if n > 1 and last > first else float("nan"), n


plain, cons = [], []
for i in range(rounds):
    for c, acc in ((False, plain), (True, cons)):
        rate, n = run(c)
        acc.append(rate)
        print(f"round {i} {'json_schema' if c else 'plain      '}: {n} tokens, {rate:.1f} tok/s", flush=True)
p, q = statistics.median(plain), statistics.median(cons)
print(f"median decode: plain {p:.1f} tok/s, json_schema {q:.1f} tok/s, ratio {q / p:.3f}; "
      f"load average {os.getloadavg()[0]:.2f}")
