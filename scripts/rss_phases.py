"""The engine's resident memory built up step by step, in one process, as `tokenloom serve` builds its engine:
what each phase adds to RSS and its peak, and where it lands (scripts/rss_breakdown.py's groups).

    .venv/bin/python scripts/rss_phases.py [--max-model-len 4096] [--long-len 3900] [--more N]
        [engine options as k=v...]

Phases: the interpreter; `import torch`; the engine's modules (what `python -m tokenloom.engine.core_proc`
imports before building); loading the weights; the KV mapping and runner; the warm-up; one request of 225
prompt tokens and 128 out (bench_vs_llamacpp.sh's shape); one of --long-len prompt tokens and 16 out; after
each request, the heap trim the engine process makes when it turns idle (tokenloom/heap_trim.py). Each
phase's peak is its own (VmHWM is reset before it through /proc/self/clear_refs). The KV cache's resident
bytes are read exactly with mincore(2) over its tensors; the weights' as the load phase's growth (their
bytes are printed beside it).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rss_breakdown import GROUPS, breakdown  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc.mallinfo2.restype = _MallInfo2


def heap_free_bytes() -> int:
    """Bytes glibc's main arena holds free (mallinfo2's fordblks): resident unless trimmed or never touched."""
    return _libc.mallinfo2().fordblks


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> None:
    """VmHWM back to the current RSS (Linux >= 4.0), so the next phase's peak is its own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_bytes(address: int, length: int) -> int:
    """Bytes of [address, address + length) backed by memory now (mincore over its whole pages)."""
    start = address - address % PAGE
    pages = (address + length - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * PAGE


class Recorder:
    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int, dict[str, int], int | None, int]] = []
        self.kv_caches: list = []
        self._before = status_kib("VmRSS")
        reset_peak()

    def mark(self, name: str) -> None:
        kv = sum(resident_bytes(t.data_ptr(), t.nbytes) for t in self.kv_caches) if self.kv_caches else None
        self.rows.append((name, status_kib("VmRSS"), status_kib("VmHWM"), breakdown(os.getpid()), kv,
                          heap_free_bytes()))
        reset_peak()

    def print(self) -> None:
        short = {"libtorch_cpu.so": "torch_cpu", "other torch libraries": "torch libs",
                 "python and other libraries": "other libs", "model files": "files", GROUPS[4]: "KV map",
                 "[heap]": "heap", "anonymous mappings": "anon", "stacks and other": "other"}
        print("MiB; 'peak' is the phase's own VmHWM; groups from /proc/self/smaps; KV by mincore; heap free by "
              "mallinfo2")
        print(f"{'phase':34s} {'RSS':>6s} {'+':>6s} {'peak':>6s} " + " ".join(f"{short[g]:>10s}" for g in GROUPS)
              + f" {'KV mincore':>10s} {'heap free':>10s}")
        prev = self._before
        for name, rss, peak, groups, kv, free in self.rows:
            cells = " ".join(f"{groups.get(g, 0) / 1024:10.1f}" for g in GROUPS)
            kv_cell = f"{kv / 2 ** 20:10.1f}" if kv is not None else f"{'':>10s}"
            print(f"{name:34s} {rss / 1024:6.1f} {(rss - prev) / 1024:+6.1f} {peak / 1024:6.1f} {cells} {kv_cell}"
                  f" {free / 2 ** 20:10.1f}")
            prev = rss


def run_request(core, request_id: str, prompt_len: int, out_len: int, seed: int) -> None:
    import random

    from tokenloom.core.messages import EngineCoreRequest
    from tokenloom.core.sampling_params import SamplingParams
    rng = random.Random(seed)
    ids = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
    core.add_request(EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                                sampling_params=params, arrival_time=time.time()))
    while core.has_unfinished_requests():
        core.step()


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--long-len", type=int, default=3900)
    p.add_argument("--more", type=int, default=0, help="then N more requests of 1,000 distinct tokens, one at a time")
    p.add_argument("options", nargs="*", help="more engine options, key=value (e.g. kv_cache_dtype=bfloat16)")
    ns = p.parse_args()
    rec = Recorder()
    rec.mark("interpreter")
    import torch  # noqa: F401
    rec.mark("import torch")
    import tokenloom.engine.core_proc  # noqa: F401 - the engine process's own imports
    from tokenloom.config import EngineConfig
    from tokenloom.heap_trim import release_free_heap
    from tokenloom.worker import kv_cache, phases, warm_up
    rec.mark("import the engine's modules")

    load_model, warm_up_forward, allocate = phases.load_model, warm_up.warm_up_forward, kv_cache.allocate_kv_cache
    loaded_bytes = []

    def timed_load(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        loaded_bytes.append(loaded.bytes)
        rec.mark(f"load weights ({loaded.bytes / 2 ** 20:.0f} MiB of tensors)")
        return loaded

    def tracked_allocate(*args, **kwargs):
        cache = allocate(*args, **kwargs)
        rec.kv_caches.append(cache)
        return cache

    def timed_warm_up(*args, **kwargs):
        rec.mark("KV mapping, runner")
        seconds = warm_up_forward(*args, **kwargs)
        rec.mark("warm-up")
        return seconds

    phases.load_model, warm_up.warm_up_forward, kv_cache.allocate_kv_cache = timed_load, timed_warm_up, tracked_allocate
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in ns.options)}
    config = EngineConfig.from_kwargs(max_model_len=ns.max_model_len, **options)
    core = tokenloom.engine.core_proc.default_core_factory(config)
    rec.mark("rest of the engine's start-up")
    for name, prompt, out, seed in (("bench", 225, 128, 1), ("long", ns.long_len, 16, 2)):
        run_request(core, name, prompt, out, seed)
        rec.mark(f"request {prompt} in / {out} out")
        start = time.perf_counter()
        release_free_heap()  # as the engine process does once idle (core_proc.py)
        rec.mark(f"  idle: heap trimmed ({(time.perf_counter() - start) * 1e3:.1f} ms)")
    for i in range(ns.more):  # distinct prompts: does the KV mapping's resident part keep growing?
        run_request(core, f"more{i}", 1000, 1, seed=3 + i)
        release_free_heap()
        rec.mark(f"+ request {i + 1} of 1000 in / 1 out")
    rec.print()
    core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
