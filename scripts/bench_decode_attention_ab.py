"""`paged_attention_decode` of a base git ref against the working tree's, interleaved in one process.

Both versions of csrc/attention.cpp are compiled alone (with vec_math.h), each into its own op namespace,
so the two kernels run side by side on the same inputs: SmolLM2-135M's heads (9 query heads over 3 KV
heads of 64), blocks of 16 handed out shuffled, and one cache per layer (30 layers, as a decode step
walks them) so the K/V come from memory as they do in the engine rather than from the 32 MB L3.

Per case: median microseconds a call over rounds in which A and B take turns, their ratio, and whether
the two outputs agree (max abs difference). `--cpu-time` times with process_time (CPU seconds of this
process, summed over its threads), steadier than wall time when other jobs load the machine; `--threads 1`
takes the thread pool's barriers out of the figure.

Usage: .venv/bin/python scripts/bench_decode_attention_ab.py [--base main] [--rounds 40] [--cpu-time] [--threads N]
       [--layers N] [--isa avx512|avx2] [--cases 32:285:bf16,32:285:f32,1:256:f32,1:4000:f32]
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from tokenloom.kernels.build import COMMON_FLAGS, FLAGS, put_venv_ninja_on_path

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
REPO = Path(__file__).resolve().parent.parent
CSRC = "tokenloom/kernels/csrc"


def _sources(ref: str | None) -> dict[str, str]:
    """attention.cpp and vec_math.h at `ref`, or in the working tree when ref is None."""
    out = {}
    for name in ("attention.cpp", "vec_math.h"):
        if ref is None:
            out[name] = (REPO / CSRC / name).read_text()
        else:
            out[name] = subprocess.run(["git", "show", f"{ref}:{CSRC}/{name}"], cwd=REPO, check=True,
                                       capture_output=True, text=True).stdout
    return out


def _build(ref: str | None, isa: str) -> str:
    """Compile one version into namespace tokenloom_ab_<hash>; returns the namespace."""
    src = _sources(ref)
    digest = hashlib.sha256((isa + src["attention.cpp"] + src["vec_math.h"]).encode()).hexdigest()[:12]
    ns = f"tokenloom_ab_{digest}"
    cpp = re.sub(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(tokenloom,", rf"TORCH_LIBRARY_\1({ns},", src["attention.cpp"])
    directory = Path(tempfile.gettempdir()) / "tokenloom_ab" / ns
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "attention.cpp").write_text(cpp)
    (directory / "vec_math.h").write_text(src["vec_math.h"])
    put_venv_ninja_on_path()
    lib = load(name=ns, sources=[str(directory / "attention.cpp")], extra_cflags=FLAGS[isa] + COMMON_FLAGS,
               extra_ldflags=["-fopenmp"], extra_include_paths=[str(directory)], build_directory=str(directory),
               is_python_module=False)
    del lib
    return ns


def _case(batch: int, context: int, dtype: torch.dtype, seed: int = 0, max_layers: int = LAYERS):
    """q, one shuffled-block cache per layer, block tables and contexts spread +-5% around `context`."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.clamp(context + torch.randint(-context // 20, context // 20 + 1, (batch,), generator=g), min=1)
    width = (int(lens.max()) + BLOCK - 1) // BLOCK
    num_blocks = batch * width
    layers = max(1, min(max_layers, (256 << 20) // (2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize)))
    caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(layers)]
    tables = torch.randperm(num_blocks, generator=g).view(batch, width).int()
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    kv_bytes = int(lens.sum()) * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    return q, caches, tables, lens.int(), kv_bytes


def _clock(cpu_time: bool):
    return time.process_time if cpu_time else time.perf_counter


def _compare(ops: dict, batch: int, context: int, dtype: torch.dtype, rounds: int, cpu_time: bool, layers: int):
    q, caches, tables, lens, kv_bytes = _case(batch, context, dtype, max_layers=layers)
    scale = HEAD_DIM ** -0.5
    outs = {name: op(q, caches[0], tables, lens, scale, 0) for name, op in ops.items()}
    a, b = outs.values()
    diff = float((a - b).abs().max())
    calls = len(caches)  # one walk over the layers a round
    clock = _clock(cpu_time)
    times = {name: [] for name in ops}
    for r in range(rounds):
        order = list(ops.items()) if r % 2 == 0 else list(reversed(ops.items()))
        for name, op in order:
            start = clock()
            for i in range(calls):
                op(q, caches[i % len(caches)], tables, lens, scale, 0)
            times[name].append((clock() - start) / calls)
    med = {name: 1e6 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return med, diff, kv_bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="main", help="git ref of the A side (B: the working tree)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--cpu-time", action="store_true")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="caches walked in turn (1: the K/V stay in the L3 cache between calls, the compute alone)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--isa", default="avx512", choices=sorted(FLAGS))
    p.add_argument("--cases", default="32:285:bf16,32:285:f32,1:256:f32,1:4000:f32")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ns_a, ns_b = _build(args.base, args.isa), _build(None, args.isa)
    ops = {"A": getattr(getattr(torch.ops, ns_a), "paged_attention_decode"),
           "B": getattr(getattr(torch.ops, ns_b), "paged_attention_decode")}
    unit = "CPU us (process_time)" if args.cpu_time else "wall us"
    print(f"A = {args.base}, B = working tree; ISA {args.isa}, {torch.get_num_threads()} threads, up to "
          f"{args.layers} caches; median {unit} a call")
    for spec in args.cases.split(","):
        batch, context, dt = spec.split(":")
        dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dt]
        med, diff, kv_bytes = _compare(ops, int(batch), int(context), dtype, args.rounds, args.cpu_time, args.layers)
        gbs = kv_bytes / (med["B"] * 1e-6) / 1e9
        print(f"batch {batch:>2} context {context:>5} {dt:<4}: A {med['A']:9.1f}  B {med['B']:9.1f}  "
              f"A/B {med['A'] / med['B']:5.2f}x  (B reads {kv_bytes / 1e6:.2f} MB at {gbs:5.1f} GB/s; "
              f"max |A-B| {diff:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
