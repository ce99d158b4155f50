"""What a fixed malloc mmap threshold would cost the engine's steps (why heap_trim.py trims at idle instead).

    .venv/bin/python scripts/malloc_threshold_ab.py [--rounds 3]

One engine on the embedded model; in each round, for each threshold (32 MiB: where glibc's dynamic threshold
ends after the first large frees; 1 MiB; 128 KiB: glibc's starting value), `mallopt` sets M_MMAP_THRESHOLD
(and M_TRIM_THRESHOLD to twice it), then one 1,024-token prefill and one 16-in / 32-out request are timed and
their minor page faults counted (getrusage: each is a page the kernel zeroes and maps, whatever the machine's
load), with the RSS after them. The thresholds interleave within a round, so a noisy machine hits them alike;
the minimum over rounds is printed last.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rss_phases import run_request, status_kib  # noqa: E402

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
THRESHOLDS = {"32 MiB": 32 << 20, "1 MiB": 1 << 20, "128 KiB": 128 << 10}


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    from tokenloom.config import EngineConfig
    from tokenloom.engine.core import EngineCore
    core = EngineCore(EngineConfig.from_kwargs(max_model_len=4096, kv_cache_memory=0.5, enable_prefix_caching=False))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in THRESHOLDS}
    for r in range(ns.rounds):
        for name, value in THRESHOLDS.items():
            libc.mallopt(M_MMAP_THRESHOLD, value)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * value)
            faults, start = _minor_faults(), time.perf_counter()
            run_request(core, f"prefill-{name}-{r}", 1024, 1, seed=r)
            prefill, prefill_faults = time.perf_counter() - start, _minor_faults() - faults
            faults, start = _minor_faults(), time.perf_counter()
            run_request(core, f"decode-{name}-{r}", 16, 32, seed=100 + r)
            decode, decode_faults = time.perf_counter() - start, _minor_faults() - faults
            times[name].append((prefill, decode))
            print(f"round {r} threshold {name:8s} prefill 1024: {prefill:6.2f} s, {prefill_faults:7d} faults"
                  f"  16 in / 32 out: {decode:6.2f} s, {decode_faults:7d} faults"
                  f"  RSS {status_kib('VmRSS') / 1024:6.1f} MiB", flush=True)
    for name, runs in times.items():
        print(f"threshold {name:8s} min prefill {min(a for a, _ in runs):6.2f} s  min decode "
              f"{min(b for _, b in runs):6.2f} s")
    core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
