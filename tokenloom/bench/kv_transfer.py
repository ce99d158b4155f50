"""`python -m tokenloom.bench.kv_transfer`: KV pull latency and bandwidth per block over ZMQ, TCP and IPC
side by side, between two processes as a prefill and a decode instance would be; with `--decode-step`, the
decoder's step time while a pull is in flight.

The producer process holds a KV cache of the embedded model's geometry (30 layers, 3 KV heads of 64,
float32, 16-token blocks: 737,280 bytes per block) and publishes transfers of each size; the consumer
pulls each into its own cache through one `KVPuller` (the decode instance's path: one reused socket per
producer, layers written as they arrive) and reports the median time to the first layer and to the whole
pull, per block, and the bandwidth.

`--decode-step` runs a decode instance (an EngineCore on the embedded model) with a batch of running
requests and, interleaved round by round, times: a plain decode step; the steps while a request's pull runs
in the background (the default when others compute); and the step that pulls inside itself (the behaviour
before background pulls: every running request waits for the whole transfer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.kv_connector import WorkerConnector
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine.core import EngineCore
from tokenloom.kv_transfer.blocks import layout
from tokenloom.kv_transfer.layerwise import LayerwiseCaches
from tokenloom.kv_transfer.puller import KVPuller
from tokenloom.kv_transfer.transport import KVServer, PullRequest

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 30, 16, 3, 64


def make_caches(num_blocks: int, fill: bool) -> list[torch.Tensor]:
    make = torch.randn if fill else torch.zeros
    return [make(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]


def serve(transport: str, sizes: list[int], iters: int, identity: str = "bench") -> None:
    """The producer: publish iters transfers of each size, print the address, run until stdin closes."""
    num_blocks = 2 * max(sizes)
    server = KVServer(make_caches(num_blocks, True), identity, "127.0.0.1", 0, transport)
    for n in sizes:
        for i in range(iters):
            start = (i * 7) % (num_blocks - n + 1)  # consecutive blocks, as a fresh allocation mostly is
            server.publish(f"{n}-{i}", list(range(start, start + n)), lease_s=3600)
    print(server.address, flush=True)
    sys.stdin.read()
    server.close()


def start_producer(transport: str, sizes: list[int], iters: int, identity: str = "bench"):
    child = subprocess.Popen([sys.executable, "-m", "tokenloom.bench.kv_transfer", "--serve", transport,
                              "--sizes", ",".join(map(str, sizes)), "--iters", str(iters), "--identity", identity],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return child, child.stdout.readline().strip()


def measure(transport: str, sizes: list[int], iters: int) -> list[dict]:
    child, address = start_producer(transport, sizes, iters)
    mine = make_caches(2 * max(sizes), False)
    puller = KVPuller(mine)
    try:
        block_bytes = sum(c[:, 0].numel() * c.element_size() for c in mine)
        rows = []
        for n in sizes:
            times, firsts = [], []
            for i in range(iters):
                req = PullRequest(transfer_id=f"{n}-{i}", identity="bench", layout=layout(mine), first_block=0,
                                  num_blocks=n)
                t0 = time.perf_counter()
                p = puller.start("bench", address, req, list(range(n)), timeout_s=30)
                puller.wait_layer(p, 0)
                firsts.append(time.perf_counter() - t0)
                puller.wait_layer(p, LAYERS - 1)
                times.append(time.perf_counter() - t0)
                if p.error:
                    raise RuntimeError(p.error)
                puller.take_done()
            med = statistics.median(times)
            rows.append({"transport": transport, "blocks": n, "bytes": n * block_bytes, "pull_ms": 1e3 * med,
                         "first_layer_ms": 1e3 * statistics.median(firsts),
                         "ms_per_block": 1e3 * med / n, "gb_per_s": n * block_bytes / med / 1e9})
        return rows
    finally:
        puller.close()
        child.stdin.close()
        child.wait(30)


def decode_step(blocks: int, batch: int, rounds: int) -> dict:
    """Step times of a decode instance with `batch` running requests: plain, with a background pull of `blocks`
    blocks in flight, and with that pull inside the step (the pre-background behaviour), interleaved."""
    core = EngineCore(EngineConfig.from_kwargs(splitwise_role="decode", dtype="float32", block_size=BLOCK_SIZE,
                                               log_stats_interval=0), progress=False)
    connector = core.scheduler.connector
    child, address = start_producer("tcp", [blocks], 2 * rounds, core.info.kv_connector.identity)
    vocab = core.info.vocab_size

    def add(rid: str, length: int, max_tokens: int, params: dict | None = None) -> None:
        prompt = torch.randint(100, vocab - 100, (length,)).tolist()
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, kv_transfer_params=params)
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                                           arrival_time=time.time()))

    def timed_step() -> float:
        t0 = time.perf_counter()
        core.step()
        return time.perf_counter() - t0

    plain, background, in_step, pull_s = [], [], [], []
    try:
        for i in range(batch):
            add(f"run{i}", 64, 100_000)
        while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
            core.step()
        for _ in range(3):
            core.step()
        for i in range(rounds):
            plain.append(timed_step())
            for mode in ("background", "in_step"):
                connector.load_in_background = (lambda r, others: others) if mode == "background" else (
                    lambda r, others: False)
                rid = f"{mode}{i}"
                params = {"do_remote_prefill": True, "remote_address": address, "first_token_id": 7,
                          "remote_transfer_id": f"{blocks}-{2 * i + (mode == 'in_step')}",
                          "remote_num_tokens": blocks * BLOCK_SIZE}
                add(rid, blocks * BLOCK_SIZE, 100_000, params)
                t0 = time.perf_counter()
                times = []
                while not any(r.request_id == rid for r in core.scheduler.running):
                    times.append(timed_step())
                pull_s.append(time.perf_counter() - t0) if mode == "background" else None
                (background.extend(times) if mode == "background" else in_step.extend(times))
                core.abort_requests([rid])
                core.step()
        ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
        return {"batch": batch, "blocks": blocks, "rounds": rounds, "plain_step_ms": ms(plain),
                "step_ms_with_background_pull": ms(background), "max_step_ms_with_background_pull":
                1e3 * max(background), "background_pull_ms": ms(pull_s), "in_step_pull_step_ms": ms(in_step)}
    finally:
        core.shutdown()
        child.stdin.close()
        child.wait(30)


def hook_overhead(batch: int, rounds: int) -> dict:
    """A decode step of an engine without a connector (the plain cache list) against the same step walked
    layer by layer through `LayerwiseCaches` with hooks that do nothing: the per-layer machinery's own cost,
    an upper bound on what an engine without a connector could pay (the runner's step alone, both ways)."""
    core = EngineCore(EngineConfig.from_kwargs(dtype="float32", log_stats_interval=0), progress=False)
    runner = core.executor.worker.runner
    try:
        for i in range(batch):
            prompt = torch.randint(100, core.info.vocab_size - 100, (128,)).tolist()
            sp = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
            core.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=sp,
                                               arrival_time=time.time()))
        while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
            core.step()
        plain, layered = [], []
        for _ in range(rounds):
            for times, hooks in ((plain, False), (layered, True)):
                step = core.scheduler.schedule()  # the runner's part of core.step(), timed alone
                t0 = time.perf_counter()
                runner.update_states(step)
                layers = LayerwiseCaches(runner.kv_caches, WorkerConnector()) if hooks else None
                out = runner.execute_model(step, layers)
                times.append(time.perf_counter() - t0)
                core.update(step, out)
        return {"batch": batch, "rounds": rounds, "plain_step_ms": 1e3 * statistics.median(plain),
                "layerwise_step_ms": 1e3 * statistics.median(layered),
                "ratio": statistics.median(layered) / statistics.median(plain)}
    finally:
        core.shutdown()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,64", help="blocks per pull (default 1,4,16,64)")
    p.add_argument("--iters", type=int, default=20, help="pulls per size (median reported)")
    p.add_argument("--transports", default="tcp,ipc")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--decode-step", action="store_true", help="time a decode instance's steps around a pull")
    p.add_argument("--batch", type=int, default=4, help="--decode-step: running requests (default 4)")
    p.add_argument("--blocks", type=int, default=32, help="--decode-step: blocks pulled (default 32: 512 tokens)")
    p.add_argument("--rounds", type=int, default=5, help="--decode-step: rounds of the three measurements")
    p.add_argument("--hook-overhead", action="store_true",
                   help="a decode step with the per-layer hooks (doing nothing) against the plain step")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--identity", default="bench", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.serve:
        serve(args.serve, sizes, args.iters, args.identity)
        return
    if args.hook_overhead:
        rows = [hook_overhead(args.batch, args.rounds)]
        print(json.dumps(rows[0], indent=1))
    elif args.decode_step:
        rows = [decode_step(args.blocks, args.batch, args.rounds)]
        print(json.dumps(rows[0], indent=1))
    else:
        torch.set_num_threads(1)
        rows = [row for t in args.transports.split(",") for row in measure(t, sizes, args.iters)]
        print(f"{'transport':>9} {'blocks':>6} {'MiB':>7} {'1st layer ms':>12} {'pull ms':>8} {'ms/block':>9} "
              f"{'GB/s':>6}")
        for r in rows:
            print(f"{r['transport']:>9} {r['blocks']:>6} {r['bytes'] / 2 ** 20:>7.1f} {r['first_layer_ms']:>12.2f} "
                  f"{r['pull_ms']:>8.2f} {r['ms_per_block']:>9.3f} {r['gb_per_s']:>6.2f}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
