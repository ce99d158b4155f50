#!/usr/bin/env bash
# Memory of tokenloom's engine process and of llama-server at a 4,096-token context, one sequence
# (the goal: engine RSS at most 1.5x llama-server's on the same GGUF and context).
#
# Both servers up at once (llama-server -t 2 -c 4096 -np 1; tokenloom serve --max-model-len 4096), then
# RSS now / peak (VmRSS / VmHWM, MiB) of llama-server and of tokenloom's engine (the child of
# `tokenloom serve`; the API process is listed apart) at three points:
#   idle      after start-up (the warm-up included)
#   bench     after one benchmark-shaped request (225 tokens in, 128 out, as bench_vs_llamacpp.sh sends)
#   long      after one ~3,900-token prompt (16 tokens out)
# and where the engine's resident memory lies at each point (scripts/rss_breakdown.py over /proc/PID/smaps).
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/rss_vs_llamacpp.sh [MODEL.gguf] [tokenloom serve flags...]
#
# MODEL defaults to the embedded SmolLM2 GGUF. Results: rss-vs-llamacpp/summary.txt (OUT=folder to change).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TL=.venv/bin/tokenloom
: "${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-server}"
MODEL="${1:-$($PY -c 'from tokenloom.model.model_path import resolve_model_path; print(resolve_model_path(None))')}"
shift || true
TL_ARGS=("$@")
OUT="${OUT:-rss-vs-llamacpp}"
LLAMA_PORT="${LLAMA_PORT:-18511}"
TL_PORT="${TL_PORT:-18512}"
CONTEXT="${CONTEXT:-4096}"
LONG_LEN="${LONG_LEN:-3900}"
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

"$LLAMA_BIN/llama-server" -m "$MODEL" -t 2 -c "$CONTEXT" -np 1 --host 127.0.0.1 --port "$LLAMA_PORT" \
  > "$OUT/llama_server.log" 2>&1 & pids+=($!); llama_pid=$!
$TL serve "$MODEL" --port "$TL_PORT" --max-model-len "$CONTEXT" "${TL_ARGS[@]}" > "$OUT/tokenloom_server.log" 2>&1 &
pids+=($!); tl_pid=$!
for port in "$LLAMA_PORT" "$TL_PORT"; do
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 0.5; done
  curl -sf "http://127.0.0.1:$port/health" > /dev/null || { echo "server on port $port did not come up" >&2; exit 1; }
done
engine_pid=$(pgrep -P "$tl_pid" | head -1)
[ -n "$engine_pid" ] || { echo "no engine process under tokenloom serve ($tl_pid)" >&2; exit 1; }

rss() { awk '/VmRSS/ {now = $2} /VmHWM/ {peak = $2} END {printf "%6.0f / %6.0f", now / 1024, peak / 1024}' \
  "/proc/$1/status"; }
request() {  # port input-len output-len seed
  local name="$OUT/request_port$1_$2"
  $TL bench serve --base-url "http://127.0.0.1:$1" --endpoint completions --dataset random --input-len "$2" \
    --output-len "$3" --ignore-eos --num-prompts 1 --max-concurrency 1 --seed "$4" --json "$name.json" \
    > "$name.log" 2>&1 || true
  $PY -c 'import json, sys; sys.exit(json.load(open(sys.argv[1]))["runs"][0]["failed"] != 0)' "$name.json" \
    || { echo "the request of $2 tokens to port $1 failed: see $name.log and the server logs in $OUT" >&2; exit 1; }
}
table="$OUT/summary.txt"
{
  echo "RSS MiB, now / peak (VmRSS / VmHWM); context $CONTEXT, one sequence; tokenloom ${TL_ARGS[*]:-(defaults)}"
  printf "%-8s %-17s %-17s %-17s %s\n" point llama-server "tokenloom engine" "engine/llama now" "tokenloom API"
} > "$table"
point() {  # name
  sleep 3  # the engine trims its heap after a second idle (tokenloom/heap_trim.py)
  local l e
  l=$(awk '/VmRSS/ {print $2}' "/proc/$llama_pid/status"); e=$(awk '/VmRSS/ {print $2}' "/proc/$engine_pid/status")
  printf "%-8s %-17s %-17s %-17s %s\n" "$1" "$(rss "$llama_pid")" "$(rss "$engine_pid")" \
    "$(awk -v e="$e" -v l="$l" 'BEGIN {printf "%.2fx", e / l}')" "$(rss "$tl_pid")" >> "$table"
  $PY scripts/rss_breakdown.py "$engine_pid" > "$OUT/engine_breakdown_$1.txt"
}
point idle
request "$LLAMA_PORT" 225 128 1; request "$TL_PORT" 225 128 1
point bench
request "$LLAMA_PORT" "$LONG_LEN" 16 2; request "$TL_PORT" "$LONG_LEN" 16 2
point long
{
  echo
  for name in idle bench long; do echo "engine at '$name':"; cat "$OUT/engine_breakdown_$name.txt"; done
} >> "$table"
cat "$table"
