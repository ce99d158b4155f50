"""Cold start: building and loading the model must not pull in torch's compiler stack.

torch._dynamo and sympy cost 2-3 s of a cold `tokenloom generate` (measured: 6.6 s -> 4.4 s to the
answer once they were gone), and they come in by accident: meta-device math and `Module.to_empty`
run torch's Python reference ops, whose first use imports them."""
import subprocess
import sys

LOAD_THEN_REPORT = """
import sys, torch
from tokenloom.model.loader import load_model
load_model(None, torch.float32, torch.device("cpu"), progress=False)
print("imported:" + ",".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_loading_the_embedded_model_imports_neither_dynamo_nor_sympy():
    result = subprocess.run([sys.executable, "-c", LOAD_THEN_REPORT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "imported:"


API_SERVER_THEN_REPORT = """
import sys
import tokenloom.entrypoints.openai.api_server
from tokenloom.model.model_path import resolve_model_path
from tokenloom.entrypoints.compat import apply_threads
resolve_model_path(None)
apply_threads(1)  # --threads: the engine processes read it from OMP_NUM_THREADS
print("torch imported:", "torch" in sys.modules)
"""


def test_the_api_server_process_does_not_import_torch():
    """The HTTP process only tokenizes and streams; torch would cost it ~180 MB of RSS (290 -> 106 MB measured)
    and ~2 s of start-up, beside the engine process that does need it."""
    result = subprocess.run([sys.executable, "-c", API_SERVER_THEN_REPORT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "torch imported: False"


ENGINE_PROCESS_THEN_REPORT = """
import sys
import tokenloom.engine.core_proc
import tokenloom.engine.core
import tokenloom.worker.setup
print("imported:" + ",".join(m for m in ("tokenizers", "jinja2", "transformers") if m in sys.modules))
"""


def test_the_engine_process_does_not_import_the_tokenizer():
    """The engine only sees token ids; `tokenizers` and jinja2 would cost it 6.8 MiB of RSS
    (docs/performance.md, "Memory"). Structured outputs load the tokenizer later, on their first request."""
    result = subprocess.run([sys.executable, "-c", ENGINE_PROCESS_THEN_REPORT], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "imported:"


SERVER_BEFORE_LAUNCH_THEN_REPORT = """
import sys
import tokenloom.entrypoints.cli
import tokenloom.entrypoints.openai.api_server
print("imported:" + ",".join(m for m in ("fastapi", "tokenloom.entrypoints.openai.app") if m in sys.modules))
"""


def test_the_server_imports_its_http_stack_only_after_launching_the_engine():
    """FastAPI and the routes took 0.37 s of the 0.61 s before `tokenloom serve` launched its engine process;
    imported after the launch, they load while the engine imports torch (docs/performance.md, "Loading")."""
    result = subprocess.run([sys.executable, "-c", SERVER_BEFORE_LAUNCH_THEN_REPORT], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "imported:"
