"""Where a live process's resident memory lies, from /proc/PID/smaps: its RSS grouped by mapping kind.

    .venv/bin/python scripts/rss_breakdown.py PID

Groups: libtorch_cpu.so (its code and data), the rest of torch's libraries, every other shared library and
the interpreter, model files mapped from disk (.gguf, .safetensors), the KV cache (a shared anonymous
mapping, shown as "/dev/zero (deleted)"; only the pages of blocks ever written are resident), glibc's [heap]
(small and mid-size allocations below malloc's mmap threshold), and unnamed private anonymous mappings
(allocations above that threshold: weights, large activations). Those two are not told apart here;
scripts/rss_phases.py attributes them by building the engine step by step.
"""
from __future__ import annotations

import sys
from collections import defaultdict

KV_CACHE = "KV cache (shared anonymous)"
GROUPS = ("libtorch_cpu.so", "other torch libraries", "python and other libraries", "model files",
          KV_CACHE, "[heap]", "anonymous mappings", "stacks and other")


def group_of(path: str) -> str:
    if path.endswith("libtorch_cpu.so"):
        return "libtorch_cpu.so"
    if "/torch/" in path:
        return "other torch libraries"
    if path == "/dev/zero (deleted)":  # mmap.mmap(-1, n): how executor/setup.py maps the KV cache on CPU
        return KV_CACHE
    if path.endswith((".gguf", ".safetensors")):
        return "model files"
    if path == "[heap]":
        return "[heap]"
    if not path:
        return "anonymous mappings"
    if path.startswith("/"):
        return "python and other libraries"
    return "stacks and other"


def breakdown(pid: int | str) -> dict[str, int]:
    """Resident KiB per group."""
    totals: dict[str, int] = defaultdict(int)
    path = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=5)
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
                path = head[5].strip() if len(head) == 6 else ""
            elif head[0] == "Rss:":
                totals[group_of(path)] += int(head[1])
    return totals


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    totals = breakdown(sys.argv[1])
    for name in GROUPS:
        print(f"  {name:28s} {totals.get(name, 0) / 1024:7.1f} MiB")
    print(f"  {'total':28s} {sum(totals.values()) / 1024:7.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
