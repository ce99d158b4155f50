"""Rotary position embeddings (rotate-half layout), with HF's rope_scaling variants."""
from __future__ import annotations

import math

import torch

from tokenloom.kernels import layer_ops
from tokenloom.model.arch_config import UnsupportedModelError
from tokenloom.model.layers.module import InferenceModule


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(InferenceModule):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling)  # the loader rebuilds the tables from them
        # Tables are computed on the CPU even while the model is built on the meta device: meta math runs
        # torch's Python reference ops, whose first use imports torch._dynamo and sympy (~2.5 s of start-up).
        inv_freq, attention_factor = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D]; rotates the two halves of the last dim (one native call for both)."""
        if layer_ops.native(q) and k.dtype == torch.float32:
            return torch.ops.tokenloom.rotary_embedding(positions, q, k, self.cos, self.sin)
        cos, sin = self._lookup(positions)
        return layer_ops.rotate_half(q, cos, sin), layer_ops.rotate_half(k, cos, sin)

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of these positions; every layer shares this module and the same positions tensor
        within one forward, so the lookup runs once per forward instead of once per layer."""
        if self._last is None or self._last[0] is not positions:
            self._last = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
        return self._last[1], self._last[2]

