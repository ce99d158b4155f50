"""Fused per-layer ops (csrc/norm.cpp, rotary.cpp, activation.cpp): their torch references and fakes.

The references are the model's torch path itself (tokenloom/model/layers/norm.py, rotary.py, mlp.py call
them when the native ops are off), so a kernel test against a reference is a test against the engine's
own fallback. Each native op replaces several torch calls a layer, whose dispatch overhead dominated a
batch-1 decode step (see docs/performance.md, "Fused layer ops"):

- `rms_norm(x, weight, eps)`: weight * (x * rsqrt(mean(x^2) + eps)), in float32.
- `add_rms_norm(x, residual, weight, eps)` -> (rms_norm(x + residual), x + residual): the residual add
  fused with the next norm, as every decoder layer boundary does.
- `rotary_embedding(positions, q, k, cos, sin)` -> (q, k) rotated (rotate-half layout), q and k in one call.
- `silu_and_mul(x)`: silu(gate) * up for x = [gate | up].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom import kernels


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, as in the HF reference implementations."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return rms_norm_reference(total, weight, eps), total


def rotary_embedding_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D]; cos, sin: [max_positions, D/2]."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return rotate_half(q, c, s), rotate_half(k, c, s)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def native(x: torch.Tensor) -> bool:
    """Whether the native op serves this tensor: kernels loaded, a float32 tensor on the CPU."""
    return x.dtype == torch.float32 and x.is_cpu and kernels.enabled()


def _register_fakes() -> None:
    @torch.library.register_fake("tokenloom::rms_norm")
    def _rms_norm(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("tokenloom::add_rms_norm")
    def _add_rms_norm(x, residual, weight, eps):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake("tokenloom::rotary_embedding")
    def _rotary(positions, q, k, cos, sin):
        return q.new_empty(q.shape), k.new_empty(k.shape)

    @torch.library.register_fake("tokenloom::silu_and_mul")
    def _silu_and_mul(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


if kernels.load():
    _register_fakes()
