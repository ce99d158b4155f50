"""The prefill paged-attention op (csrc/prefill_attention.cpp): its torch reference and fake.

- `paged_attention_prefill(q, kv_cache, block_tables, query_starts, context_lens, scale, window, out)`:
  chunk c's queries, rows [query_starts[c], query_starts[c+1]) of q, attend causally over the first
  context_lens[c] cached tokens of their sequence (the chunk's own K/V written there already, so its first
  row sits at position context_lens[c] - rows), read through block_tables[c]; `window` > 0 lets the query at
  position p see only positions p-window+1..p. Writes those rows of out [T, heads * head_dim]; other rows
  are left as they were (decodes, attended by paged_attention_decode).

kv_cache: [2, num_blocks, block_size, kv_heads, head_dim] (K, V), float32 or bfloat16, or int8 rows of
head_dim + 4 bytes (values and scale, kv_int8.py); q and out float32;
block_tables, query_starts and context_lens int32. Query head h reads KV head h // (heads // kv_heads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom import kernels
from tokenloom.kernels.kv_int8 import read_rows


def paged_attention_prefill_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                      query_starts: torch.Tensor, context_lens: torch.Tensor, scale: float,
                                      window: int, out: torch.Tensor) -> None:
    """Each chunk alone, as the backend did before the kernel: its blocks gathered, an explicit boolean mask,
    one SDPA call in float32."""
    heads = q.shape[1]
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    for c in range(context_lens.shape[0]):
        start, end, ctx = int(query_starts[c]), int(query_starts[c + 1]), int(context_lens[c])
        n = end - start
        blocks = block_tables[c, : (ctx + block_size - 1) // block_size].long()
        keys = read_rows(kv_cache[0][blocks].reshape(-1, kv_heads, kv_cache.shape[4])[:ctx], torch.float32)
        values = read_rows(kv_cache[1][blocks].reshape(-1, kv_heads, kv_cache.shape[4])[:ctx], torch.float32)
        rows = torch.arange(n).unsqueeze(1) + (ctx - n)
        cols = torch.arange(ctx).unsqueeze(0)
        mask = cols <= rows
        if window > 0:
            mask &= cols > rows - window
        attended = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=heads > kv_heads)
        out[start:end] = attended.squeeze(0).transpose(0, 1).reshape(n, -1)


def _register_fakes() -> None:
    @torch.library.register_fake("tokenloom::paged_attention_prefill")
    def _prefill(q, kv_cache, block_tables, query_starts, context_lens, scale, window, out):
        return None


if kernels.load():
    _register_fakes()
