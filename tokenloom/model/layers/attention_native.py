"""The native attention backend: decode attention read straight from the paged KV cache by a C++ kernel
(tokenloom/kernels/csrc/attention.cpp), no gather, no padding mask.

Same KV layout as the torch backend ([2, blocks, block_size, kv_heads, head_dim] per layer, float32 or
bfloat16), so the block pool, block copies and prefix cache are shared unchanged. A step is one cache write
(`write_kv_cache`, every new token), one `paged_attention_decode` call for all decodes, and one SDPA call
per prefill chunk: SDPA's flash kernel (oneDNN GEMMs) is what stays fast at hundreds of rows. Chosen by
default on CPU when the native kernels load (`--attention-backend auto`); `--attention-backend native` asks
for it explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom import kernels
from tokenloom.config import ConfigError
from tokenloom.model.layers.attention import AttentionMetadata, PrefillChunk, TorchAttention
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan, register_attention_backend
from tokenloom.profiler import PROFILER


@dataclass
class NativeAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int  # the first rows of the flat batch, one query token each
    block_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks]
    context_lens: torch.Tensor | None  # int32 [num_decodes], the new token included
    prefills: list[PrefillChunk]


class NativeAttention(TorchAttention):
    """One layer's attention on the native ops. `sliding_window`: attend only the last that many positions.

    The kernel follows the metadata: given the torch backend's (an engine on that backend sharing these
    layers, as the tests' shared weights do, or the CUDA path) it runs the torch reference instead."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        self.window = sliding_window or 0

    def __call__(self, q, k, v, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, blocks, block_size, KVH, D]. Returns [T, H*D]."""
        if isinstance(meta, AttentionMetadata):
            return super().__call__(q, k, v, kv_cache, meta)
        with PROFILER.section("attention"):
            torch.ops.tokenloom.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
            d = meta.num_decodes
            decoded = None
            if d:
                decoded = torch.ops.tokenloom.paged_attention_decode(q if d == q.shape[0] else q[:d], kv_cache,
                                                                     meta.block_tables, meta.context_lens,
                                                                     self.scale, self.window)
                if not meta.prefills:
                    return decoded
            out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
            if decoded is not None:
                out[:d] = decoded
            for chunk in meta.prefills:
                out[chunk.start:chunk.end] = self._prefill_chunk(q, k, v, kv_cache, chunk)
            return out

    def _prefill_chunk(self, q, k, v, kv_cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        """One SDPA call: over the chunk's own K/V when it starts the sequence, else over its cached blocks."""
        n = chunk.end - chunk.start
        offset = chunk.context_len - n  # tokens cached before this chunk
        qs = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        if offset == 0:
            keys, values = k[chunk.start:chunk.end], v[chunk.start:chunk.end]
        else:
            block_size = kv_cache.shape[2]
            blocks = chunk.block_table[: (chunk.context_len + block_size - 1) // block_size]
            shape = (-1, self.num_kv_heads, self.head_dim)
            keys = kv_cache[0].index_select(0, blocks).view(shape)[: chunk.context_len]
            values = kv_cache[1].index_select(0, blocks).view(shape)[: chunk.context_len]
        mask = None
        if offset or (self.window and self.window < chunk.context_len):
            rows = torch.arange(n, device=q.device).unsqueeze(1) + offset
            cols = torch.arange(chunk.context_len, device=q.device).unsqueeze(0)
            mask = cols <= rows
            if self.window:
                mask &= cols > rows - self.window
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, is_causal=mask is None,
                                             scale=self.scale, enable_gqa=self.num_heads > self.num_kv_heads)
        return out.squeeze(0).transpose(0, 1).reshape(n, -1)


@register_attention_backend
class NativeAttentionBackend(AttentionBackend):
    """The torch backend's KV layout, attended by the native CPU kernels (float32 activations)."""

    name = "native"

    def __init__(self):
        if not kernels.enabled():
            raise ConfigError("--attention-backend native needs the native kernels, which did not load "
                              "(see the log line from tokenloom.kernels; TOKENLOOM_KERNELS=off turns them off)")
        self.device = torch.device("cpu")

    def bind(self, kv_cache: torch.Tensor) -> None:
        if kv_cache.device.type != "cpu":
            raise ConfigError("--attention-backend native runs on the CPU only (use torch on CUDA)")
        self.device = kv_cache.device

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return 2, num_blocks, block_size, num_kv_heads, head_dim

    def make_impl(self, num_heads, num_kv_heads, head_dim, scale: float | None = None,
                  sliding_window: int | None = None):
        return NativeAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window)

    def build_metadata(self, spans: list[ScheduledSpan], slot_mapping: torch.Tensor) -> NativeAttentionMetadata:
        """`spans` must list decodes (one token each) first."""
        dev = self.device
        decodes = [s for s in spans if s.num_tokens == 1]
        prefills = [PrefillChunk(s.first_row, s.first_row + s.num_tokens, s.start + s.num_tokens,
                                 torch.tensor(s.block_ids, device=dev)) for s in spans if s.num_tokens > 1]
        meta = NativeAttentionMetadata(slot_mapping, len(decodes), None, None, prefills)
        if decodes:
            width = max(len(s.block_ids) for s in decodes)
            meta.block_tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in decodes],
                                             dtype=torch.int32, device=dev)
            meta.context_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.int32, device=dev)
        return meta
