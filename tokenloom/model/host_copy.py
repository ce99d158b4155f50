"""Python data to a device tensor without making the host wait.

On CUDA, `torch.tensor(data, device="cuda")` copies from pageable memory, which blocks the CPU until the
copy is done; staging in pinned memory (PyTorch caches those pages) lets the copy run asynchronously on
the stream, ordered before the kernels that read it. On CPU it is the plain constructor.
"""
from __future__ import annotations

import torch


def tensor_on(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype).pin_memory().to(device, non_blocking=True)
