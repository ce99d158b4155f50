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
