#!/usr/bin/env bash
# Time from start to ready (/health answers) and memory once ready, of `tokenloom serve` and of
# llama-server on one GGUF at one context, each started alone in turn (ROUNDS times, the order swapped
# every round; the page cache warm after the first start, which is reported on its own).
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/load_vs_llamacpp.sh MODEL.gguf [tokenloom serve flags...]
#
# Without LLAMA_BIN only tokenloom starts.
#
# Memory: RSS and PSS (MiB) of llama-server and of tokenloom's engine process (the API process apart),
# from /proc/PID/smaps_rollup; PSS shares a mapped file's pages among the processes mapping it.
# COLD=1 drops the model's pages (the GGUF, and tokenloom's panel cache files) from the page cache
# before every start (posix_fadvise DONTNEED on those files alone: the rest of the machine keeps its cache).
# CONTEXT (default 4096) is llama-server's -c and tokenloom's --max-model-len. Results: OUT (default
# load-vs-llamacpp)/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
TL=("$PY" -m tokenloom.entrypoints.cli)
LLAMA_BIN="${LLAMA_BIN:-}"  # unset: tokenloom alone
MODEL="$1"; shift
TL_ARGS=("$@")
OUT="${OUT:-load-vs-llamacpp}"
PORT="${PORT:-18521}"
CONTEXT="${CONTEXT:-4096}"
ROUNDS="${ROUNDS:-2}"
mkdir -p "$OUT"
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

evict() {  # the model's files out of the page cache
  "$PY" - "$MODEL" "${TOKENLOOM_CACHE_DIR:-$HOME/.cache/tokenloom}"/weights/*.panels <<'PY'
import os, sys
for path in sys.argv[1:]:
    if os.path.isfile(path):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
PY
}
mem() { awk '/^Rss:/ {r = $2} /^Pss:/ {p = $2} END {printf "%.0f %.0f", r / 1024, p / 1024}' "/proc/$1/smaps_rollup"; }
start() {  # name: starts the server, waits for /health, prints "seconds rss pss" of the process that holds the model
  local t0 t1 holder
  [ "${COLD:-0}" = 1 ] && evict
  t0=$(date +%s.%N)
  if [ "$1" = llama ]; then
    "$LLAMA_BIN/llama-server" -m "$MODEL" -t 2 -c "$CONTEXT" -np 1 --host 127.0.0.1 --port "$PORT" \
      > "$OUT/llama_server.log" 2>&1 & pid=$!
  else
    "${TL[@]}" serve "$MODEL" --port "$PORT" --max-model-len "$CONTEXT" "${TL_ARGS[@]}" \
      > "$OUT/tokenloom_server.log" 2>&1 & pid=$!
  fi
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
    kill -0 "$pid" 2>/dev/null || { echo "$1 exited before it was ready: see $OUT/$1*_server.log" >&2; exit 1; }
    sleep 0.05
  done
  t1=$(date +%s.%N)
  sleep 2  # the engine trims its heap after a second idle (tokenloom/heap_trim.py)
  holder=$pid
  [ "$1" = tokenloom ] && holder=$(pgrep -P "$pid" | head -1)
  echo "$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}') $(mem "$holder") $(mem "$pid")"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
}
{
  echo "start to ready (s), RSS / PSS MiB once ready; $(basename "$MODEL"), context $CONTEXT, page cache $([ "${COLD:-0}" = 1 ] && echo cold || echo warm); tokenloom ${TL_ARGS[*]:-(defaults)}"
  printf "%-7s %-10s %8s %8s %8s   %s\n" round server seconds rss pss "(tokenloom: engine; API process rss pss)"
  for round in $(seq "$ROUNDS"); do
    order=(llama tokenloom); [ $((round % 2)) = 0 ] && order=(tokenloom llama)
    [ -z "$LLAMA_BIN" ] && order=(tokenloom)
    for name in "${order[@]}"; do
      read -r s r p ar ap <<< "$(start "$name")"
      printf "%-7s %-10s %8s %8s %8s   %s\n" "$round" "$name" "$s" "$r" "$p" "$([ "$name" = tokenloom ] && echo "$ar $ap")"
    done
  done
} | tee "$OUT/summary.txt"
