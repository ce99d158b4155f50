"""The native attention kernels over a bfloat16 and an int8 KV cache at a long context, interleaved A/B
(docs/performance.md, "The 8-bit KV cache"): Llama-3.2-1B's attention shapes (32 query / 8 KV heads of 64,
16 layers), one sequence of `--context` tokens. Decode: one query token attends over every layer's cache in
turn, as a step does, so K/V come from memory. Prefill: one layer's chunk of `--rows` rows, the last of the
prompt, over the whole context.

Usage: .venv/bin/python scripts/bench_kv_int8_attention.py [--context 16384] [--rounds 9] [--threads 0]
"""
import argparse
import time

import torch

from tokenloom import kernels
from tokenloom.kernels.kv_int8 import to_cache

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 32, 8, 64, 16, 16


def _caches(context: int, dtype: torch.dtype) -> list[torch.Tensor]:
    blocks = (context + BLOCK - 1) // BLOCK
    return [to_cache(torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM), dtype) for _ in range(LAYERS)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=0)
    ns = p.parse_args()
    assert kernels.load(), "the native kernels did not load"
    if ns.threads:
        torch.set_num_threads(ns.threads)
    ctx, scale = ns.context, HEAD_DIM ** -0.5
    tables = torch.arange((ctx + BLOCK - 1) // BLOCK, dtype=torch.int32).view(1, -1)
    lens = torch.tensor([ctx], dtype=torch.int32)
    q1, qn = torch.randn(1, HEADS, HEAD_DIM), torch.randn(ns.rows, HEADS, HEAD_DIM)
    starts, out = torch.tensor([0, ns.rows], dtype=torch.int32), torch.empty(ns.rows, HEADS * HEAD_DIM)
    caches = {dtype: _caches(ctx, dtype) for dtype in (torch.bfloat16, torch.int8)}
    decode = {dtype: [] for dtype in caches}
    prefill = {dtype: [] for dtype in caches}
    ops = torch.ops.tokenloom
    for _ in range(ns.rounds):
        for dtype, layers in caches.items():
            start = time.perf_counter()
            for cache in layers:
                ops.paged_attention_decode(q1, cache, tables, lens, scale, 0)
            decode[dtype].append(time.perf_counter() - start)
            start = time.perf_counter()
            ops.paged_attention_prefill(qn, layers[0], tables, starts, lens, scale, 0, out)
            prefill[dtype].append(time.perf_counter() - start)
    print(f"threads {torch.get_num_threads()}, ISA {kernels.isa()}, context {ctx}; median of {ns.rounds} rounds")
    for dtype, layers in caches.items():
        mib = sum(c.numel() * c.element_size() for c in layers) / 2 ** 20
        print(f"{str(dtype)[6:]:<9} KV {mib:6.0f} MiB: decode over {LAYERS} layers "
              f"{1e3 * sorted(decode[dtype])[ns.rounds // 2]:7.2f} ms, prefill of {ns.rows} rows (one layer) "
              f"{1e3 * sorted(prefill[dtype])[ns.rounds // 2]:7.1f} ms")


if __name__ == "__main__":
    main()
