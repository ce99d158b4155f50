#!/usr/bin/env bash
# tokenloom and llama.cpp side by side on one GGUF, in one run:
# llama-bench pp512/tg128 against tokenloom's offline prefill, then llama-server and tokenloom serve up
# at once, `tokenloom bench serve` at concurrency 1 and CONCURRENCY (default 32; llama-server gets as many
# slots, -np) against each in turn (llama.cpp first, then
# tokenloom, then the same again in the other order, on fresh prompts: neither prefix cache hits), then
# each server's RSS.
#
#   LLAMA_BIN=/path/to/llama.cpp/build/bin scripts/bench_vs_llamacpp.sh [MODEL.gguf] [tokenloom serve flags...]
#
# B_ARGS="flags..." adds a second tokenloom server with those flags (e.g. "--quantized-matmul w4a8
# --kv-cache-dtype bfloat16"), run in every round beside the first ("tokenloom_b"): both modes against
# one set of llama.cpp runs, in half the time of two invocations.
#
# MODEL defaults to the embedded SmolLM2 GGUF. Results: bench-vs-llamacpp/*.json and summary.txt
# (OUT=folder to change). llama.cpp is not a dependency of tokenloom: build it yourself (its README).
#
# MODELS="a.gguf b.gguf ..." runs the whole comparison once per model (MODEL then left out), each into
# OUT/<model name>: e.g. the real-size files of scripts/shaped_gguf.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${MODELS:-}" ]; then
  for model in $MODELS; do
    MODELS="" OUT="${OUT:-bench-vs-llamacpp}/$(basename "$model" .gguf)" "$0" "$model" "$@"
  done
  exit 0
fi
PY=.venv/bin/python
TL=.venv/bin/tokenloom
: "${LLAMA_BIN:?set LLAMA_BIN to the folder holding llama-server and llama-bench}"
MODEL="${1:-$($PY -c 'from tokenloom.model.model_path import resolve_model_path; print(resolve_model_path(None))')}"
shift || true
TL_ARGS=("$@")
OUT="${OUT:-bench-vs-llamacpp}"
LLAMA_PORT="${LLAMA_PORT:-18501}"
TL_PORT="${TL_PORT:-18502}"
read -r -a B_ARGS <<< "${B_ARGS:-}"
HIGH="${CONCURRENCY:-32}"
NUM_HIGH="${NUM_PROMPTS:-$((HIGH * 2))}"  # requests at the high concurrency
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== llama-bench pp512 / tg128 (2 threads)"
"$LLAMA_BIN/llama-bench" -m "$MODEL" -t 2 -p 512 -n 128 -o json > "$OUT/llama_bench.json"
echo "== tokenloom offline prefill, 16 x 512 tokens"
$TL bench throughput -m "$MODEL" --num-prompts 16 --input-len 512 --output-len 1 --decode-profile 0 \
  --json "$OUT/tokenloom_prefill.json" "${TL_ARGS[@]}" > "$OUT/tokenloom_prefill.log" 2>&1
if [ ${#B_ARGS[@]} -gt 0 ]; then
  $TL bench throughput -m "$MODEL" --num-prompts 16 --input-len 512 --output-len 1 --decode-profile 0 \
    --json "$OUT/tokenloom_b_prefill.json" "${B_ARGS[@]}" > "$OUT/tokenloom_b_prefill.log" 2>&1
fi

"$LLAMA_BIN/llama-server" -m "$MODEL" -t 2 -c 65536 -np "$HIGH" --host 127.0.0.1 --port "$LLAMA_PORT" \
  > "$OUT/llama_server.log" 2>&1 & pids+=($!); llama_pid=$!
$TL serve "$MODEL" --port "$TL_PORT" --max-model-len 4096 "${TL_ARGS[@]}" > "$OUT/tokenloom_server.log" 2>&1 &
pids+=($!); tl_pid=$!
ports=("$LLAMA_PORT" "$TL_PORT")
if [ ${#B_ARGS[@]} -gt 0 ]; then
  $TL serve "$MODEL" --port "$((TL_PORT + 1))" --max-model-len 4096 "${B_ARGS[@]}" > "$OUT/tokenloom_b_server.log" 2>&1 &
  pids+=($!); tl_b_pid=$!; ports+=("$((TL_PORT + 1))")
fi
for port in "${ports[@]}"; do
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && break; sleep 0.5; done
done

run() {  # name port concurrency prompts round
  $TL bench serve --base-url "http://127.0.0.1:$2" --endpoint completions --dataset random --input-len 225 \
    --output-len 128 --ignore-eos --num-prompts "$4" --max-concurrency "$3" --warmup 1 --seed "$3$5" \
    --json "$OUT/$1_c$3_r$5.json" > "$OUT/$1_c$3_r$5.log" 2>&1 || echo "($1, concurrency $3, round $5: some requests failed; see its log)"
}
for c in 1 "$HIGH"; do
  n=$([ "$c" = 1 ] && echo 6 || echo "$NUM_HIGH")
  echo "== bench serve, concurrency $c: llama.cpp, tokenloom(, tokenloom_b), then the same backwards"
  run llama "$LLAMA_PORT" "$c" "$n" 1; run tokenloom "$TL_PORT" "$c" "$n" 1
  if [ -n "${tl_b_pid:-}" ]; then run tokenloom_b "$((TL_PORT + 1))" "$c" "$n" 1; run tokenloom_b "$((TL_PORT + 1))" "$c" "$n" 2; fi
  run tokenloom "$TL_PORT" "$c" "$n" 2; run llama "$LLAMA_PORT" "$c" "$n" 2
done
rss() { awk '/VmRSS/ {now = $2} /VmHWM/ {peak = $2} END {printf "%.0f now / %.0f peak", now / 1024, peak / 1024}' \
  "/proc/$1/status"; }
tl_engine=$(pgrep -P "$tl_pid" | head -1 || true)
tl_b_engine=$( [ -n "${tl_b_pid:-}" ] && pgrep -P "$tl_b_pid" | head -1 || true)
{
  echo "RSS MiB after the runs: llama-server $(rss "$llama_pid"); tokenloom API $(rss "$tl_pid")" \
       "${tl_engine:+engine $(rss "$tl_engine")}${tl_b_engine:+; tokenloom_b engine $(rss "$tl_b_engine")}"
  $PY - "$OUT" "$HIGH" <<'PY'
import glob, json, os, sys
out, high = sys.argv[1], int(sys.argv[2])
bench = json.load(open(f"{out}/llama_bench.json"))
pp = next(r["avg_ts"] for r in bench if r["n_prompt"] == 512)
tg = next(r["avg_ts"] for r in bench if r["n_gen"] == 128)
print(f"llama-bench tokens/s: pp512 {pp:.1f}, tg128 {tg:.1f}")
for name in ("tokenloom", "tokenloom_b"):
    if os.path.exists(f"{out}/{name}_prefill.json"):
        tl = json.load(open(f"{out}/{name}_prefill.json"))
        print(f"{name} prefill 16x512: {tl['total_tokens_per_s']:.1f} tokens/s ({tl['total_tokens_per_s'] / pp:.2f}x pp512)")
for c in (1, high):
    for path in sorted(glob.glob(f"{out}/*_c{c}_r*.json")):
        r = json.load(open(path))["runs"][0]
        name = os.path.basename(path)[:-5]
        if not r.get("completed"):
            print(f"{name:18s} every request failed ({r['failed']}): see its log")
            continue
        print(f"{name:18s} output tok/s {r['output_throughput']:8.1f}  TTFT p50 {r['ttft_ms']['p50']:9.1f} ms"
              f"  TPOT p50 {r['tpot_ms']['p50']:7.1f} ms  failed {r['failed']}")
PY
} | tee "$OUT/summary.txt"
