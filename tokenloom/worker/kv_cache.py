"""A rank's KV cache: how many blocks the measured memory holds, how long a request may grow in them, and
the per-layer tensors. The block pool that hands the blocks out lives in the EngineCore."""
from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch

from tokenloom.config import ConfigError, EngineConfig
from tokenloom.distributed.parallel_state import all_reduce_min, tp_group
from tokenloom.kernels.kv_int8 import row_width
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.attention_backend import AttentionBackend

logger = logging.getLogger("tokenloom.engine")


@dataclass
class KVCache:
    caches: list[torch.Tensor]  # one per layer, in the attention backend's layout
    num_blocks: int  # blocks the pool hands out (with CUDA graphs the caches hold one more: the scratch block)
    block_size: int
    max_model_len: int


def kv_heads_per_rank(arch: ArchConfig, tp_size: int) -> int:
    """KV heads a rank stores: its share, or one replicated head when there are more ranks than heads."""
    return max(1, arch.num_kv_heads // tp_size)


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one block over all layers; an int8 row carries its scale (kv_int8.py)."""
    row = row_width(arch.head_dim, dtype) * dtype.itemsize
    return 2 * arch.num_layers * block_size * kv_heads_per_rank(arch, tp_size) * row


def count_blocks(config: EngineConfig, arch: ArchConfig, dtype: torch.dtype, budget_bytes: int | None,
                 draft: ArchConfig | None = None) -> int:
    """Blocks in `budget_bytes` (this rank's KV budget; None when --num-blocks fixes the count). A draft
    model's cache has one block per target block, so its bytes count in every block."""
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    per_block = kv_bytes_per_block(arch, config.cache.block_size, dtype, tp_group().size)
    if draft is not None:
        per_block += kv_bytes_per_block(draft, config.cache.block_size, dtype)
    return max(budget_bytes // per_block, 2)


def max_model_len(config: EngineConfig, arch: ArchConfig, capacity: int, trained: int | None) -> int:
    """The longest request: the model's context (or --max-model-len), the sentence model's trained length for
    embeddings, clamped to the cache's `capacity` in tokens unless a sliding window keeps requests small."""
    asked = config.model.max_model_len
    if asked and asked > arch.max_position_embeddings:
        raise ConfigError(f"max_model_len {asked} is longer than the model's context "
                          f"({arch.max_position_embeddings})")
    length = min(arch.max_position_embeddings, asked or arch.max_position_embeddings)
    if trained and trained < length and not asked:
        length = trained
    # A windowed model frees blocks behind the window: a request holds its window and one step's tokens.
    window = arch.sliding_window if arch.all_layers_windowed else None
    block_size = config.cache.block_size
    window_fits = window is not None and window + config.scheduler.max_num_batched_tokens + 2 * block_size <= capacity
    if length > capacity and not window_fits:
        logger.warning("max_model_len clamped from %d to %d: the KV cache holds only %d tokens "
                       "(raise --kv-cache-memory or --num-blocks)", length, capacity, capacity)
        length = capacity
    return length


def size_kv_cache(config: EngineConfig, arch: ArchConfig, attention: AttentionBackend, kv_dtype: torch.dtype,
                  device: torch.device, budget_bytes: int | None, draft: ArchConfig | None, scratch_block: bool,
                  encoder: bool, trained_len: int | None) -> KVCache:
    """Every rank holds as many blocks as the smallest budget allows; `scratch_block`: one more for CUDA
    graphs' padding rows. An encoder's caches are views of one element (never read nor written)."""
    num_blocks = all_reduce_min(count_blocks(config, arch, kv_dtype, budget_bytes, draft))
    block_size = config.cache.block_size
    shape = attention.kv_cache_shape(num_blocks + scratch_block, block_size, kv_heads_per_rank(arch, tp_group().size),
                                     row_width(arch.head_dim, kv_dtype))
    if encoder:
        caches = [torch.zeros((), dtype=kv_dtype, device=device).expand(shape) for _ in range(arch.num_layers)]
    else:
        caches = [allocate_kv_cache(shape, kv_dtype, device) for _ in range(arch.num_layers)]
    return KVCache(caches, num_blocks, block_size, max_model_len(config, arch, num_blocks * block_size, trained_len))


def allocate_kv_cache(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's KV cache, zero-filled. On CPU it is a fresh anonymous mapping: it reads as zeros and the
    kernel backs a page with memory only when a block on it is first written, so start-up does not fault in
    (and the process does not hold) the whole budget. torch.zeros wrote every page: ~0.5 s and its full size in
    RSS for the default 2 GiB, before the first request (docs/performance.md)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)  # the tensor keeps the mapping alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
