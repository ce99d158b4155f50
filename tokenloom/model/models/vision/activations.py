"""The MLP activations vision towers name in their configs (HF's `hidden_act` spellings)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
}
