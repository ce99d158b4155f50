#!/usr/bin/env bash
# One prepared run on a lent GPU machine (the `device` tool): about 6-8 minutes, every figure under $OUT.
#
# Here first:  .venv/bin/python scripts/device_prepare.py      (writes .device/: wheels + model shape)
# Then, with the device tool:  run(command="bash scripts/device_check.sh", carry=[".device"], timeout_s=590)
#
# It installs the carried wheels, gives the embedded model's shape random bf16 weights (its GGUF is over
# the carry cap; speed does not depend on the weights), runs the CUDA-marked tests (greedy identity against
# transformers, FlashInfer against SDPA, CUDA graphs against eager, the KV budget), `bench throughput` with
# and without graphs, and `bench serve` at concurrency 1, 32 and 256 with and without graphs.
# Files back (at most 8): summary.txt, tests.txt, throughput_{graphs,eager}.json, serve_{graphs,eager}.json.
# A rehearsal on a CPU machine checks the script itself: REHEARSAL=1 PYTHON=.venv/bin/python bash scripts/device_check.sh
# (no wheel install, --device cpu, a few prompts each).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=cuda PROMPTS=256 INPUT=225 OUTPUT=128 LEVELS="1 32 256"
LAYERS=""  # the model's own depth
[ "${REHEARSAL:-0}" = 1 ] && DEVICE=cpu PROMPTS=4 INPUT=32 OUTPUT=8 LEVELS="1 4" MODEL=/tmp/rehearsal-model LAYERS=2
SUMMARY="$OUT/summary.txt"
log() { echo "[$(date +%T)] $*" | tee -a "$SUMMARY"; }

if [ "$DEVICE" = cuda ]; then
  log "installing the carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .device/whl/*.whl >>"$SUMMARY" 2>&1 || { log "wheel install failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$SUMMARY" 2>&1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)" >>"$SUMMARY" 2>&1
"$PY" -c "import flashinfer; print('flashinfer', flashinfer.__version__)" >>"$SUMMARY" 2>&1 \
  || log "flashinfer not installed: attention runs on SDPA, decode steps eagerly"

MODEL=${MODEL:-/tmp/smollm2-shape}
rm -rf "$MODEL" && cp -r .device/smollm2-shape "$MODEL"
log "random bf16 weights for $MODEL"
"$PY" - "$MODEL" $LAYERS <<'EOF' >>"$SUMMARY" 2>&1
import sys, torch, transformers
folder = sys.argv[1]
config = transformers.AutoConfig.from_pretrained(folder)
if len(sys.argv) > 2:  # a rehearsal: fewer layers, same everything else
    config.num_hidden_layers = int(sys.argv[2])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(folder, safe_serialization=True)
print("saved", sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
EOF

log "CUDA tests"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/unit/test_attention_flashinfer.py \
  >"$OUT/tests.txt" 2>&1
log "tests: $(tail -1 "$OUT/tests.txt")"
timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_kv_budget.py tests/unit/test_cuda_graph_ladder.py \
  >>"$OUT/tests.txt" 2>&1

BENCH=("$PY" -m tokenloom.entrypoints.cli bench)
for mode in graphs eager; do
  flag=$([ $mode = eager ] && echo --enforce-eager)
  log "bench throughput ($mode)"
  timeout 120 "${BENCH[@]}" throughput -m "$MODEL" --device $DEVICE $flag --num-prompts $PROMPTS --input-len $INPUT \
    --output-len $OUTPUT --max-num-seqs 256 --json "$OUT/throughput_$mode.json" >>"$SUMMARY" 2>&1 \
    || log "bench throughput ($mode) failed"
done

for mode in graphs eager; do
  flag=$([ $mode = eager ] && echo --enforce-eager)
  port=$((18600 + RANDOM % 1000))
  log "serve ($mode) on port $port"
  "$PY" -m tokenloom.entrypoints.cli serve "$MODEL" --device $DEVICE --port "$port" --max-num-seqs 256 $flag \
    >"$OUT/serve_$mode.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  for c in $LEVELS; do
    n=$([ $c = 1 ] && echo 8 || echo $((c * 2)))
    timeout 150 "${BENCH[@]}" serve --port "$port" --endpoint completions --dataset random --input-len $INPUT \
      --output-len $OUTPUT --ignore-eos --num-prompts $n --max-concurrency $c --warmup 1 --disable-tqdm \
      --json "$OUT/serve_${mode}_c$c.json" >>"$SUMMARY" 2>&1 || log "bench serve c=$c ($mode) failed"
  done
  kill $server; wait $server 2>/dev/null
  tail -5 "$OUT/serve_$mode.log" >>"$SUMMARY"; rm -f "$OUT/serve_$mode.log"
done
# Eight files at most come back: fold the per-concurrency results into one file per mode.
for mode in graphs eager; do
  "$PY" - "$OUT" "$mode" <<'EOF'
import json, os, sys
out, mode = sys.argv[1], sys.argv[2]
merged = {}
for c in (1, 4, 32, 256):
    path = os.path.join(out, f"serve_{mode}_c{c}.json")
    if os.path.exists(path):
        merged[f"c{c}"] = json.load(open(path))
        os.remove(path)
json.dump(merged, open(os.path.join(out, f"serve_{mode}.json"), "w"), indent=1)
EOF
done
log "done"
