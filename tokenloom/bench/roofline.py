"""`tokenloom bench roofline`: how close a batch-1 decode step comes to the machine's memory bandwidth.

At one sequence a decode step reads every weight once (and the KV cache up to the context) and does
little arithmetic with it, so its floor is bytes read / memory bandwidth. This bench measures both sides
on the same threads: the sustained bandwidth with a STREAM-style triad (a = b + s*c over arrays far larger
than the last-level cache; STREAM's convention of 3 arrays' bytes a pass, best of `--rounds`) and a
read-only pass (a sum), then the model's bytes a step and the engine's median batch-1 decode step
(`tokenloom bench decode`'s), and reports the bandwidth the step reaches and its fraction of the triad's.
At `--threads 1` both sides are timed on the thread's CPU clock, which keeps a loaded machine's
descheduled time out of both (the bandwidth the other processes take still counts).

Bytes a step are the loaded form's (the panel cache's header: every weight the step multiplies, the
embedding table only where the head is tied to it) plus the KV cache at the context; beside them, the same
tensors' bytes in the GGUF's own layout (what llama.cpp reads a token), so the two layouts' costs compare.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from gguf import GGUFReader

from tokenloom.bench.decode_step import decode_step_ms
from tokenloom.config import EngineConfig, add_engine_args
from tokenloom.engine.core import EngineCore
from tokenloom.kernels.kv_int8 import SCALE_BYTES
from tokenloom.model.loader import panel_cache
from tokenloom.model.model_path import resolve_model_path

ARRAY_MIB = 256  # each triad array: 8x a 32 MiB L3, so every pass streams from memory
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8": 1}


@dataclass
class Roofline:
    threads: int
    triad_gbps: float
    read_gbps: float
    weight_bytes: int       # the loaded form's bytes a decode step reads
    gguf_weight_bytes: int  # the same tensors in the GGUF's layout
    kv_bytes: int           # the KV cache at the context, all layers
    context: int
    step_ms: float
    kv_dtype: str

    @property
    def step_gbps(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.step_ms / 1e6

    @property
    def fraction(self) -> float:
        return self.step_gbps / self.triad_gbps


def _clock() -> Callable[[], float]:
    """At one thread, the thread's own CPU clock: on a loaded machine time spent descheduled does not count
    (as in tokenloom/bench/weight_stream.py); with more, wall time."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _best_seconds(fn: Callable[[], object], rounds: int) -> float:
    fn()  # first touch of the pages
    clock = _clock()
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def triad_gbps(rounds: int = 10, mib: int = ARRAY_MIB) -> float:
    """STREAM's triad on torch's threads: GB/s counting 2 arrays read and 1 written a pass."""
    n = mib * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    seconds = _best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a), rounds)
    return 3 * a.nbytes / seconds / 1e9


def read_gbps(rounds: int = 10, mib: int = 2 * ARRAY_MIB) -> float:
    """A read-only pass (a float32 sum) on torch's threads, GB/s."""
    x = torch.rand(mib * 2**20 // 4)
    return x.nbytes / _best_seconds(lambda: x.sum(), rounds) / 1e9


def weight_bytes(mapped: panel_cache.MappedPanels) -> int:
    """Bytes a decode step reads from the loaded weights: all of them, but for an untied embedding table,
    of which a step reads one row a sequence."""
    tied = mapped.arch_config.tie_word_embeddings
    total = 0
    for w in mapped.header.weights:
        if w.alias or (w.module.endswith("embed_tokens") and not tied):
            continue
        total += sum(_nbytes(t) for t in (w.qpacked, w.scales, w.mins))
    return total + sum(_nbytes(t) for t in mapped.header.parameters.values())


def _nbytes(t: panel_cache.StoredTensor) -> int:
    count = 1
    for d in t.shape:
        count *= d
    return count * torch.empty((), dtype=getattr(torch, t.dtype)).element_size()


def gguf_weight_bytes(path: str) -> int:
    """The GGUF's bytes for the same tensors (its token embedding only where it is also the head)."""
    tensors = GGUFReader(path).tensors
    has_head = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if not (has_head and t.name == "token_embd.weight"))


def kv_bytes(mapped: panel_cache.MappedPanels, context: int, dtype: str) -> int:
    arch = mapped.arch_config
    row = arch.head_dim * _DTYPE_BYTES.get(dtype, 4) + (SCALE_BYTES if dtype == "int8" else 0)
    return arch.num_layers * 2 * arch.num_kv_heads * row * context


def add_roofline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", dest="model", default=None, help="a GGUF (default: the embedded model)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed steps (default 256)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (median reported)")
    p.add_argument("--rounds", type=int, default=10, help="bandwidth passes (best reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    add_engine_args(p, model_positional=False)
    p.set_defaults(func=run_roofline)


def run_roofline(ns) -> int:
    if ns.threads:
        torch.set_num_threads(ns.threads)
    triad, read = triad_gbps(ns.rounds), read_gbps(ns.rounds)
    config = EngineConfig.from_args(ns)
    core = EngineCore(config)
    try:
        step = decode_step_ms(core, 1, ns.context, ns.steps, _clock())
        kv_dtype = core.info.kv_cache_dtype
    finally:
        core.shutdown()
    path = resolve_model_path(ns.model)
    mapped = panel_cache.MappedPanels.lookup(path, 0, 1)
    if mapped is None:
        raise SystemExit("tokenloom bench roofline: no loaded form of the model in the panel cache (a GGUF on the "
                         "native kernels, tensor-parallel size 1, TOKENLOOM_WEIGHT_CACHE not 0)")
    result = Roofline(torch.get_num_threads(), triad, read, weight_bytes(mapped), gguf_weight_bytes(path),
                      kv_bytes(mapped, ns.context, kv_dtype), ns.context, step, kv_dtype)
    print(report(result))
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump({**asdict(result), "step_gbps": result.step_gbps, "fraction": result.fraction}, f, indent=2)
    return 0


def report(r: Roofline) -> str:
    mib = 2**20
    floor_ms = (r.weight_bytes + r.kv_bytes) / r.triad_gbps / 1e6
    gguf_floor_ms = (r.gguf_weight_bytes + r.kv_bytes) / r.triad_gbps / 1e6
    return "\n".join([
        f"memory bandwidth, {r.threads} thread(s): triad {r.triad_gbps:.1f} GB/s, read-only {r.read_gbps:.1f} GB/s",
        f"bytes a decode step: weights {r.weight_bytes / mib:,.0f} MiB (the GGUF layout: "
        f"{r.gguf_weight_bytes / mib:,.0f} MiB, {r.weight_bytes / r.gguf_weight_bytes:.2f}x), "
        f"KV at context {r.context}: {r.kv_bytes / mib:,.1f} MiB",
        f"batch-1 decode step {r.step_ms:.1f} ms: {r.step_gbps:.1f} GB/s, {100 * r.fraction:.0f}% of the triad "
        f"(floor at the triad: {floor_ms:.1f} ms; with the GGUF layout's bytes: {gguf_floor_ms:.1f} ms)",
    ])
