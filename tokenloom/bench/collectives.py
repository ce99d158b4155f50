"""`tokenloom bench collectives`: all-reduce latency on this machine's torch.distributed backend, and the
alpha-beta fit the tensor-parallel cost model uses (docs/performance.md, "Tensor parallel").

Each world size runs as that many processes on 127.0.0.1 (gloo on CPU). An all-reduce of S bytes over p
ranks is modelled as alpha + 2(p-1)/p * S / beta (a ring: each rank sends and receives that share);
the fit is least squares over the measured sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm


def add_collectives_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", default="2,3", help="comma-separated process counts (default 2,3)")
    p.add_argument("--rows", default="1,8,32,128,512", help="rows of the [rows, hidden] float32 tensor reduced")
    p.add_argument("--hidden", type=int, default=576, help="row width (default 576, SmolLM2-135M's hidden size)")
    p.add_argument("--iters", type=int, default=200, help="all-reduces timed per size (median reported)")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    p.set_defaults(func=run_collectives)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_collectives(ns) -> int:
    results = {}
    sizes = [int(r) for r in ns.rows.split(",")]
    for world in tqdm([int(w) for w in ns.world_sizes.split(",")], desc="world sizes", unit="size"):
        port = _free_port()
        threads = max(1, len(os.sched_getaffinity(0)) // world)
        procs = [subprocess.Popen([sys.executable, "-m", "tokenloom.bench.collectives", "--rank", str(r),
                                   "--world", str(world), "--port", str(port), "--rows", ns.rows,
                                   "--hidden", str(ns.hidden), "--iters", str(ns.iters), "--threads", str(threads)],
                                  stdout=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            print(f"tokenloom: error: a rank of world size {world} failed", file=sys.stderr)
            return 1
        latency = json.loads(outs[0])
        nbytes = np.array([r * ns.hidden * 4 for r in sizes], dtype=float)
        ms = np.array([latency[str(r)] for r in sizes])
        share = 2 * (world - 1) / world * nbytes
        slope, alpha = np.polyfit(share, ms, 1)
        results[world] = {"latency_ms": {r: latency[str(r)] for r in sizes}, "alpha_ms": float(alpha),
                          "beta_gb_per_s": float(1 / slope / 1e6) if slope > 0 else float("inf")}
    print(f"all-reduce of [rows, {ns.hidden}] float32, median of {ns.iters} (ms):")
    print("  world " + "".join(f"{r:>9}" for r in sizes) + "   alpha (ms)  beta (GB/s)")
    for world, r in results.items():
        row = "".join(f"{r['latency_ms'][s]:9.3f}" for s in sizes)
        print(f"  {world:5} {row}   {r['alpha_ms']:10.3f}  {r['beta_gb_per_s']:11.2f}")
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _rank_main(argv: list[str]) -> int:
    """One rank: time all-reduces of each size; rank 0 prints {rows: median ms} as JSON."""
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port", "--hidden", "--iters", "--threads"):
        p.add_argument(name, type=int)
    p.add_argument("--rows")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
    medians = {}
    for rows in (int(r) for r in a.rows.split(",")):
        t = torch.randn(rows, a.hidden)
        for _ in range(10):
            dist.all_reduce(t)
        times = []
        for _ in range(a.iters):
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        medians[rows] = 1e3 * sorted(times)[len(times) // 2]
    if a.rank == 0:
        print(json.dumps(medians))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
