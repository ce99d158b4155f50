"""The LoRA op against the base matmul it rides on, on the embedded model's layer shapes.

Per fused projection (qkv, o, gate_up, down) and batch (1 row with an adapter; 32 rows spread round robin over
4 adapters): the base quantized GEMM the model runs (`quant_gemm`, exact), the native `lora_add` for every
checkpoint target inside it (q, k, v in qkv; gate, up in gate_up), and the torch reference for the same.
Microseconds a call, best of 7 rounds in which the variants take turns (so a load spike from other jobs hits
them alike); ratios are the LoRA time over the base GEMM's.

Usage: .venv/bin/python scripts/bench_lora_op.py [--threads N] [--rank 16]
"""
import argparse
import time

import torch

from tokenloom import kernels
from tokenloom.kernels import quant
from tokenloom.kernels.lora_ops import lora_add_reference
from tokenloom.model.loader import load_model
from tokenloom.model.model_path import embedded_model_path

parser = argparse.ArgumentParser()
parser.add_argument("--threads", type=int, default=1, help="torch threads (1: two wait on each other on a busy box)")
parser.add_argument("--rank", type=int, default=16)
parser.add_argument("--adapters", type=int, default=4)
args = parser.parse_args()
assert kernels.load(), "the native kernels did not load"
torch.set_num_threads(args.threads)

model = load_model(embedded_model_path(), torch.float32, torch.device("cpu"), progress=False, quantized=True).model
layer = model.model.layers[0]
attn = layer.self_attn
kv_size = (attn.qkv_proj.weight.shape[0] - attn.o_proj.weight.shape[1]) // 2
q_size, hidden = attn.o_proj.weight.shape[1], attn.o_proj.weight.shape[0]
inter = layer.mlp.down_proj.weight.shape[1]
# fused projection -> (its weight, the output widths of the checkpoint targets inside it)
projections = {"qkv": (attn.qkv_proj.weight, [q_size, kv_size, kv_size]),
               "o": (attn.o_proj.weight, [hidden]),
               "gate_up": (layer.mlp.gate_up_proj.weight, [inter, inter]),
               "down": (layer.mlp.down_proj.weight, [hidden])}


def best_us(fns: dict, reps: int, rounds: int = 7) -> dict:
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


g = torch.Generator().manual_seed(0)
print(f"rank {args.rank}, {args.adapters} adapters, {args.threads} thread(s), ISA {kernels.isa()}")
for rows, slots_used in ((1, 1), (32, args.adapters)):
    row_slots = (torch.arange(rows, dtype=torch.int32) % slots_used).to(torch.int32)
    scaling = torch.full((args.adapters,), 2.0)
    for name, (w, widths) in projections.items():
        fan_in = w.shape[1]
        x = torch.randn(rows, fan_in, generator=g)
        y = torch.zeros(rows, w.shape[0])
        targets = []
        column = 0
        for width in widths:
            a = torch.randn(args.adapters, args.rank, fan_in, generator=g) * 0.01
            b = torch.randn(args.adapters, args.rank, width, generator=g) * 0.01
            targets.append((y[:, column:column + width], a, b))
            column += width
        p = w.panels

        def native():
            for out, a, b in targets:
                torch.ops.tokenloom.lora_add(out, x, a, b, scaling, row_slots)

        def reference():
            for out, a, b in targets:
                lora_add_reference(out, x, a, b, scaling, row_slots)

        times = best_us({"base": lambda: quant.quant_gemm(x, p.qpacked, p.scales, p.mins, p.columns, w.bits,
                                                          w.block_size),
                         "lora-native": native, "lora-torch": reference}, reps=max(5, 200 // rows))
        base = times["base"]
        print(f"rows {rows:3d} {name:8s} {tuple(w.shape)}: base {base:7.0f} us  native {times['lora-native']:6.0f} us "
              f"({times['lora-native'] / base:5.1%} of base)  torch {times['lora-torch']:6.0f} us "
              f"({times['lora-torch'] / base:5.1%})", flush=True)
