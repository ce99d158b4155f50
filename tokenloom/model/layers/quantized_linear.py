"""Linear layers whose weights stay in quantized blocks, multiplied by the native kernels.

The loader puts a `QuantizedSlot` in place of each linear layer's (and the embedding's) weight, the
parallel layers' own `load` code fills it with their shard, and `finalize_quantized` turns each slot
into a `QuantizedWeight` with `QuantizedLinearMethod` (or back into a dense parameter when a piece came
dense), kept in the column-interleaved form the kernels read fastest at any batch size. So tensor
parallelism and quantization compose: a column-parallel layer narrows rows, a row-parallel one whole blocks
of columns, the vocabulary layers rows.

Two numeric paths, chosen by `--quantized-matmul`:
- `exact` (default): float32 activations times the weight's values, scaled once a block; float32 results
  within ~1e-6 relative of the dequantized float32 model's, whatever else is in the batch.
- `w4a8`: activations quantized to int8 per 32 values (llama.cpp's scheme); faster, lossier
  (docs/performance.md has its measured accuracy).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from tokenloom.config import ConfigError
from tokenloom.model.layers.linear import Linear
from tokenloom.model.layers.linear_method import UNQUANTIZED, LinearMethod
from tokenloom.model.layers.quantized_weight import QuantizedSlot, QuantizedWeight
from tokenloom.model.layers.vocab_parallel import VocabParallelEmbedding

QUANTIZED_MATMUL_MODES = ("exact", "w4a8")


class QuantizedLinearMethod(LinearMethod):
    """The weight is a QuantizedWeight; `cast` (a reduced matmul dtype asked for) makes it dense again."""

    def cast(self, layer, dtype):
        dense = layer.weight.dequantize(dtype)
        del layer.weight
        layer.weight = nn.Parameter(dense, requires_grad=False)
        layer.method = UNQUANTIZED

    def pack(self, layer):
        return False

    def apply(self, layer, x, bias):
        return layer.weight.linear(x, bias)


QUANTIZED = QuantizedLinearMethod()


def _weight_modules(model: nn.Module) -> Iterator[tuple[str, Linear | VocabParallelEmbedding]]:
    for name, module in model.named_modules():
        if isinstance(module, (Linear, VocabParallelEmbedding)):
            yield name, module


def install_slots(model: nn.Module) -> None:
    """Replace every linear and embedding weight with an empty slot for the loader to fill."""
    for _, module in _weight_modules(model):
        shape = module.weight.shape
        del module._parameters["weight"]
        module.weight = QuantizedSlot(shape)


def finalize_quantized(model: nn.Module, dtype: torch.dtype, mode: str = "exact") -> None:
    """Each slot becomes its QuantizedWeight (the layer's method QUANTIZED) or a dense parameter."""
    for name, module in _weight_modules(model):
        slot = module.weight
        if not isinstance(slot, QuantizedSlot):
            continue
        weight = slot.finalize(f"{name}.weight")
        del module.weight
        if isinstance(weight, QuantizedWeight):
            module.weight = weight.interleaved()
            if hasattr(module, "method"):
                module.method = QUANTIZED
        else:
            module.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    set_quantized_matmul(model, mode)


def quantized_weights(model: nn.Module) -> list[QuantizedWeight]:
    return [m.weight for _, m in _weight_modules(model) if isinstance(m.weight, QuantizedWeight)]


def set_quantized_matmul(model: nn.Module, mode: str) -> int:
    """Switch every quantized weight to the `exact` or `w4a8` path; returns how many there are."""
    if mode not in QUANTIZED_MATMUL_MODES:
        raise ConfigError(f"quantized_matmul must be one of {', '.join(QUANTIZED_MATMUL_MODES)} (got {mode!r})")
    weights = quantized_weights(model)
    for w in weights:
        w.activations_int8 = mode == "w4a8"
    return len(weights)

