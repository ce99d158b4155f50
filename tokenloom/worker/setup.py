"""What a worker's start-up phases (phases.py) produced, as one typed result: the model, the runner, the
KV cache's size and the warm-up's speed."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenloom.distributed.parallel_state import tp_group
from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.layers.quantized_linear import quantized_weights
from tokenloom.model.loader import LoadedModel
from tokenloom.worker.kv_cache import kv_bytes_per_block
from tokenloom.worker.runner import ModelRunner

logger = logging.getLogger("tokenloom.engine")


@dataclass
class WorkerSetup:
    loaded: LoadedModel
    runner: ModelRunner
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int
    warmup_decode_seconds: float = 0.0  # the warm-up's one-sequence decode step: the machine's speed at start

    @property
    def arch(self) -> ArchConfig:
        return self.loaded.arch

    @property
    def full_length_requests(self) -> int:
        return self.num_blocks * self.block_size // self.max_model_len

    @property
    def kv_release_window(self) -> int | None:
        """The sliding window, when every layer attends within it: the scheduler frees blocks behind it."""
        return self.arch.sliding_window if self.arch.all_layers_windowed else None

    @property
    def weights_quantized(self) -> bool:
        """Whether GGUF blocks stayed quantized (the native kernels multiply them), rather than dense."""
        return bool(quantized_weights(self.loaded.model))

    def summary(self) -> str:
        if getattr(self.loaded.model, "is_encoder", False):  # its KV cache is a placeholder, never written
            return f"encoder: no KV cache; inputs of up to {self.max_model_len} tokens, each embedded in one pass"
        dtype = self.runner.kv_caches[0].dtype
        kv_dtype = str(dtype).removeprefix("torch.")
        per_block = kv_bytes_per_block(self.arch, self.block_size, dtype, tp_group().size)
        total, per_token = self.num_blocks * per_block, per_block / self.block_size
        return (f"KV cache ({kv_dtype}): {self.num_blocks} blocks of {self.block_size} tokens, "
                f"{total / 2**20:,.0f} MiB ({per_token / 2**10:.1f} KiB a token); "
                f"{self.full_length_requests} requests of {self.max_model_len} tokens fit")

    def log(self) -> None:
        if tp_group().is_first:
            logger.info("attention backend: %s", self.runner.attention.name)
            logger.info(self.summary())

