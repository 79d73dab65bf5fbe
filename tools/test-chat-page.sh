#!/usr/bin/env bash
# The chat page at `/` in a real browser: Debian's chromium (apt) driven headless by
# Playwright (PyPI, installed into ${SLUICE_CACHE:-~/.cache/sluice}/venv-browser; no browser
# download: Playwright is pointed at the system chromium). Against `sluice serve --api-key`
# on a tiny model: the page asks for the key, a typed question's answer streams in (several
# updates of the answer) and equals the API's own greedy answer, a second turn carries the
# history (its answer equals the API's for the whole conversation, prompt tokens reused),
# user text that looks like HTML stays text, the metrics panel fills, the CSP header is
# there and the browser reports no CSP violation or script error.
# The stop button cuts an answer short. Default model: Gemma 3 270M ($SLUICE_GEMMA, else
# tools/get-gemma.sh): it decodes slowly enough that an answer visibly streams in and can be
# stopped (the tiny fixtures answer within one network read: the page shows them in one step).
#   tools/test-chat-page.sh [MODEL.gguf]
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-${SLUICE_GEMMA:-$(tools/get-gemma.sh)}}"
chromium="${SLUICE_CHROMIUM:-$(command -v chromium || true)}"
[ -n "$chromium" ] || { echo "no chromium (apt-get install chromium)" >&2; exit 1; }
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
venv="$cache/venv-browser"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
# Playwright's Python package only; its own browser download is never run.
"$venv/bin/pip" install --quiet --disable-pip-version-check playwright >&2
. tools/lib/serve.sh
serve_sluice "$model" --api-key page-key --max-tokens 48
BASE="$base" CHROMIUM="$chromium" timeout 300 "$venv/bin/python" - <<'PY'
import json, os, urllib.request
from playwright.sync_api import sync_playwright, expect

base, key = os.environ["BASE"], "page-key"

def api_answer(messages):
    """The API's own greedy answer (not streamed), the page's oracle."""
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps({"model": "x", "messages": messages, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)["choices"][0]["message"]["content"]

with urllib.request.urlopen(base + "/", timeout=30) as r:
    csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp, csp
    assert "<script src=\"/chat.js\"" in r.read().decode()

with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=os.environ["CHROMIUM"], headless=True,
                                args=["--no-sandbox", "--disable-gpu"])
    page = browser.new_page()
    problems = []
    page.on("console", lambda m: problems.append(m.text)
            if m.type == "error" and "401" not in m.text else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(base + "/")
    # --api-key: the page asks for the key first.
    expect(page.locator("#key-form")).to_be_visible(timeout=30000)
    page.fill("#key", key)
    page.click("#key-form button")
    expect(page.locator("#key-form")).to_be_hidden(timeout=30000)
    expect(page.locator("#model")).not_to_be_empty(timeout=30000)
    # Record the answer's text lengths as the page shows them (streamed = several).
    page.evaluate("""() => {
        window.__seen = [];
        new MutationObserver(() => {
            const b = document.querySelectorAll('.msg.assistant .body');
            const n = b.length ? b[b.length - 1].textContent.length : 0;
            if (n && window.__seen[window.__seen.length - 1] !== n) window.__seen.push(n);
        }).observe(document.getElementById('log'),
                   {subtree: true, childList: true, characterData: true});
    }""")
    page.fill("#temp", "0")
    q1 = "Tell me a story about a fox"
    page.fill("#input", q1)
    page.press("#input", "Enter")
    a1 = page.locator(".msg.assistant").nth(0)
    expect(a1).to_have_attribute("data-done", "1", timeout=120000)
    text1 = a1.locator(".body").text_content()
    assert text1, "no answer"
    pieces = int(a1.get_attribute("data-pieces"))
    assert pieces >= 2, f"the answer came in {pieces} piece(s)"
    updates = len(page.evaluate("window.__seen"))
    assert updates >= 2, f"the page showed the answer in {updates} step(s), not streaming in"
    want1 = api_answer([{"role": "user", "content": q1}])
    assert text1 == want1, (text1, want1)
    # Second turn: the history goes with it; the prefix is reused.
    q2 = "<img src=x onerror=\"window.__xss=1\"> And then?"
    page.fill("#input", q2)
    page.click("#send")
    a2 = page.locator(".msg.assistant").nth(1)
    expect(a2).to_have_attribute("data-done", "1", timeout=120000)
    text2 = a2.locator(".body").text_content()
    want2 = api_answer([{"role": "user", "content": q1}, {"role": "assistant", "content": text1},
                        {"role": "user", "content": q2}])
    assert text2 == want2, (text2, want2)
    meta2 = a2.locator(".meta").text_content()
    reused = int(meta2.split(" prompt tokens reused")[0].split(", ")[-1])
    assert reused > 0, meta2
    # HTML in messages stays text.
    assert page.locator("#log img").count() == 0
    assert page.evaluate("window.__xss") is None
    assert page.locator(".msg.user").nth(1).text_content() == q2
    # The metrics panel (polled every 2 s) shows the reused prefix tokens.
    expect(page.locator("#panel")).to_have_attribute("data-live", "1", timeout=30000)
    page.wait_for_function(
        "() => parseInt(document.getElementById('m-reused').textContent) > 0", timeout=30000)
    panel = {k: page.locator("#m-" + k).text_content() for k in ("tps", "reused", "hit", "disk")}
    # Stop: a third question, stopped as soon as its first piece shows.
    page.fill("#input", "Write a very long poem about the sea")
    page.press("#input", "Enter")
    a3 = page.locator(".msg.assistant").nth(2)
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant .body')[2].textContent.length > 0",
        timeout=120000)
    page.click("#stop")
    expect(a3).to_have_attribute("data-done", "1", timeout=30000)
    assert "stopped" in a3.locator(".meta").text_content(), a3.locator(".meta").text_content()
    expect(page.locator("#send")).to_be_enabled()
    assert not problems, problems
    browser.close()
print(f"chat page in chromium: ok (answer streamed in {updates} updates; turn 2 reused "
      f"{reused} prompt tokens; panel {panel})")
PY
