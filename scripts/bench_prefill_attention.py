"""Prefill attention per call, A/B interleaved in one process: the SDPA path the native backend ran before
(one call per chunk: over the chunk's own K/V with is_causal when it starts its sequence, else over its
blocks gathered with index_select and an explicit boolean mask) against `tokenloom::paged_attention_prefill`
(csrc/prefill_attention.cpp) reading the paged cache, one call for all chunks.

SmolLM2-135M's shape: 9 query heads over 3 KV heads of 64. "fresh": the chunk starts its sequence; "cont":
it continues one with as many tokens cached before it as it has rows. "step": the prefill of one 512-token
step of `bench throughput --input-len 225`: the last 163 tokens of a prompt whose first 62 were cached the
step before, a whole 225-token prompt and the first 124 of the next; per-chunk SDPA against one kernel call.

    .venv/bin/python scripts/bench_prefill_attention.py [--rows 16,64,225,512,2000] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from tokenloom import kernels

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def sdpa_chunk(q, k, v, cache, table, context_len, scale):
    """The backend's former per-chunk path (q, k, v: the chunk's rows)."""
    n = q.shape[0]
    offset = context_len - n
    if offset == 0:
        keys, values, mask = k, v, None
    else:
        blocks = table[: (context_len + BLOCK - 1) // BLOCK]
        keys = cache[0].index_select(0, blocks).view(-1, KV_HEADS, DIM)[:context_len]
        values = cache[1].index_select(0, blocks).view(-1, KV_HEADS, DIM)[:context_len]
        mask = torch.arange(context_len).unsqueeze(0) <= torch.arange(n).unsqueeze(1) + offset
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0).float(),
                                         values.transpose(0, 1).unsqueeze(0).float(), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1).reshape(n, -1)


def make_step(chunks: list[tuple[int, int]], dtype, seed: int = 0):
    """(rows, context length) per chunk, the whole context in a cache of shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    width = max((ctx + BLOCK - 1) // BLOCK for _, ctx in chunks)
    num_blocks = width * len(chunks)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).view(len(chunks), width)
    starts = [0]
    for rows, _ in chunks:
        starts.append(starts[-1] + rows)
    t = starts[-1]
    q = torch.randn(t, HEADS, DIM, generator=g)
    k, v = torch.randn(t, KV_HEADS, DIM, generator=g), torch.randn(t, KV_HEADS, DIM, generator=g)
    return q, k, v, cache, tables, starts, [ctx for _, ctx in chunks]


def compare(chunks, dtype, reps: int) -> tuple[float, float]:
    q, k, v, cache, tables, starts, lens = make_step(chunks, dtype)
    scale = DIM ** -0.5
    out = torch.empty(q.shape[0], HEADS * DIM)
    tables32, starts32 = tables.int(), torch.tensor(starts, dtype=torch.int32)
    lens32 = torch.tensor(lens, dtype=torch.int32)

    def before():
        for c, ctx in enumerate(lens):
            a, b = starts[c], starts[c + 1]
            out[a:b] = sdpa_chunk(q[a:b], k[a:b], v[a:b], cache, tables[c], ctx, scale)

    def after():
        torch.ops.tokenloom.paged_attention_prefill(q, cache, tables32, starts32, lens32, scale, 0, out)

    before(), after()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for f, ts in zip((before, after), times):
            t0 = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t0)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,225,512,2000")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    if not kernels.enabled():
        raise SystemExit("the native kernels did not load")
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, ISA {kernels.isa()}; ms per call, median (SDPA per chunk / kernel)")
    print("| rows | kind | KV dtype | SDPA ms | kernel ms | speed-up |\n| --- | --- | --- | --- | --- | --- |")
    cases = [(f"{n}", kind, [(n, n if kind == "fresh" else 2 * n)]) for kind in ("fresh", "cont")
             for n in (int(r) for r in args.rows.split(","))]
    cases.append(("163+225+124", "step", [(163, 225), (225, 225), (124, 124)]))
    for dtype in (torch.float32, torch.bfloat16):
        for label, kind, chunks in cases:
            rows = sum(n for n, _ in chunks)
            a, b = compare(chunks, dtype, reps=max(5, min(100, 20_000 // rows)))
            print(f"| {label} | {kind} | {str(dtype).removeprefix('torch.')} | {a:.3f} | {b:.3f} | {a / b:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
