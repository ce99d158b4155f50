"""The MLP activations vision towers and projectors name in their configs (HF's `hidden_act` and
`projector_hidden_act` spellings)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloom.config import ConfigError


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names, a `ConfigError` for one no tower here computes."""
    if name not in VISION_ACTIVATIONS:
        raise ConfigError(f"unsupported activation {name!r} (supported: {', '.join(VISION_ACTIVATIONS)})")
    return VISION_ACTIVATIONS[name]
