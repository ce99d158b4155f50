"""`python -m tokenloom.bench.fused_kernels`: microseconds per call of each fused native op against the
torch code it replaces, on SmolLM2-135M's shapes (hidden 576, 9 heads over 3 KV heads of 64, MLP 1536,
block 16), interleaved A/B so machine noise hits both alike. The figures in docs/performance.md come from here.
"""
from __future__ import annotations

import argparse
import time

import torch

from tokenloom import kernels
from tokenloom.kernels import layer_ops
from tokenloom.kernels.kv_int8 import to_cache
from tokenloom.model.layers.attention_backend import ScheduledSpan, TorchAttentionBackend
from tokenloom.model.layers.attention_native import NativeAttention, NativeAttentionBackend

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, BLOCK, LAYERS = 576, 9, 3, 64, 1536, 16, 30


def _time_pair(a, b, repeats: int) -> tuple[float, float]:
    """Median microseconds of a() and b(), alternated."""
    ta, tb = [], []
    for _ in range(3):
        a(), b()
    for _ in range(repeats):
        for f, out in ((a, ta), (b, tb)):
            start = time.perf_counter()
            f()
            out.append(time.perf_counter() - start)
    return 1e6 * sorted(ta)[len(ta) // 2], 1e6 * sorted(tb)[len(tb) // 2]


def _layer_ops(rows: int, repeats: int):
    x, r, w = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN), torch.randn(HIDDEN)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
    q = qkv[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM: (HEADS + KV_HEADS) * HEAD_DIM].view(rows, KV_HEADS, HEAD_DIM)
    angles = torch.outer(torch.arange(8192.0), torch.rand(HEAD_DIM // 2))
    cos, sin, pos = angles.cos(), angles.sin(), torch.randint(0, 8192, (rows,))
    gate_up = torch.randn(rows, 2 * INTERMEDIATE)
    ops = torch.ops.tokenloom
    yield "add + RMSNorm", _time_pair(lambda: ops.add_rms_norm(x, r, w, 1e-5),
                                      lambda: layer_ops.add_rms_norm_reference(x, r, w, 1e-5), repeats)
    yield "rotary (q and k)", _time_pair(lambda: ops.rotary_embedding(pos, q, k, cos, sin),
                                         lambda: layer_ops.rotary_embedding_reference(pos, q, k, cos, sin), repeats)
    yield "SiLU and multiply", _time_pair(lambda: ops.silu_and_mul(gate_up),
                                          lambda: layer_ops.silu_and_mul_reference(gate_up), repeats)


def _attention(batch: int, context: int, kv_dtype: torch.dtype, repeats: int):
    """One layer's attention step for `batch` decodes at `context` tokens: native backend vs torch backend."""
    width = (context + BLOCK - 1) // BLOCK
    cache = to_cache(torch.randn(2, batch * width + 1, BLOCK, KV_HEADS, HEAD_DIM), kv_dtype)
    perm = torch.randperm(batch * width).view(batch, width) + 1
    spans = [ScheduledSpan(i, context - 1, 1, perm[i].tolist()) for i in range(batch)]
    slots = torch.tensor([s.block_ids[(context - 1) // BLOCK] * BLOCK + (context - 1) % BLOCK for s in spans])
    q = torch.randn(batch, HEADS, HEAD_DIM)
    k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)
    impl = NativeAttention(HEADS, KV_HEADS, HEAD_DIM)
    metas = []
    for backend in (NativeAttentionBackend(), TorchAttentionBackend()):
        backend.bind(cache)
        metas.append(backend.build_metadata(spans, slots))
    return _time_pair(lambda: impl(q, k, v, cache, metas[0]), lambda: impl(q, k, v, cache, metas[1]), repeats)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=200)
    ns = p.parse_args(argv)
    if not kernels.enabled():
        print("native kernels not loaded: nothing to compare")
        return 1
    torch.manual_seed(0)
    print(f"threads {torch.get_num_threads()}, ISA {kernels.isa()}; median us per call, native vs torch")
    for rows in (1, 32):
        for name, (native, ref) in _layer_ops(rows, ns.repeats):
            print(f"{name:<22} rows {rows:>3}: {native:8.1f} vs {ref:8.1f}  ({ref / native:4.1f}x)")
    for batch, context, dtype in ((1, 256, torch.float32), (1, 2048, torch.float32), (1, 2048, torch.bfloat16),
                                  (1, 2048, torch.int8), (32, 256, torch.float32), (32, 256, torch.bfloat16),
                                  (32, 256, torch.int8), (32, 2048, torch.bfloat16), (32, 2048, torch.int8)):
        native, ref = _attention(batch, context, dtype, max(ns.repeats // 4, 10))
        print(f"decode attention batch {batch:>2} context {context:>4} {str(dtype)[6:]:<8}: {native:8.1f} vs "
              f"{ref:8.1f}  ({ref / native:4.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
