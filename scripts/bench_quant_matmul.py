"""Quantized matmuls against dense weights on the embedded model's shapes, then the whole forward.

Per shape and row count (1, 32, 256, 512): dense float32 (today's oneDNN-prepacked weight), dense bfloat16
(`--bf16`; slow on a CPU without AVX512-BF16), the row-major kernels (`quant_matmul`, `quant_matmul_a8`) and
the column-interleaved ones (`quant_gemm`, `quant_gemm_a8`: what the model runs, an
interleaved GEMM). Microseconds a call, best of 7, all variants interleaved in one process; ratios are
dense f32 over the variant; the variants take turns (round robin) so load spikes hit them alike. Then the
forward at 1 and 32 single-token rows: dense, exact, W4A8.

Usage: .venv/bin/python scripts/bench_quant_matmul.py [--threads N] [--rows 1,32,256,512] [--bf16] [--no-forward]
"""
import argparse
import sys
import time

import torch

from tokenloom import kernels
from tokenloom.kernels import quant
from tokenloom.model.layers.linear_method import mixed_linear
from tokenloom.model.layers.onednn_layout import pack_weight
from tokenloom.model.loader import load_model
from tokenloom.model.model_path import embedded_model_path

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=1, help="torch threads (1: two wait on each other on a busy box)")
parser.add_argument("--rows", default="1,32,256,512")
parser.add_argument("--bf16", action="store_true", help="also dense bfloat16 (oneDNN)")
parser.add_argument("--no-forward", action="store_true")
args = parser.parse_args()
assert kernels.load(), "the native kernels did not load"
torch.set_num_threads(args.threads)

q = load_model(embedded_model_path(), torch.float32, torch.device("cpu"), progress=False, quantized=True).model
layer = q.model.layers[0]
shapes = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
          "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
          "head": q.model.embed_tokens.weight}


def best_us(fns: dict, reps: int, rounds: int = 7) -> dict:
    """Best microseconds a call of each fn; the fns take turns each round, so a load spike from other
    jobs hits them alike instead of one of them."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps)
    return {name: t * 1e6 for name, t in best.items()}


for rows in (int(r) for r in args.rows.split(",")):
    for name, w in shapes.items():
        row_major = w.row_major()
        p = w.panels
        dense = pack_weight(w.dequantize())
        dense_bf16 = pack_weight(w.dequantize(torch.bfloat16)) if args.bf16 else None
        x = torch.randn(rows, w.shape[1])
        reps = max(1, int(200 / rows)) if name != "head" else 1
        rm = (row_major.qweight, row_major.scales, row_major.mins, w.bits, w.block_size)
        pn = (p.qpacked, p.scales, p.mins, p.columns, w.bits, w.block_size)
        variants = {"dense-f32": lambda: mixed_linear(x, dense)}
        if dense_bf16 is not None:
            xb = x.bfloat16()
            variants["dense-bf16"] = lambda: mixed_linear(xb, dense_bf16)
        variants |= {"exact-rowmajor": lambda: quant.quant_matmul(x, *rm),
                     "exact-interleaved": lambda: quant.quant_gemm(x, *pn),
                     "w4a8-rowmajor": lambda: quant.quant_matmul_a8(x, *rm),
                     "w4a8-interleaved": lambda: quant.quant_gemm_a8(x, *pn)}
        times = best_us(variants, reps)
        base = times["dense-f32"]
        cells = "  ".join(f"{k} {v:9.0f} ({base / v:4.2f}x)" for k, v in times.items())
        print(f"M={rows:4d} {name:8s} {tuple(w.shape)}: {cells}", flush=True)

if args.no_forward:
    sys.exit(0)

sys.path.insert(0, "tests")
import helpers  # noqa: E402

from tokenloom.model.layers.quantized_linear import set_quantized_matmul  # noqa: E402
from tokenloom.model.prepack import prepack_linear_weights  # noqa: E402

dense_model = load_model(embedded_model_path(), torch.float32, torch.device("cpu"), progress=False, quantized=False)
prepack_linear_weights(dense_model.model)


def forward(model, rows, mode=None):
    prompts = [[100 + i] for i in range(rows)]

    def run():
        if mode:
            set_quantized_matmul(model, mode)
        helpers.last_logits(model, prompts)
    return run


for rows in (1, 32):
    ms = {k: v / 1e3 for k, v in best_us({"dense": forward(dense_model.model, rows), "exact": forward(q, rows, "exact"),
                                          "w4a8": forward(q, rows, "w4a8")}, 1, rounds=5).items()}
    d, e, a = ms["dense"], ms["exact"], ms["w4a8"]
    print(f"forward, {rows} rows: dense {d:.1f} ms | exact {e:.1f} ms ({d / e:.2f}x) | w4a8 {a:.1f} ms ({d / a:.2f}x)")
