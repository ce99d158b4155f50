"""Attention backends: each owns its KV-cache layout and turns a step into its own metadata.

The runner hands a backend the step's sequences in flat-batch order (`ScheduledSpan`: which
rows, which positions, which blocks) and gets back whatever the backend's kernels read; the
model never looks inside. `torch` is the reference backend (plain torch, CPU and CUDA);
native CPU kernels and FlashInfer sit beside it. The worker chooses one from the config
(`attention_select.py`) and hands that instance to the model's constructor (its layers'
impls) and to the runner (the step's metadata).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.model.layers.attention import AttentionMetadata, PrefillChunk, TorchAttention, decode_group_size


@dataclass
class ScheduledSpan:
    """One sequence's share of a step: flat rows [first_row, first_row + num_tokens) compute
    positions [start, start + num_tokens) over the KV blocks `block_ids`."""

    first_row: int
    start: int
    num_tokens: int
    block_ids: list[int]


class AttentionBackend:
    name = ""

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        raise NotImplementedError

    def bind(self, kv_cache: torch.Tensor) -> None:
        """Called once the KV caches exist (layer 0's given), before the first build_metadata."""

    def another(self) -> AttentionBackend:
        """A fresh instance of this backend, to bind to another set of KV caches (a draft model's)."""
        return type(self)()

    def make_impl(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                  sliding_window: int | None = None):
        """One layer's attention. `scale` multiplies q.k (None: head_dim**-0.5); `sliding_window` W (None:
        the whole context) limits the query at position p to keys at positions p-W+1..p, as HF's
        sliding_window does. The metadata is the same for every layer: a backend derives a windowed
        layer's key range from it (the torch backend: attention.decode_window)."""
        raise NotImplementedError

    def build_metadata(self, spans: list[ScheduledSpan], slot_mapping: torch.Tensor):
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """K and V in one [2, blocks, block_size, kv_heads, head_dim] tensor per layer; decodes (one query
    each) first in the flat batch, attended in groups, then one SDPA call per prefill chunk."""

    name = "torch"

    def __init__(self):
        self.kv_cache: torch.Tensor | None = None  # layer 0's: dtype, device and block shape for the workspace
        self._workspace: torch.Tensor | None = None

    def bind(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._workspace = torch.empty(0, device=kv_cache.device, dtype=kv_cache.dtype)

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return 2, num_blocks, block_size, num_kv_heads, head_dim

    def make_impl(self, num_heads, num_kv_heads, head_dim, scale=None, sliding_window=None):
        return TorchAttention(num_heads, num_kv_heads, head_dim, scale, sliding_window)

    def build_metadata(self, spans: list[ScheduledSpan], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """`spans` must list decodes (one token) first, shortest context first, so each attention group pads
        only to its own longest."""
        cache = self.kv_cache
        dev, bs = cache.device, cache.shape[2]
        decodes = [s for s in spans if s.num_tokens == 1]
        prefills = [PrefillChunk(s.first_row, s.first_row + s.num_tokens, s.start + s.num_tokens,
                                 torch.tensor(s.block_ids, device=dev)) for s in spans if s.num_tokens > 1]
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=len(decodes), decode_block_tables=None,
                                 decode_context_lens=None, decode_mask=None, prefills=prefills)
        if not decodes:
            return meta
        lens = [s.start + 1 for s in decodes]
        width = max((n + bs - 1) // bs for n in lens)
        meta.decode_block_tables = torch.tensor([s.block_ids[:width] + [0] * (width - len(s.block_ids[:width]))
                                                 for s in decodes], dtype=torch.long, device=dev)
        context_lens = torch.tensor(lens, device=dev)
        group = decode_group_size(len(decodes), dev)
        meta.decode_workspace = self._decode_workspace(group * width)
        meta.decode_context_lens = context_lens
        meta.decode_group_blocks = [(max(lens[i:i + group]) + bs - 1) // bs for i in range(0, len(lens), group)]
        padding = torch.arange(width * bs, device=dev).unsqueeze(0) >= context_lens.unsqueeze(1)
        # Additive, in the dtype SDPA computes in: a boolean mask is converted on every call (~10%). The 8-bit
        # cache is read back as float32 (the CPU's activations).
        mask_dtype = torch.float32 if cache.dtype == torch.int8 else cache.dtype
        meta.decode_mask = torch.zeros(padding.shape, dtype=mask_dtype, device=dev).masked_fill_(
            padding, float("-inf")).view(len(decodes), 1, 1, width * bs)
        return meta

    def _decode_workspace(self, num_blocks: int) -> torch.Tensor:
        cache = self.kv_cache
        block_elems = cache[0, 0].numel()
        if self._workspace is None or self._workspace.numel() < 2 * num_blocks * block_elems:
            self._workspace = torch.empty(2 * num_blocks * block_elems, dtype=cache.dtype, device=cache.device)
        return self._workspace[: 2 * num_blocks * block_elems].view(2, num_blocks, block_elems)
