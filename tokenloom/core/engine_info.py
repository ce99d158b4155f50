"""What the API server learns about an EngineCore once it is built (sent once, in `ipc.Ready`).

The EngineCore process fills it from its workers' `WorkerInfo` (engine/core_proc.py `engine_info`); the
frontend decodes it straight into these structs, so the pooling config, the KV cache's shape and the
resolved context length arrive typed and nobody rebuilds them from a dict.
"""
from __future__ import annotations

import msgspec

from tokenloom.core.pooling import PoolingConfig


class KVCacheInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The KV cache one engine allocated (per rank: every rank holds the same number of blocks)."""

    num_blocks: int
    block_size: int
    dtype: str
    full_length_requests: int  # requests of max_model_len tokens that fit at once


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    max_model_len: int  # resolved by the engine (the model's, the config's, or what the KV cache allows)
    eos_token_ids: list[int]
    device: str
    dtype: str
    tensor_parallel_size: int
    kv_cache: KVCacheInfo
    warmup_decode_seconds: float = 0.0  # the warm-up's one-sequence decode step (admission's first speed guess)
    pooling: PoolingConfig | None = None  # set: an embedding engine (serves /v1/embeddings, not generation)
    data_parallel_size: int = 1  # engine replicas behind the frontend (set by the data-parallel client)
    weights_quantized: bool = False  # GGUF blocks kept quantized for the native kernels (else dense)
    weights_bytes: int = 0  # the weights' memory as loaded (one rank's share)
