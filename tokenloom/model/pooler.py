"""The pooling math the worker runs: one embedding per sequence from its hidden states (the settings, and
how they are chosen, are tokenloom/model/pooling_config.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.core.pooling import PoolingConfig


def pool(hidden: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """One sequence's embedding (float32) from its hidden states [tokens, hidden]."""
    if config.method == "mean":
        out = hidden.float().mean(dim=0)
    elif config.method == "cls":
        out = hidden[0].float()
    else:
        out = hidden[-1].float()
    return F.normalize(out, dim=-1) if config.normalize else out
