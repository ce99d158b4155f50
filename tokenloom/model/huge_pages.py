"""The quantized weights moved into one region of transparent huge pages.

A batch-1 decode step reads every weight once (94 MiB on the embedded model) and is bound by memory.
On 4 KiB pages that stream takes a TLB miss every 4 KiB, and the hardware prefetchers stop at each
page's edge; on 2 MiB pages a pass over the same weights took 0.91x the time (exact) and 0.85x (W4A8)
at 2 threads (`python -m tokenloom.bench.weight_stream`; docs/performance.md, "The batch-1 step: float16
scales, huge pages and the API process"). Linux backs an anonymous mapping advised
MADV_HUGEPAGE with huge pages when transparent huge pages are `always` or `madvise` (the usual
default); where they are `never`, or off Linux, the advice is ignored and nothing else changes.

`TOKENLOOM_HUGE_PAGES=off` keeps every weight where the loader put it.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import torch

from tokenloom.heap_trim import release_free_heap
from tokenloom.model.layers.quantized_weight import Panels, QuantizedWeight

HUGE_PAGE = 2 << 20
ALIGN = 64  # a cache line: the kernels' vector loads never straddle two
# The old copies are mostly under glibc's mmap threshold, so freeing them leaves their pages in the
# heap: handing those back every 8 MiB keeps the move's peak near one copy of the weights (+68 MiB on
# the embedded model without it).
TRIM_EVERY = 8 << 20


def enabled() -> bool:
    return (hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("TOKENLOOM_HUGE_PAGES", "on").strip().lower() not in ("off", "0", "false", "no"))


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def move_panels_to_huge_pages(weights: list[QuantizedWeight],
                              release: Callable[[torch.Tensor], None] | None = None) -> int:
    """Move each weight's interleaved panels into one huge-page region, in place (a tied weight shared
    by two layers moves once), one weight at a time: its old copy is freed as soon as the new one is in
    place, so the process never holds the weights twice. `release` hands back an old tensor's pages that
    freeing does not (a view of a mapped file: tokenloom/model/loader/panel_cache.py). Returns the bytes
    moved (0: nothing moved)."""
    unique = list({id(w): w for w in weights if w.panels is not None}.values())
    if not enabled() or not unique:
        return 0
    total = sum(_aligned(t.numel() * t.element_size()) for w in unique for t in _tensors(w.panels))
    if total < HUGE_PAGE:
        return 0
    region = mmap.mmap(-1, (total + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # its views keep the mapping alive
    offset = 0

    def place(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        nbytes = t.numel() * t.element_size()
        moved = arena[offset:offset + nbytes].view(t.dtype).view(t.shape)
        moved.copy_(t)
        offset += _aligned(nbytes)
        return moved

    since_trim = 0
    for w in unique:
        p = w.panels
        w.panels = Panels(place(p.qpacked), place(p.scales), place(p.mins), p.columns)
        if release is not None:
            for t in _tensors(p):
                release(t)
        since_trim += sum(t.numel() * t.element_size() for t in _tensors(p))
        del p
        if since_trim >= TRIM_EVERY:
            release_free_heap()
            since_trim = 0
    release_free_heap()
    return offset


def _tensors(p: Panels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return p.qpacked, p.scales, p.mins
