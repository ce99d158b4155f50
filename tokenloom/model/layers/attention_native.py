"""The native attention backend: attention read straight from the paged KV cache by C++ kernels, no gather,
no padding or mask tensor: `paged_attention_decode` (tokenloom/kernels/csrc/attention.cpp) for all decodes and
`paged_attention_prefill` (csrc/prefill_attention.cpp) for all prefill chunks, one call each per layer.

Same KV layout as the torch backend ([2, blocks, block_size, kv_heads, head_dim] per layer, float32 or bfloat16, or
the 8-bit cache's int8 rows of head_dim + 4 bytes, tokenloom/kernels/kv_int8.py), so the block pool, block copies
and prefix cache are shared unchanged. A step is one cache write (`write_kv_cache`, every new token, so a chunk's
own K/V are in the cache before it attends), then the two kernels. The prefill kernel replaced one SDPA call per
chunk (over the chunk's K/V, or over its gathered blocks with a boolean mask when it continues a sequence): 1.4-4x
faster per call (one thread) from 16 to 2,000 rows, fresh and continued, float32 and bfloat16 caches
(docs/performance.md, "Prefill attention"), so no size falls back to SDPA.
Chosen by default on CPU when the native kernels load (`--attention-backend auto`); `--attention-backend
native` asks for it explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom import kernels
from tokenloom.config import ConfigError
from tokenloom.model.layers.attention import AttentionMetadata, TorchAttention
from tokenloom.model.layers.attention_backend import AttentionBackend, ScheduledSpan
from tokenloom.profiler import PROFILER


@dataclass
class NativeAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int  # the first rows of the flat batch, one query token each
    block_tables: torch.Tensor | None  # int32 [num_decodes, max_blocks]
    context_lens: torch.Tensor | None  # int32 [num_decodes], the new token included
    num_prefills: int  # chunks of more than one token, in the rows after the decodes
    prefill_block_tables: torch.Tensor | None  # int32 [num_prefills, max_blocks]
    prefill_query_starts: torch.Tensor | None  # int32 [num_prefills + 1]: chunk c is flat rows [starts[c], starts[c+1])
    prefill_context_lens: torch.Tensor | None  # int32 [num_prefills], the chunk's own tokens included


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
                if not meta.num_prefills:
                    return decoded
            out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
            if decoded is not None:
                out[:d] = decoded
            torch.ops.tokenloom.paged_attention_prefill(q, kv_cache, meta.prefill_block_tables,
                                                        meta.prefill_query_starts, meta.prefill_context_lens,
                                                        self.scale, self.window, out)
            return out


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
        prefills = [s for s in spans if s.num_tokens > 1]
        meta = NativeAttentionMetadata(slot_mapping, len(decodes), None, None, len(prefills), None, None, None)
        if decodes:
            meta.block_tables = _block_table([s.block_ids for s in decodes], dev)
            meta.context_lens = torch.tensor([s.start + 1 for s in decodes], dtype=torch.int32, device=dev)
        if prefills:
            starts = [prefills[0].first_row]
            for s in prefills:
                if s.first_row != starts[-1]:
                    raise ValueError("build_metadata: prefill chunks must follow one another in the flat batch")
                starts.append(s.first_row + s.num_tokens)
            meta.prefill_block_tables = _block_table([s.block_ids for s in prefills], dev)
            meta.prefill_query_starts = torch.tensor(starts, dtype=torch.int32, device=dev)
            meta.prefill_context_lens = torch.tensor([s.start + s.num_tokens for s in prefills], dtype=torch.int32,
                                                     device=dev)
        return meta


def _block_table(block_ids: list[list[int]], device) -> torch.Tensor:
    """int32 [rows, widest], each row's block ids padded with block 0 (never read: past its context)."""
    width = max(len(ids) for ids in block_ids)
    return torch.tensor([ids + [0] * (width - len(ids)) for ids in block_ids], dtype=torch.int32, device=device)
