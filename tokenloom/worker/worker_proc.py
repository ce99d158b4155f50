"""A worker process: one rank, started by the `mp` executor (or by a node that only runs workers).

``python -m tokenloom.worker.worker_proc --rank R --master-port P [--input A --output B]`` with
the engine config (msgspec JSON) on stdin. Rank 0 receives each message from the EngineCore over
ZMQ, forwards its bytes to the other ranks with a torch.distributed broadcast (so ranks on other
machines need no socket of their own), and alone answers. Every rank runs the same forward.

A step that raises on rank 0 is logged and answered; the worker lives on, so the EngineCore can
isolate the request that caused it. Another rank goes on only after an error that every rank
meets before any collective (bad inputs); after any other error it has left its peers mid-step
and cannot rejoin them, so it exits and the EngineCore reports a lost worker. A worker whose parent dies is killed
with it (PR_SET_PDEATHSIG), so no rank outlives its engine.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import traceback

import msgspec
import torch
import zmq

from tokenloom.config import EngineConfig
from tokenloom.core.process import set_parent_death_signal
from tokenloom.distributed.parallel_state import broadcast_bytes
from tokenloom.worker import messages
from tokenloom.worker.worker import Worker

logger = logging.getLogger("tokenloom.engine")


def threads_per_rank(local_ranks: int) -> int:
    """Threads each of this machine's ranks computes with: --threads (OMP_NUM_THREADS) when set, else the
    cores shared out among the ranks, so they do not oversubscribe them."""
    chosen = os.environ.get("OMP_NUM_THREADS", "")
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    return max(1, len(os.sched_getaffinity(0)) // local_ranks)


def start_workers(config: EngineConfig, master_port: int, input_addr: str | None = None,
                  output_addr: str | None = None, progress: bool = True) -> dict[int, subprocess.Popen]:
    """Start this node's ranks; rank 0 (on node 0) talks to the EngineCore at input_addr/output_addr."""
    parallel = config.parallel
    payload = msgspec.json.encode(config)
    threads = threads_per_rank(parallel.ranks_per_node)
    procs = {}
    for rank in parallel.local_ranks:
        cmd = [sys.executable, "-m", "tokenloom.worker.worker_proc", "--rank", str(rank),
               "--master-port", str(master_port), "--parent-pid", str(os.getpid()), "--threads", str(threads)]
        if rank == 0:
            cmd += ["--input", input_addr, "--output", output_addr]
        if not progress:
            cmd.append("--no-progress")
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        proc.stdin.write(payload)
        proc.stdin.close()
        procs[rank] = proc
    return procs


def serve_steps(worker: Worker, receive, reply) -> None:
    """The step loop of every rank: `receive` gives rank 0 the next message (others get None)."""
    while True:
        msg = messages.decode_input(broadcast_bytes(receive()))
        if isinstance(msg, messages.Shutdown):
            return
        if isinstance(msg, messages.CallWorkers):
            reply(call_worker(worker, msg))
            continue
        try:
            out = worker.execute_model(msg.step)
        except Exception as e:  # noqa: BLE001 - the EngineCore decides whose fault it was
            logger.error("rank %d: step failed:\n%s", worker.rank, traceback.format_exc())
            if worker.rank != 0 and not getattr(e, "before_collectives", False):
                raise
            reply(messages.StepFailed(error=str(e), kind=type(e).__name__))
        else:
            reply(messages.StepDone(output=out))


def call_worker(worker: Worker, msg: messages.CallWorkers) -> messages.CallDone | messages.CallFailed:
    """One of `messages.WORKER_METHODS` on this rank. A failure is reported, not raised: every rank runs the
    same call on the same state, so they fail alike and stay in step."""
    try:
        if msg.method not in messages.WORKER_METHODS:
            raise ValueError(f"unknown worker method {msg.method!r}")
        getattr(worker, msg.method)(*msg.args)
    except Exception as e:  # noqa: BLE001 - the engine turns it into the caller's error
        logger.error("rank %d: %s failed: %s", worker.rank, msg.method, e)
        return messages.CallFailed(error=str(e), kind=type(e).__name__)
    return messages.CallDone()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tokenloom worker process (started by the engine)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--input")
    p.add_argument("--output")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    set_parent_death_signal()
    if os.getppid() != args.parent_pid:
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when workers stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=os.environ.get("TOKENLOOM_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s [rank {args.rank}] %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)

    first = args.rank == 0
    ctx = zmq.Context()
    inbox = outbox = None
    if first:
        inbox = ctx.socket(zmq.PULL)
        inbox.connect(args.input)
        outbox = ctx.socket(zmq.PUSH)
        outbox.setsockopt(zmq.LINGER, 2000)
        outbox.connect(args.output)

    def reply(msg) -> None:
        if first:
            outbox.send(messages.encode(msg))

    worker = Worker(config, rank=args.rank, master_port=args.master_port, progress=not args.no_progress)
    try:
        info = worker.load()
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the engine
        logger.error("rank %d: start-up failed:\n%s", args.rank, traceback.format_exc())
        reply(messages.StartupFailed(error=f"{type(e).__name__}: {e}"))
        return 1
    reply(messages.WorkerReady(info=info))
    try:
        serve_steps(worker, (lambda: inbox.recv()) if first else (lambda: None), reply)
    except Exception:  # noqa: BLE001 - out of step with its peers: leave at once, without a goodbye
        os._exit(1)
    finally:
        worker.shutdown()
        for sock in (inbox, outbox):
            if sock is not None:
                sock.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
