"""Python data to a device tensor without making the host wait, and a step's results back with one wait.

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


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The tensors on the host. On CUDA each is copied without blocking into pinned memory and one event waits
    for them all: one stall per step instead of one per `.tolist()`, and the wait releases the GIL, so under
    async scheduling the engine thread schedules the next step meanwhile. On CPU they are returned as they are."""
    if not any(t is not None and t.device.type == "cuda" for t in tensors):
        return list(tensors)
    host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors]
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host
