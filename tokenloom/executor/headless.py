"""A node other than 0: it starts its own ranks, which join node 0's group, and waits for them.

The EngineCore and the API server run on node 0 only; its rank 0 forwards every step to
these ranks over torch.distributed, so this node needs no port of its own.
"""
from __future__ import annotations

import sys

from tokenloom.config import EngineConfig
from tokenloom.worker.worker_proc import start_workers


def run_headless(config: EngineConfig) -> int:
    parallel = config.parallel
    ranks = parallel.local_ranks
    print(f"tokenloom: node {parallel.node_rank} of {parallel.nnodes} runs ranks {ranks.start}-{ranks.stop - 1}, "
          f"meeting node 0 at {parallel.master_addr}:{parallel.rendezvous_port}", file=sys.stderr, flush=True)
    procs = start_workers(config, parallel.rendezvous_port, progress=False)
    codes = [proc.wait() for proc in procs.values()]
    return max(codes, key=abs)
