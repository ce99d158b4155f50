"""Refuse a model whose weights cannot fit in this machine's memory, before anything is read.

Without the check, loading a model larger than memory maps and pages in gigabytes for minutes before the
kernel's out-of-memory killer ends the process with no message. The weights file is a lower bound of what
the loaded model holds (the loaded form of quantized blocks is larger, tokenloom/model/loader/panel_cache.py),
and the machine's memory is the smaller of its physical memory and the process's cgroup limit.
"""
from __future__ import annotations

import os

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


class ModelTooLargeError(ValueError):
    pass


def machine_memory() -> int | None:
    """Bytes of memory this process may use (None where it cannot be read)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for limit_file in _CGROUP_LIMITS:
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def weights_bytes(path: str) -> int:
    """The model's weight files' bytes: a GGUF, or a folder's safetensors/bin files."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(e.stat().st_size for e in os.scandir(path) if e.name.endswith((".safetensors", ".bin", ".gguf")))


def check_fits(path: str) -> None:
    memory = machine_memory()
    size = weights_bytes(path)
    if memory is not None and size > memory:
        raise ModelTooLargeError(f"{path}: its weights take {_size(size)}, more than this machine's "
                                 f"{_size(memory)} of memory")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
