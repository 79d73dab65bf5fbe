# Sourced by the tools/test-*.sh scripts that drive a live server: `serve_sluice MODEL
# [FLAGS...]` builds sluice if needed, starts `sluice serve -m MODEL --port 0 FLAGS...` in
# the background (stopped, and its log removed, when the script exits), waits until it
# prints its address and answers /health, and sets `base` (e.g. http://127.0.0.1:PORT).
# On a server that never comes up it prints the server's log and exits 1.
serve_sluice() {
  local model="$1" bin=target/release/sluice
  shift
  [ -x "$bin" ] || cargo build --release -p sluice-cli >&2
  serve_log="$(mktemp)"
  "$bin" serve -m "$model" --port 0 "$@" 2>"$serve_log" &
  serve_pid=$!
  trap 'kill -TERM $serve_pid 2>/dev/null; wait $serve_pid 2>/dev/null || true; rm -f "$serve_log"' EXIT
  for _ in $(seq 1 600); do
    grep -q "^listening on" "$serve_log" && break
    sleep 0.1
  done
  base="$(sed -n 's/^listening on //p' "$serve_log" | head -1)"
  [ -n "$base" ] || { cat "$serve_log" >&2; exit 1; }
  for _ in $(seq 1 600); do
    curl -sf "$base/health" >/dev/null && break
    sleep 0.1
  done
}
