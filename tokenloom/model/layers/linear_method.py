"""How a linear layer stores its weight and multiplies by it, apart from how the layer is sharded.

Parallel layers (linear.py) decide which slice of a checkpoint tensor a rank holds; the
method decides the weight's form after loading (dtype, packed layout, quantized
blocks: quantized_linear.py) and does the math. Each layer holds its method, so a row-parallel layer with a
quantized weight is the two composed, with no class for every pair.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.model.layers.onednn_layout import pack_weight


class LinearMethod:
    """The interface: `cast` and `pack` run once after loading; `apply` on every forward."""

    def cast(self, layer: torch.nn.Module, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def pack(self, layer: torch.nn.Module) -> bool:
        """Reorder the weight for the fastest kernel; False when it stays as it is."""
        return False

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight in the model dtype or a reduced matmul dtype, optionally prepacked for oneDNN."""

    def cast(self, layer, dtype):
        layer.weight = torch.nn.Parameter(layer.weight.data.to(dtype), requires_grad=False)

    def pack(self, layer):
        if layer.weight.is_mkldnn:
            return False
        layer.weight = torch.nn.Parameter(pack_weight(layer.weight.data), requires_grad=False)
        return layer.weight.is_mkldnn

    def apply(self, layer, x, bias):
        return mixed_linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


def mixed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, in the weight's dtype when it differs from x's (reduced-precision matmul weights),
    with the result and the bias addition back in x's dtype. ``weight`` may be prepacked for oneDNN, or a
    QuantizedWeight (the native kernels multiply it; tokenloom/model/layers/quantized_linear.py)."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    if weight.is_mkldnn:
        out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, None, "none", [], "")
    elif weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    else:
        out = F.linear(x.to(weight.dtype), weight)
    out = out.to(x.dtype)
    return out if bias is None else out.add_(bias)
