"""Weights that are already in memory, named as in a Hugging Face checkpoint: what a trainer sends.

A weight update received over torch.distributed (or passed to `LLM.update_weights`) loads through the same
path as a file (`load_model(..., source=TensorSource(...))`): each rank shards the whole tensors it got, as
it does a checkpoint's. The architecture is the serving model's own: an update changes values, not shapes.
The weights load dense in the engine's dtype; a GGUF model served quantized is served dense after it.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenloom.model.arch_config import ArchConfig


class TensorSource:
    def __init__(self, arch_config: ArchConfig, tensors: dict[str, torch.Tensor]):
        self.arch_config = arch_config
        self.named = tensors

    @property
    def num_tensors(self) -> int:
        return len(self.named)

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.named.items():
            yield name, tensor.to(dtype)
