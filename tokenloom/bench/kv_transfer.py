"""`python -m tokenloom.bench.kv_transfer`: KV pull latency and bandwidth per block over ZMQ, TCP and IPC
side by side, between two processes as a prefill and a decode instance would be.

The producer process holds a KV cache of the embedded model's geometry (30 layers, 3 KV heads of 64,
float32, 16-token blocks: 737,280 bytes per block) and publishes transfers of each size; the consumer
pulls each into its own cache (`tokenloom.kv_transfer.transport.pull`, the path a decode instance takes)
and reports the median time per pull, per block, and the bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.puller import pull
from tokenloom.kv_transfer.transport import KVServer, PullRequest

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 30, 16, 3, 64


def make_caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    make = torch.randn if fill else torch.zeros
    return [make(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]


def serve(transport: str, sizes: list[int], iters: int) -> None:
    """The producer: publish iters transfers of each size, print the address, run until stdin closes."""
    num_blocks = 2 * max(sizes)
    server = KVServer(make_caches(num_blocks, True), "bench", "127.0.0.1", 0, transport)
    for n in sizes:
        for i in range(iters):
            start = (i * 7) % (num_blocks - n + 1)  # consecutive blocks, as a fresh allocation mostly is
            server.publish(f"{n}-{i}", list(range(start, start + n)), lease_s=3600)
    print(server.address, flush=True)
    sys.stdin.read()
    server.close()


def measure(transport: str, sizes: list[int], iters: int) -> list[dict]:
    child = subprocess.Popen([sys.executable, "-m", "tokenloom.bench.kv_transfer", "--serve", transport,
                              "--sizes", ",".join(map(str, sizes)), "--iters", str(iters)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = child.stdout.readline().strip()
        mine = make_caches(2 * max(sizes), False)
        block_bytes = sum(c[:, 0].numel() * c.element_size() for c in mine)
        rows = []
        for n in sizes:
            times = []
            for i in range(iters):
                req = PullRequest(transfer_id=f"{n}-{i}", identity="bench", layout=layout(mine), first_block=0,
                                  num_blocks=n)
                t0 = time.perf_counter()
                error = pull(address, req, mine, list(range(n)), timeout_s=30)
                times.append(time.perf_counter() - t0)
                if error:
                    raise RuntimeError(error)
            med = statistics.median(times)
            rows.append({"transport": transport, "blocks": n, "bytes": n * block_bytes, "pull_ms": 1e3 * med,
                         "ms_per_block": 1e3 * med / n, "gb_per_s": n * block_bytes / med / 1e9})
        return rows
    finally:
        child.stdin.close()
        child.wait(30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,64", help="blocks per pull (default 1,4,16,64)")
    p.add_argument("--iters", type=int, default=20, help="pulls per size (median reported)")
    p.add_argument("--transports", default="tcp,ipc")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.serve:
        serve(args.serve, sizes, args.iters)
        return
    torch.set_num_threads(1)
    rows = [row for t in args.transports.split(",") for row in measure(t, sizes, args.iters)]
    print(f"{'transport':>9} {'blocks':>6} {'MiB':>7} {'pull ms':>8} {'ms/block':>9} {'GB/s':>6}")
    for r in rows:
        print(f"{r['transport']:>9} {r['blocks']:>6} {r['bytes'] / 2 ** 20:>7.1f} {r['pull_ms']:>8.2f} "
              f"{r['ms_per_block']:>9.3f} {r['gb_per_s']:>6.2f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
