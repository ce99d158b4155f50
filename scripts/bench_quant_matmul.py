"""Quantized matmuls (exact, W4A8) against today's dense float32 oneDNN-prepacked weights on the embedded model's shapes,
and the whole forward at 1 and 32 single-token rows. One thread (two wait on each other's scheduling on a
busy machine); A and B interleaved in one process. Usage: .venv/bin/python scripts/bench_quant_matmul.py"""
import time, torch
from tokenloom import kernels
assert kernels.load()
from tokenloom.model.loader import load_model
from tokenloom.model.model_path import embedded_model_path
from tokenloom.model.prepack import pack_weight
from tokenloom.model.layers.linear_method import mixed_linear
q = load_model(embedded_model_path(), torch.float32, torch.device("cpu"), progress=False, quantized=True).model
layer = q.model.layers[0]
shapes = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
          "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight, "head": q.model.embed_tokens.weight}
def t(fn, reps):
    fn(); best = 1e9
    for _ in range(7):
        s = time.perf_counter()
        for _ in range(reps): fn()
        best = min(best, (time.perf_counter() - s) / reps)
    return best * 1e6
torch.set_num_threads(1)
for M in (1, 32, 256):
    for name, w in shapes.items():
        dense = pack_weight(w.dequantize())
        x = torch.randn(M, w.shape[1])
        reps = max(2, int(200 / M)) if name != "head" else 3
        a = t(lambda: mixed_linear(x, dense), reps)
        w.activations_int8 = False; b = t(lambda: w.linear(x), reps)
        w.activations_int8 = True; c = t(lambda: w.linear(x), reps)
        w.activations_int8 = False
        print(f"M={M:4d} {name:8s} {tuple(w.shape)}: dense-f32 {a:9.0f} us  exact {b:9.0f} us ({a/b:4.2f}x)  w4a8 {c:9.0f} us ({a/c:4.2f}x)", flush=True)

import sys
sys.path.insert(0, "tests")
import helpers  # noqa: E402
from tokenloom.model.layers.quantized_linear import set_quantized_matmul  # noqa: E402
from tokenloom.model.prepack import prepack_linear_weights  # noqa: E402
dense = load_model(embedded_model_path(), torch.float32, torch.device("cpu"), progress=False, quantized=False)
prepack_linear_weights(dense.model)


def forward_ms(model, rows):
    prompts = [[100 + i] for i in range(rows)]
    return t(lambda: helpers.last_logits(model, prompts), 1) / 1e3


for rows in (1, 32):
    d = forward_ms(dense.model, rows)
    set_quantized_matmul(q, "exact")
    e = forward_ms(q, rows)
    set_quantized_matmul(q, "w4a8")
    w = forward_ms(q, rows)
    print(f"forward, {rows} rows: dense {d:.1f} ms | exact {e:.1f} ms ({d/e:.2f}x) | w4a8 {w:.1f} ms ({d/w:.2f}x)")
