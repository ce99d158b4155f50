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
# OUT/<model name>: e.g. the real-size files of scripts/shaped_gguf.py. Each summary.txt ends with the
# figures as a markdown table, with the bandwidth a token alone reaches on each side (`tokenloom bench
# roofline`: the triad on the same 2 threads, the bytes a step).
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
echo "== tokenloom bench roofline (2 threads): the triad, the bytes a step, tokenloom's batch-1 step"
$TL bench roofline -m "$MODEL" --threads 2 --context 256 --json "$OUT/tokenloom_roofline.json" "${TL_ARGS[@]}" \
  > "$OUT/tokenloom_roofline.log" 2>&1 || echo "(roofline failed: see its log)"
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

# The same as one markdown table (docs/performance.md keeps one a model): every round's figure, llama.cpp's
# first; the bandwidth fraction is bytes a token (the GGUF's for llama.cpp, the loaded form's for tokenloom,
# KV at 256 tokens) over the time a token, against the triad on the same 2 threads.
def rounds(name, c, key):
    runs = [json.load(open(p))["runs"][0] for p in sorted(glob.glob(f"{out}/{name}_c{c}_r*.json"))]
    values = [r[key] if key == "output_throughput" else r[key]["p50"] for r in runs if r.get("completed")]
    scale = 1 if key == "output_throughput" else 1e-3 if key == "ttft_ms" else 1
    return ", ".join(f"{v * scale:.1f}" for v in values) or "-"
names = ["llama"] + [n for n in ("tokenloom", "tokenloom_b") if glob.glob(f"{out}/{n}_c1_r*.json")]
print()
print("| | " + " | ".join("llama.cpp" if n == "llama" else n for n in names) + " |")
print("| --- |" + " --- |" * len(names))
print(f"| concurrency {high}, output tokens/s | " + " | ".join(rounds(n, high, "output_throughput") for n in names) + " |")
print(f"| concurrency {high}, TTFT p50 (s) | " + " | ".join(rounds(n, high, "ttft_ms") for n in names) + " |")
print("| concurrency 1, TPOT p50 (ms) | " + " | ".join(rounds(n, 1, "tpot_ms") for n in names) + " |")
print("| concurrency 1, TTFT p50 (s) | " + " | ".join(rounds(n, 1, "ttft_ms") for n in names) + " |")
prefill = [f"{pp:.1f} (pp512)"] + [
    f"{json.load(open(f'{out}/{n}_prefill.json'))['total_tokens_per_s']:.1f} (16 x 512)"
    if os.path.exists(f"{out}/{n}_prefill.json") else "-" for n in names[1:]]
print("| prefill tokens/s | " + " | ".join(prefill) + " |")
if os.path.exists(f"{out}/tokenloom_roofline.json"):
    roof = json.load(open(f"{out}/tokenloom_roofline.json"))
    value_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(roof["kv_dtype"], 1)
    llama_kv = roof["kv_bytes"] * 2 / value_bytes  # llama.cpp's KV cache is float16 (int8: about twice its bytes)
    llama_gbps = (roof["gguf_weight_bytes"] + llama_kv) * tg / 1e9
    cells = [f"{1e3 / tg:.1f} ms, {llama_gbps:.1f} GB/s ({100 * llama_gbps / roof['triad_gbps']:.0f}%)",
             f"{roof['step_ms']:.1f} ms, {roof['step_gbps']:.1f} GB/s ({100 * roof['fraction']:.0f}%)"]
    cells += ["-"] * (len(names) - len(cells))
    print(f"| a token alone (tg128 / batch-1 step), of the {roof['triad_gbps']:.1f} GB/s triad | " + " | ".join(cells) + " |")
PY
} | tee "$OUT/summary.txt"
