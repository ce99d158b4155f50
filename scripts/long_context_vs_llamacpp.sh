#!/usr/bin/env bash
# One long prompt (CONTEXT tokens, default 16,384) and 32 tokens out, against llama-server with flash attention
# off and on, then tokenloom with a bfloat16 and an int8 KV cache: each server alone on the machine, one
# request through `tokenloom bench serve` (its time to first token is the prefill, its TPOT the decode at that
# context), each server's KV cache size from its log and its resident memory after the request.
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/long_context_vs_llamacpp.sh MODEL.gguf [tokenloom serve flags...]
#
# Results: long-context-vs-llamacpp/*.json and summary.txt (OUT=folder to change). Each prefill of 16,384
# tokens takes minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
TL=.venv/bin/tokenloom
: "${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-server}"
MODEL="${1:?the GGUF to measure}"
shift
TL_ARGS=("$@")
OUT="${OUT:-long-context-vs-llamacpp}"
CONTEXT="${CONTEXT:-16384}"
PORT="${PORT:-18511}"
LEN=$((CONTEXT + 256))  # the prompt as the bench's random words tokenize, and the 32 tokens out
mkdir -p "$OUT"
pid=""
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

rss() { awk '/VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
ready() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0; sleep 0.5; done; return 1; }
one() {  # name: the one long request against the server on PORT, then its RSS (the engine's, for tokenloom)
  $TL bench serve --base-url "http://127.0.0.1:$PORT" --endpoint completions --dataset random --input-len "$CONTEXT" \
    --output-len 32 --ignore-eos --num-prompts 1 --max-concurrency 1 --seed 7 \
    --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1 || echo "($1: the request failed; see its log)"
  local engine
  engine=$(pgrep -P "$pid" | head -1 || true)
  echo "${engine:+$(rss "$engine") engine + }$(rss "$pid")" > "$OUT/$1.rss"
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""
}

for fa in off on; do
  echo "== llama-server, flash attention $fa"
  "$LLAMA_BIN/llama-server" -m "$MODEL" -t 2 -c "$LEN" -np 1 -fa "$fa" -lv 4 --host 127.0.0.1 --port "$PORT" \
    > "$OUT/llama_fa_$fa.server.log" 2>&1 & pid=$!
  ready && one "llama_fa_$fa"
done
for kv in bfloat16 int8; do
  echo "== tokenloom, $kv KV cache"
  $TL serve "$MODEL" --port "$PORT" --max-model-len "$LEN" --kv-cache-dtype "$kv" "${TL_ARGS[@]}" \
    > "$OUT/tokenloom_$kv.server.log" 2>&1 & pid=$!
  ready && one "tokenloom_$kv"
done

$PY - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, os, re, sys
out = sys.argv[1]
def kv_kib_a_token(log: str) -> float | None:
    """llama.cpp logs its cache's MiB and cells (at -lv 4); tokenloom logs KiB a token."""
    found = re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells", log)
    if found:
        return float(found.group(1)) * 1024 / int(found.group(2))
    found = re.search(r"KV cache \([^)]*\):[^(]*\(([\d.]+) KiB a token\)", log)
    return float(found.group(1)) if found else None


print("| | prompt tokens | prefill | tokens/s | TPOT at that context | KV at that context | RSS after (MiB) |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for name in ("llama_fa_off", "llama_fa_on", "tokenloom_bfloat16", "tokenloom_int8"):
    if not os.path.exists(f"{out}/{name}.json"):
        print(f"| {name} | (no result) | | | | | |")
        continue
    run = json.load(open(f"{out}/{name}.json"))["runs"][0]
    if not run.get("completed"):
        print(f"| {name} | (failed: see {name}.log) | | | | | |")
        continue
    tokens = run["total_input_tokens"]
    ttft = run["ttft_ms"]["p50"] / 1e3
    log = open(f"{out}/{name}.server.log", errors="replace").read()
    per_token = kv_kib_a_token(log)
    kv = f"{per_token * tokens / 1024:.0f} MiB" if per_token else "(see its server log)"
    rss = open(f"{out}/{name}.rss").read().strip()
    print(f"| {name} | {tokens:,} | {ttft:.1f} s | {tokens / ttft:.1f} | {run['tpot_ms']['p50']:.1f} ms | {kv} | {rss} |")
PY
