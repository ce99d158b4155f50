"""W4A8 against the exact quantized path on real text, teacher-forced: the largest |log p(next token)|
difference over all positions and the top-1 agreement (docs/performance.md, "Choosing a mode").

Usage: .venv/bin/python scripts/w4a8_accuracy.py
"""
import sys

import torch

from tokenloom import kernels
from tokenloom.model.layers.quantized_linear import set_quantized_matmul
from tokenloom.model.loader import load_model
from tokenloom.model.model_path import embedded_model_path
from tokenloom.tokenizer.tokenizer import Tokenizer

sys.path.insert(0, "tests")
import helpers  # noqa: E402

TEXTS = [
    "The river rises in the hills to the north and flows south through farmland for about two hundred "
    "kilometres before it reaches the sea near the old harbour town.",
    "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let it rise until it "
    "has doubled in size, then shape it and bake it in a hot oven.",
    "def mean(values):\n    if not values:\n        raise ValueError('no values')\n"
    "    return sum(values) / len(values)\n",
    "The committee met on Tuesday and agreed to postpone the vote until the budget figures had been checked "
    "by an independent auditor.",
]

assert kernels.load(), "the native kernels did not load"
path = embedded_model_path()
model = load_model(path, torch.float32, torch.device("cpu"), progress=False, quantized=True).model
tokenizer = Tokenizer.from_model_path(path)
worst, agree, positions = 0.0, 0, 0
for text in TEXTS:
    ids = tokenizer.encode(text, add_special_tokens=False)
    set_quantized_matmul(model, "exact")
    exact = torch.log_softmax(helpers.sequence_logits(model, ids).double(), -1)
    set_quantized_matmul(model, "w4a8")
    w4a8 = torch.log_softmax(helpers.sequence_logits(model, ids).double(), -1)
    nxt = torch.tensor(ids[1:])[:, None]
    worst = max(worst, (exact[:-1].gather(1, nxt) - w4a8[:-1].gather(1, nxt)).abs().max().item())
    agree += int((exact[:-1].argmax(-1) == w4a8[:-1].argmax(-1)).sum())
    positions += len(ids) - 1
print(f"W4A8 vs exact over {positions} positions of {len(TEXTS)} texts: max |logprob diff| {worst:.3f} nats, "
      f"top-1 agreement {agree}/{positions}")
