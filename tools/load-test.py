#!/usr/bin/env python3
"""Bounded load test of a running `sluice serve` on loopback (standard library only).

    tools/load-test.py --url http://127.0.0.1:8080 -n 200 -c 8 --max-tokens 32 [--pid PID]

Sends N streamed chat requests, C at a time (greedy, distinct prompts), and prints: how
many succeeded / were refused (503) / failed, throughput (requests/s, generated tokens/s),
latency and time-to-first-token p50/p99, and the server's peak RSS (VmHWM of --pid).
Only loopback URLs are accepted. Every request has a timeout; the run stops by itself.
"""
import argparse, http.client, json, statistics, sys, threading, time
from urllib.parse import urlparse

TOPICS = ["the sea", "a fox", "rain", "mountains", "a city at night", "bread", "the moon",
          "a library", "winter", "a river", "music", "an old clock", "trains", "a garden"]


def one(host, port, i, max_tokens, timeout):
    body = json.dumps({
        "messages": [{"role": "user", "content": f"Write one sentence about {TOPICS[i % len(TOPICS)]} (#{i})."}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    t0 = time.monotonic()
    c = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            r.read()
            return ("refused" if r.status == 503 else f"http {r.status}", None, None, 0)
        ttft, tokens, done = None, 0, False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            v = json.loads(data)
            if v.get("choices") and v["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.monotonic() - t0
            if v.get("usage"):
                tokens = v["usage"]["completion_tokens"]
        return ("ok" if done else "truncated", time.monotonic() - t0, ttft, tokens)
    except Exception as e:  # noqa: BLE001 - counted and reported
        return (f"error {type(e).__name__}", None, None, 0)
    finally:
        c.close()


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("-c", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--pid", type=int)
    a = ap.parse_args()
    u = urlparse(a.url)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        sys.exit("loopback URLs only")
    results, lock, nxt = [], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                if i >= a.n:
                    return
                nxt[0] += 1
            r = one(u.hostname, u.port or 80, i, a.max_tokens, a.timeout)
            with lock:
                results.append(r)

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(a.c)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    kinds = {}
    for r in results:
        kinds[r[0]] = kinds.get(r[0], 0) + 1
    ok = [r for r in results if r[0] == "ok"]
    lat = [r[1] for r in ok]
    ttft = [r[2] for r in ok if r[2] is not None]
    toks = sum(r[3] for r in ok)
    print(f"requests {a.n} concurrency {a.c} max_tokens {a.max_tokens}: {kinds}")
    print(f"wall {wall:.1f} s | {len(ok) / wall:.2f} req/s | {toks / wall:.1f} generated tok/s ({toks} tokens)")
    if ok:
        print(f"latency p50 {pct(lat, 50):.2f} s p99 {pct(lat, 99):.2f} s | "
              f"TTFT p50 {pct(ttft, 50):.3f} s p99 {pct(ttft, 99):.3f} s (mean {statistics.mean(ttft):.3f})")
    if a.pid:
        for line in open(f"/proc/{a.pid}/status"):
            if line.startswith("VmHWM"):
                print("server peak RSS", line.split(":")[1].strip())
    return 0 if len(ok) == a.n else 1


if __name__ == "__main__":
    sys.exit(main())
