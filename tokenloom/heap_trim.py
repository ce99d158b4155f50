"""Hand the memory that glibc's malloc holds free back to the kernel, at moments when nothing is running.

Why it is needed: torch allocates tensors with malloc. After the first large tensors are freed, glibc raises
its mmap threshold (up to 32 MiB) and its trim threshold (twice that), so later activations of a few MiB come
from the heap; when they are freed, the holes between live blocks stay resident, and so does up to 64 MiB at
the heap's top. The engine then holds memory it is not using. Measured on the embedded SmolLM2 at a 4,096-token
context (docs/performance.md, "Memory"): 5 MiB free in the heap after start-up, 8 MiB after a
225-token request, 55 MiB after a 3,900-token one; `malloc_trim(0)` returns them in 1.3-5.1 ms.

Why not smaller fixed thresholds instead (mallopt M_MMAP_THRESHOLD / MALLOC_MMAP_THRESHOLD_): every activation
above them would then be a fresh mapping, zeroed and page-faulted on each step. A 1,024-token prefill took
236,000-251,000 minor faults (~0.95 GiB of pages) with a 1 MiB or 128 KiB threshold against 18,000 with 32 MiB
(scripts/malloc_threshold_ab.py; decode steps are alike, 540); the time difference was lost in the noise of a
loaded machine. Trimming only when the engine is idle costs nothing on the steps themselves.

A no-op where the C library has no malloc_trim (musl, macOS).
"""
from __future__ import annotations

import ctypes

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim
    _malloc_trim.argtypes = [ctypes.c_size_t]
    _malloc_trim.restype = ctypes.c_int
except (OSError, AttributeError):
    _malloc_trim = None


def release_free_heap() -> bool:
    """Return malloc's free pages to the kernel (live allocations stay). True when some memory was released."""
    if _malloc_trim is None:
        return False
    return bool(_malloc_trim(0))
