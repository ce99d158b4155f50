"""Which of the two native builds this CPU can run, read from its flags in /proc/cpuinfo.

"avx512": AVX512F/BW/VL with VNNI (vpdpbusd, the int8 dot product the W4A8 path uses) and,
when present, BF16. "avx2": AVX2 with FMA (and F16C), the Zen 3 class of these machines.
Anything less gets no native build: the torch path runs instead.
"""
from __future__ import annotations

import functools

AVX512_REQUIRED = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
AVX2_REQUIRED = ("avx2", "fma", "f16c")
ISAS = ("avx512", "avx2")  # best first


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The ISAs this CPU runs, best first (an AVX512 machine also runs the AVX2 build)."""
    flags = cpu_flags() if flags is None else flags
    found = []
    if all(f in flags for f in AVX512_REQUIRED) and all(f in flags for f in AVX2_REQUIRED):
        found.append("avx512")
    if all(f in flags for f in AVX2_REQUIRED):
        found.append("avx2")
    return found


@functools.cache
def best_isa() -> str | None:
    isas = supported_isas()
    return isas[0] if isas else None
