"""Paged-attention ops (csrc/attention.cpp): their torch references and fakes.

- `paged_attention_decode(q, kv_cache, block_tables, context_lens, scale, window)` -> [B, H*D]: one query
  token per sequence attends over its first context_lens[b] cached tokens, read through its block table
  (no gather). `window` > 0 keeps only the last `window` of them (a sliding-window layer), 0 all.
- `write_kv_cache(key, value, kv_cache, slot_mapping)`: each new token's K and V into its cache slot.

kv_cache: [2, num_blocks, block_size, kv_heads, head_dim] (K, V), float32 or bfloat16, or int8 rows of
head_dim + 4 bytes (values and scale, kv_int8.py); block_tables and context_lens int32.
Query head h reads KV head h // (heads // kv_heads).
"""
from __future__ import annotations

import torch

from tokenloom import kernels
from tokenloom.kernels.kv_int8 import read_rows, to_cache


def paged_attention_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                                     context_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Each sequence alone: its keys and values gathered block by block, softmax in float32."""
    batch, heads, dim = q.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = q.new_zeros(batch, heads * dim)
    for b in range(batch):
        n = int(context_lens[b])
        left = max(0, n - window) if window > 0 else 0
        blocks = block_tables[b, : (n + block_size - 1) // block_size].long()
        keys = read_rows(kv_cache[0][blocks].reshape(-1, kv_heads, kv_cache.shape[4])[left:n], torch.float32)
        values = read_rows(kv_cache[1][blocks].reshape(-1, kv_heads, kv_cache.shape[4])[left:n], torch.float32)
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), keys) * scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), values).reshape(-1).to(q.dtype)
    return out


def write_kv_cache_reference(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    shape = (-1, kv_cache.shape[3], kv_cache.shape[4])
    kv_cache[0].view(shape).index_copy_(0, slot_mapping, to_cache(key, kv_cache.dtype))
    kv_cache[1].view(shape).index_copy_(0, slot_mapping, to_cache(value, kv_cache.dtype))


def _register_fakes() -> None:
    @torch.library.register_fake("tokenloom::paged_attention_decode")
    def _decode(q, kv_cache, block_tables, context_lens, scale, window):
        return q.new_empty((q.shape[0], q.shape[1] * q.shape[2]))

    @torch.library.register_fake("tokenloom::write_kv_cache")
    def _write(key, value, kv_cache, slot_mapping):
        return None


if kernels.load():
    _register_fakes()
