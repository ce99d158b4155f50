"""One weight reordered into oneDNN's blocked layout, for CPU matmuls.

A plain ``F.linear`` on CPU lets the GEMM library repack the weight on every call; the linear methods
pack once at load time (model/prepack.py walks the model) and `mixed_linear` multiplies by the packed
weight. This sits below the layers so each layer's method can pack itself without importing them back.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("tokenloom.engine")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's layout (mixed_linear multiplies by it); unchanged if oneDNN refuses it."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except RuntimeError as exc:  # e.g. a dtype this oneDNN build cannot pack
        logger.debug("weight %s %s left unpacked: %s", tuple(weight.shape), weight.dtype, exc)
        return weight
