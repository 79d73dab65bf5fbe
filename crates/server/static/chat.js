// sluice chat page: multi-turn chat over /v1/chat/completions (streamed, SSE read from a
// fetch body), a stop button (aborts the fetch; the server stops generating when the
// connection closes), and a panel fed by /metrics. Model output is only ever set with
// textContent, never parsed as HTML. Served with a Content-Security-Policy that allows no
// inline script, so everything lives in this file.
"use strict";

const $ = (id) => document.getElementById(id);
const turns = []; // {role, content} of finished turns
let apiKey = sessionStorage.getItem("sluice-key") || "";
let modelName = "sluice";
let controller = null; // AbortController of the answer being streamed
let lastMetrics = null; // {t, completion}

function headers(extra) {
  const h = Object.assign({}, extra || {});
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

// One message bubble; returns its parts (text set through textContent only).
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const reasoning = document.createElement("div");
  reasoning.className = "reasoning";
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text || "";
  const meta = document.createElement("div");
  meta.className = "meta";
  div.append(reasoning, body, meta);
  $("log").append(div);
  div.scrollIntoView({ block: "end" });
  return { div, reasoning, body, meta };
}

function askForKey(why) {
  $("key-form").hidden = false;
  $("key-error").textContent = why || "";
  $("key").focus();
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      askForKey(apiKey ? "That key was refused." : "");
      return false;
    }
    const v = await r.json();
    if (v.data && v.data.length) {
      modelName = v.data[0].id;
      $("model").textContent = modelName;
    }
    $("key-form").hidden = true;
    return true;
  } catch (e) {
    $("m-status").textContent = "server unreachable: " + e.message;
    return false;
  }
}

// Read an SSE body: calls onEvent(data) for every `data:` payload.
async function readSse(body, onEvent) {
  const reader = body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = block
        .split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) onEvent(data);
    }
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy ? "1" : "";
}

async function send(text) {
  turns.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  controller = new AbortController();
  setBusy(true);
  let content = "";
  let reasoning = "";
  let usage = null;
  let first = 0;
  let pieces = 0;
  let error = "";
  const t0 = performance.now();
  const req = {
    model: modelName,
    messages: turns,
    stream: true,
    stream_options: { include_usage: true },
  };
  const temp = $("temp").value.trim();
  if (temp !== "") req.temperature = Number(temp);
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(req),
      signal: controller.signal,
    });
    if (r.status === 401) {
      askForKey("The key was refused.");
      throw new Error("unauthorized");
    }
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try {
        const v = await r.json();
        if (v.error && v.error.message) msg = v.error.message;
      } catch (_) { /* not JSON */ }
      throw new Error(msg);
    }
    await readSse(r.body, (data) => {
      if (data === "[DONE]") return;
      const v = JSON.parse(data);
      if (v.error) throw new Error(v.error.message || "error");
      if (v.usage) usage = v.usage;
      const d = v.choices && v.choices[0] && v.choices[0].delta;
      if (!d) return;
      if (d.reasoning_content) {
        reasoning += d.reasoning_content;
        out.reasoning.textContent = reasoning;
      }
      if (d.content) {
        if (!first) first = performance.now();
        pieces += 1;
        content += d.content;
        out.body.textContent = content;
        out.div.scrollIntoView({ block: "end" });
      }
    });
  } catch (e) {
    if (e.name === "AbortError") {
      error = "stopped";
    } else {
      error = e.message;
    }
  }
  controller = null;
  setBusy(false);
  // Keep what was answered (also a stopped partial answer) so the next turn follows it.
  turns.push({ role: "assistant", content });
  const secs = (performance.now() - (first || t0)) / 1000;
  const parts = [];
  if (usage) {
    const tps = secs > 0 ? (usage.completion_tokens / secs).toFixed(1) : "–";
    const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
    parts.push(usage.completion_tokens + " tokens, " + tps + " tokens/s, " + cached + " prompt tokens reused");
    $("m-answer").textContent = tps + " tokens/s (" + usage.completion_tokens + " tokens)";
  } else if (pieces) {
    parts.push(pieces + " pieces");
  }
  if (error) {
    parts.push(error);
    if (error !== "stopped") out.div.classList.add("error");
  }
  out.meta.textContent = parts.join(" · ");
  out.div.dataset.pieces = String(pieces);
  out.div.dataset.done = "1";
}

// Prometheus text -> {name: value} (unlabelled samples only).
function parseMetrics(text) {
  const m = {};
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const sp = line.lastIndexOf(" ");
    const name = line.slice(0, sp);
    if (name.includes("{")) continue;
    m[name] = Number(line.slice(sp + 1));
  }
  return m;
}

async function pollMetrics() {
  try {
    const r = await fetch("/metrics", { headers: headers() });
    if (!r.ok) return;
    const m = parseMetrics(await r.text());
    const now = performance.now();
    const comp = m["sluice_completion_tokens_total"] || 0;
    if (lastMetrics) {
      const dt = (now - lastMetrics.t) / 1000;
      const tps = dt > 0 ? (comp - lastMetrics.completion) / dt : 0;
      $("m-tps").textContent = tps.toFixed(1);
    }
    lastMetrics = { t: now, completion: comp };
    const reused = m["sluice_prefix_reused_tokens_total"] || 0;
    const prompt = m["sluice_prompt_tokens_total"] || 0;
    $("m-reused").textContent =
      reused + " of " + prompt + (prompt ? " (" + ((100 * reused) / prompt).toFixed(0) + "%)" : "");
    if ("sluice_expert_cache_hits_total" in m) {
      const h = m["sluice_expert_cache_hits_total"];
      const miss = m["sluice_expert_cache_misses_total"] || 0;
      $("m-hit").textContent = h + miss ? ((100 * h) / (h + miss)).toFixed(1) + "%" : "–";
      const gb = (m["sluice_expert_bytes_read_total"] || 0) / 1e9;
      $("m-disk").textContent =
        (m["sluice_expert_read_gbps"] || 0).toFixed(2) + " GB/s (" + gb.toFixed(2) + " GB read)";
    } else {
      $("m-hit").textContent = "resident (not streamed)";
      $("m-disk").textContent = "–";
    }
    $("m-queue").textContent = (m["sluice_running"] || 0) + " / " + (m["sluice_queue_depth"] || 0);
    $("m-status").textContent = "";
    $("panel").dataset.live = "1";
  } catch (e) {
    $("m-status").textContent = "metrics: " + e.message;
  }
}

function start() {
  $("ask").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("input").value.trim();
    if (!text || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) {
      ev.preventDefault();
      $("ask").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (controller) controller.abort();
  });
  $("clear").addEventListener("click", () => {
    if (controller) controller.abort();
    turns.length = 0;
    $("log").replaceChildren();
  });
  $("key-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    apiKey = $("key").value.trim();
    sessionStorage.setItem("sluice-key", apiKey);
    if (await loadModel()) pollMetrics();
  });
  loadModel().then((ok) => {
    if (ok) pollMetrics();
  });
  setInterval(() => {
    if ($("key-form").hidden) pollMetrics();
  }, 2000);
}

start();
