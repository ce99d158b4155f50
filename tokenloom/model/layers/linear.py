"""Linear layers built from a few kinds, each with a per-parameter weight loader.

Merged layers (qkv, gate_up) hold several checkpoint tensors in one weight so a
single matmul computes them; their loader places each shard. Tensor
parallelism later shards along the output (column) or input (row) dimension
inside these loaders, without touching the model files.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.profiler import PROFILER


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        param = self.weight if name == "weight" else self.bias
        _copy(param.data, tensor, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with PROFILER.section("matmul"):
            return mixed_linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several output blocks (e.g. q, k, v) stacked along the output dimension."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.offsets[name] = (start, size)
            start += size

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        param = self.weight if name == "weight" else self.bias
        start, size = self.offsets[shard]
        _copy(param.data.narrow(0, start, size), tensor, f"{shard}.{name}")


def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, in the weight's dtype when it differs from x's (reduced-precision matmul weights),
    with the result and the bias addition back in x's dtype. ``weight`` may be prepacked for oneDNN."""
    if weight.is_mkldnn:
        out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "")
    elif weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    else:
        out = F.linear(x.to(weight.dtype), weight)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)
