"""One LoRA adapter in memory, whatever file it came from (a PEFT folder, a llama.cpp GGUF LoRA file).

A target layer's output gains scaling * (x @ A.T) @ B.T, with A [rank, in] and B [out, rank] (PEFT's
`lora_A.weight` and `lora_B.weight` layout, float32, unsharded: each tensor-parallel rank takes its own slice
when the adapter goes into a slot). Weights are keyed by (decoder layer index, target), where the target is
one of the checkpoint's projection names in `LORA_TARGETS`; a fused projection (qkv, gate_up) takes each of
its parts from its own key.

Scaling is PEFT's: lora_alpha / rank, or lora_alpha / sqrt(rank) under rsLoRA.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tensors' type only: the API process reads adapter headers without torch
    import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: missing or corrupt files, a rank over the limit, shapes that do not
    fit the base model. Its message is one line, shown as a 400 or a start-up error."""


@dataclass(frozen=True)
class LoRAWeights:
    """One target's pair: a [rank, in], b [out, rank], float32."""
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    id: int
    rank: int
    alpha: float
    use_rslora: bool = False
    weights: dict[tuple[int, str], LoRAWeights] = field(default_factory=dict)
    path: str = ""
    base_model_name: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}

    def check_rank(self, max_rank: int) -> None:
        if self.rank > max_rank:
            raise LoRAAdapterError(f"LoRA adapter {self.name!r} has rank {self.rank}, over --max-lora-rank "
                                   f"{max_rank}")

    def check_weights(self) -> None:
        """Every pair is [rank, in] x [out, rank] with the adapter's rank, on a known target."""
        for (layer, target), pair in self.weights.items():
            where = f"LoRA adapter {self.name!r}, layer {layer} {target}"
            if target not in LORA_TARGETS:
                raise LoRAAdapterError(f"{where}: unsupported target (supported: {', '.join(LORA_TARGETS)})")
            if pair.a.dim() != 2 or pair.b.dim() != 2 or pair.a.shape[0] != self.rank \
                    or pair.b.shape[1] != self.rank:
                raise LoRAAdapterError(f"{where}: A {tuple(pair.a.shape)} and B {tuple(pair.b.shape)} do not "
                                       f"match rank {self.rank}")
