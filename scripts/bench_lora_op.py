"""The LoRA op against the base matmul it rides on, on the embedded model's layer shapes.

Per fused projection (qkv, o, gate_up, down) and batch (1 row with an adapter; 32 rows spread round robin over
4 adapters): the base quantized GEMM the model runs (`quant_gemm`, exact), the native `lora_add` for every
checkpoint target inside it (q, k, v in qkv; gate, up in gate_up), and the torch reference for the same.
Microseconds a call (a layer's), best of 7 rounds in which the variants take turns (so a load spike from other jobs hits
them alike); ratios are the LoRA time over the base GEMM's. `--lora-dtype bfloat16` holds the slots as the
engine's --lora-dtype does. `--layers 30` gives the LoRA variants 30 copies of the slots, used in turn, so
their weights come from memory as in a decode step (the model's 30 layers) rather than from the cache.

Usage: .venv/bin/python scripts/bench_lora_op.py [--threads N] [--rank 16] [--lora-dtype float32] [--layers 1]
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
parser.add_argument("--lora-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
parser.add_argument("--layers", type=int, default=1, help="copies of the slots used in turn (30: a step's worth)")
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


_MODULES = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"), "gate_up": ("mlp", "gate_up_proj"),
            "down": ("mlp", "down_proj")}
g = torch.Generator().manual_seed(0)
print(f"rank {args.rank}, {args.adapters} adapters, {args.lora_dtype} slots x {args.layers}, {args.threads} "
      f"thread(s), ISA {kernels.isa()}")
slot_dtype = getattr(torch, args.lora_dtype)
for rows, slots_used in ((1, 1), (32, args.adapters)):
    row_slots = (torch.arange(rows, dtype=torch.int32) % slots_used).to(torch.int32)
    scaling = torch.full((args.adapters,), 2.0)
    for name, (w, widths) in projections.items():
        fan_in = w.shape[1]
        x = torch.randn(rows, fan_in, generator=g)
        y = torch.zeros(rows, w.shape[0])
        copies = []  # per layer copy: (output slice, A, B) of each target
        for _ in range(args.layers):
            targets, column = [], 0
            for width in widths:
                a = (torch.randn(args.adapters, args.rank, fan_in, generator=g) * 0.01).to(slot_dtype)
                b = (torch.randn(args.adapters, args.rank, width, generator=g) * 0.01).to(slot_dtype)
                targets.append((y[:, column:column + width], a, b))
                column += width
            copies.append(targets)
        # the same projection of each layer in turn (the base GEMM reads its weights from memory too)
        weights = [getattr(getattr(model.model.layers[i % len(model.model.layers)], parent), attr).weight
                   for i in range(args.layers) for parent, attr in [_MODULES[name]]]

        def native():
            for targets in copies:
                for out, a, b in targets:
                    torch.ops.tokenloom.lora_add(out, x, a, b, scaling, row_slots)

        def reference():
            for targets in copies:
                for out, a, b in targets:
                    lora_add_reference(out, x, a, b, scaling, row_slots)

        def base_gemm():
            for wl in weights:
                p = wl.panels
                quant.quant_gemm(x, p.qpacked, p.scales, p.mins, p.columns, wl.bits, wl.block_size)

        times = best_us({"base": base_gemm, "lora-native": native, "lora-torch": reference},
                        reps=max(2, 200 // rows // args.layers))
        times = {k: v / args.layers for k, v in times.items()}  # per layer
        base = times["base"]
        print(f"rows {rows:3d} {name:8s} {tuple(w.shape)}: base {base:7.0f} us  native {times['lora-native']:6.0f} us "
              f"({times['lora-native'] / base:5.1%} of base)  torch {times['lora-torch']:6.0f} us "
              f"({times['lora-torch'] / base:5.1%})", flush=True)
