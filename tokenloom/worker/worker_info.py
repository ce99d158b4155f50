"""What a started worker tells the EngineCore: the model's shape and the KV cache it allocated."""
from __future__ import annotations

import msgspec

from tokenloom.core.kv_metadata import KVWorkerInfo
from tokenloom.core.pooling import PoolingConfig


class WorkerInfo(msgspec.Struct, kw_only=True):
    model_path: str
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    kv_cache_dtype: str
    num_blocks: int  # per rank; every rank holds the same number
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    summary: str  # one line for the log: the KV cache and how many full-length requests fit
    warmup_decode_seconds: float = 0.0  # the warm-up's one-sequence decode step (admission's first speed guess)
    pooling: PoolingConfig | None = None  # set: an embedding engine (pooled hidden states, no generation)
    # The sliding window every layer attends within (blocks behind it are freed); None: some layer reads all.
    kv_release_window: int | None = None
    kv_connector: KVWorkerInfo | None = None  # the worker half of a KV connector, when one is configured
    # LoRA (--enable-lora): each target projection's unsharded (in, out), and the decoder's layer count, against
    # which the EngineCore checks an adapter before any request uses it.
    lora_target_shapes: dict[str, tuple[int, int]] = {}
    num_layers: int = 0

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks * self.block_size // self.max_model_len
