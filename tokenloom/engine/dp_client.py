"""Data parallel: several EngineCore processes (replicas) behind one frontend.

`DPEngineClient` looks like one `EngineCoreClient` to `AsyncLLM` (start, add_request,
abort_requests, call_utility, stats, shutdown) and owns N of them, one per replica:

* `add_request` picks a replica (`ReplicaRouter`): the one a request is pinned to with
  `data_parallel_rank`, else the replica that already holds its prefix unless that one is
  much busier than the least loaded, else the least loaded (`load_score`; replicas that tie,
  as idle ones do, take their turns: core/turns.py);
* it remembers which replica owns each open request, so an abort reaches that replica only;
* one replica's death fails that replica's requests only (`on_replica_dead(rank, reason,
  request_ids)`); the others keep serving. Only when every replica is dead does the whole
  engine count as dead (`on_dead`, the single-engine path: restart all or exit);
* `restart_replica(rank)` replaces one dead replica by a fresh process.

Each replica is a complete engine (its own KV cache, prefix cache and, with TP, its own worker
group on its own free rendezvous port), so replicas share nothing but the frontend.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from typing import Callable

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.core.engine_info import EngineInfo
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.stats import EngineStats, sum_stats
from tokenloom.core.turns import Turns
from tokenloom.engine import ipc
from tokenloom.engine.core_client import EngineCoreClient, EngineDeadError

logger = logging.getLogger("tokenloom.engine")

# Load score = requests in flight on the replica (the frontend's own count: exact and immediate, where
# the engine's counts arrive only with its next step or heartbeat) + WAITING_WEIGHT x requests the
# engine reports waiting (a queue means its batch is full, so a waiting request delays every later
# one) + KV_USAGE_WEIGHT x KV-cache usage (0..1; a nearly full cache preempts and recomputes).
# vLLM scores max(in flight, waiting + running) with a penalty on KV usage above half; these weights
# say the same in one sum: a full queue of 1 counts as 2 requests, a full KV cache as 4.
WAITING_WEIGHT = 1.0
KV_USAGE_WEIGHT = 4.0
# Prefix affinity yields to load when the prefix holder's score exceeds the least loaded replica's by
# more than this many requests AND by AFFINITY_REL_SLACK times (SGLang's router uses an absolute and a
# relative threshold the same way). A prefix hit saves its prompt's prefill (on CPU ~1 ms per token,
# docs/performance.md) while each request ahead in the batch costs a share of every step, so a few extra
# requests are worth one long shared prefix; a replica twice as busy is not.
AFFINITY_ABS_SLACK = 4.0
AFFINITY_REL_SLACK = 2.0
# Prefix blocks remembered (hash -> replica), least recently used first out: 64k blocks x 16 tokens
# cover a million prompt tokens in ~10 MB, more than the replicas' KV caches hold here.
MAX_PREFIX_ENTRIES = 65536
# Only a prompt's first blocks are hashed: long enough to tell shared system prompts and documents
# apart, short enough that routing stays O(1) per request.
MAX_PREFIX_BLOCKS = 64


def load_score(inflight: int, stats: EngineStats) -> float:
    """The routing load of one replica (lower is better); see WAITING_WEIGHT and KV_USAGE_WEIGHT."""
    return inflight + WAITING_WEIGHT * stats.num_waiting + KV_USAGE_WEIGHT * stats.kv_cache_usage


class ReplicaUnavailableError(RuntimeError):
    """The replica a request is pinned to (data_parallel_rank) is down or restarting; the others serve."""


def replica_env(dp: int, tp: int) -> dict[str, str]:
    """The environment of a replica's engine: unless --threads (OMP_NUM_THREADS) is set, each of the
    dp x tp ranks computes with its share of the cores. Oversubscribed OpenMP threads spin waiting for
    a core: on this 2-core box a decode with 2 threads per process beside another busy process fell to
    ~1 token/s (docs/performance.md, speculative decoding)."""
    env = dict(os.environ)
    if not env.get("OMP_NUM_THREADS", "").isdigit():
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // (dp * tp)))
    return env


class PrefixMap:
    """Prompt prefix (a hash chain over full blocks of token ids, salted like the prefix cache) ->
    the replica that last ran it. Kept in the frontend rather than asked of the replicas: asking costs
    a round trip to every replica per request, answered only between engine steps (tens to hundreds
    of ms on CPU), while this map costs a dict lookup; when a replica has evicted a block the map
    still points at it, which costs one missed hit, never a wrong answer."""

    def __init__(self, block_size: int, max_entries: int = MAX_PREFIX_ENTRIES) -> None:
        self.block_size = max(1, block_size)
        self.max_entries = max_entries
        self._owner: OrderedDict[int, int] = OrderedDict()

    def hashes(self, token_ids: list[int], salt: str | None) -> list[int]:
        out: list[int] = []
        parent = hash(("tokenloom-dp", salt))
        bs = self.block_size
        for start in range(0, min(len(token_ids) // bs, MAX_PREFIX_BLOCKS) * bs, bs):
            parent = hash((parent, tuple(token_ids[start:start + bs])))
            out.append(parent)
        return out

    def match(self, hashes: list[int], alive: set[int]) -> tuple[int | None, int]:
        """(replica holding the longest known prefix, its length in blocks), among `alive` replicas."""
        best, length = None, 0
        for i, h in enumerate(hashes):
            owner = self._owner.get(h)
            if owner is None or owner not in alive:
                break
            best, length = owner, i + 1
        return best, length

    def record(self, hashes: list[int], rank: int) -> None:
        for h in hashes:
            self._owner[h] = rank
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, rank: int) -> None:
        """A restarted replica starts with an empty cache."""
        for h in [h for h, r in self._owner.items() if r == rank]:
            del self._owner[h]


class ReplicaRouter:
    """Chooses the replica of each request; counts of the decisions are kept for /metrics and tests."""

    def __init__(self, size: int, block_size: int) -> None:
        self.size = size
        self.prefix = PrefixMap(block_size)
        self.decisions = {"pinned": 0, "prefix": 0, "load": 0}
        self.turns: Turns[int] = Turns()

    def choose(self, request: EngineCoreRequest, scores: dict[int, float], pinned: int | None) -> int:
        """`scores`: load score of every live replica (at least one)."""
        hashes = self.prefix.hashes(request.prompt_token_ids, request.cache_salt)
        if pinned is not None:
            rank, kind = pinned, "pinned"
        else:
            least = min(scores.values())
            holder, _ = self.prefix.match(hashes, set(scores))
            if holder is not None and not self._unbalanced(scores[holder], least):
                rank, kind = holder, "prefix"
            else:
                rank, kind = self.turns.take([r for r, s in scores.items() if s == least]), "load"
        self.decisions[kind] += 1
        self.prefix.record(hashes, rank)
        return rank

    @staticmethod
    def _unbalanced(holder: float, least: float) -> bool:
        return holder - least > AFFINITY_ABS_SLACK and holder > AFFINITY_REL_SLACK * max(least, 1.0)


class DPEngineClient:
    """N EngineCoreClients behind the one-client interface AsyncLLM uses (see the module docstring)."""

    def __init__(self, config: EngineConfig, size: int, *, on_outputs: Callable[[ipc.StepOutputs], None],
                 on_dead: Callable[[str], None] | None = None,
                 on_replica_dead: Callable[[int, str, list[str]], None] | None = None,
                 heartbeat_timeout: float = 30.0, core_factory: str | None = None,
                 step_timeout: float | None = None) -> None:
        self.config = config
        self.size = size
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.on_replica_dead = on_replica_dead
        self._heartbeat_timeout, self._core_factory, self._step_timeout = heartbeat_timeout, core_factory, step_timeout
        self.replicas: list[EngineCoreClient] = [self._new_replica(rank) for rank in range(size)]
        self.router = ReplicaRouter(size, config.cache.block_size)
        self.info: EngineInfo | None = None
        self._owner: dict[str, int] = {}  # open request id -> replica
        self._seqs_left: dict[str, int] = {}  # open request id -> sequences not finished yet
        self._inflight = [0] * size
        self.dead_reason: str | None = None
        self._starting: set[int] = set()  # replicas being restarted (not routed to until ready)
        self._closing = False
        self.requests_served = [0] * size  # requests routed to each replica since it started

    def _new_replica(self, rank: int) -> EngineCoreClient:
        holder: list[EngineCoreClient] = []
        client = EngineCoreClient(self.config, on_outputs=self._forward_outputs,
                                  on_dead=lambda reason: self._replica_dead(holder[0], rank, reason),
                                  env=replica_env(self.size, self.config.parallel.tensor_parallel_size),
                                  heartbeat_timeout=self._heartbeat_timeout, core_factory=self._core_factory,
                                  step_timeout=self._step_timeout)
        holder.append(client)
        return client

    # -------------------------------------------------------------- state

    @property
    def is_alive(self) -> bool:
        """True while at least one replica serves."""
        return self.dead_reason is None and any(r.is_alive for r in self.replicas)

    def is_serving(self, rank: int) -> bool:
        """Replica `rank` is up and has answered Ready (a restarting one is not routed to)."""
        return self.replicas[rank].is_alive and rank not in self._starting

    def alive_ranks(self) -> list[int]:
        return [rank for rank in range(self.size) if self.is_serving(rank)]

    @property
    def last_stats(self) -> EngineStats:
        """The replicas' stats summed (counts and counters); KV usage as the mean over replicas."""
        return sum_stats([r.last_stats for r in self.replicas])

    def replica_stats(self) -> list[EngineStats]:
        return [r.last_stats for r in self.replicas]

    def inflight(self, rank: int) -> int:
        return self._inflight[rank]

    def owner_of(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    # -------------------------------------------------------------- start / stop

    def launch(self) -> None:
        """Spawn every replica's process now, without waiting for them (`EngineCoreClient.launch`)."""
        for replica in self.replicas:
            replica.launch()

    async def start(self, startup_timeout: float | None = None) -> EngineInfo:
        """Start every replica at once (each loads its own weights); one failing fails the start."""
        results = await asyncio.gather(*(r.start(startup_timeout=startup_timeout) for r in self.replicas),
                                       return_exceptions=True)
        errors = [e for e in results if isinstance(e, BaseException)]
        if errors:
            self.shutdown()
            raise errors[0]
        first = results[0]
        assert isinstance(first, EngineInfo)
        self.info = msgspec.structs.replace(first, data_parallel_size=self.size)
        return self.info

    async def restart_replica(self, rank: int, startup_timeout: float | None = None) -> None:
        """Replace replica `rank` (dead) by a fresh process; its prefix-map entries are forgotten."""
        self.replicas[rank].shutdown()
        self.replicas[rank] = self._new_replica(rank)
        self.router.prefix.forget(rank)
        self._inflight[rank] = 0
        self._starting.add(rank)
        try:
            await self.replicas[rank].start(startup_timeout=startup_timeout)
        finally:
            self._starting.discard(rank)
        self.dead_reason = None

    def shutdown(self, timeout: float = 5.0) -> None:
        self._closing = True
        for replica in self.replicas:
            replica.shutdown(timeout)
        if self.dead_reason is None:
            self.dead_reason = "engine shut down"

    # -------------------------------------------------------------- requests

    async def add_request(self, request: EngineCoreRequest) -> None:
        live = self.alive_ranks()
        pinned = request.data_parallel_rank
        if pinned is not None and not 0 <= pinned < self.size:
            raise ValueError(f"data_parallel_rank {pinned} is out of range (this server runs {self.size} "
                             f"replicas: 0..{self.size - 1})")
        if pinned is not None and pinned not in live:
            state = "restarting" if pinned in self._starting else self.replicas[pinned].dead_reason
            raise ReplicaUnavailableError(f"engine replica {pinned} (data_parallel_rank) is not serving: {state}")
        if not live:
            raise EngineDeadError(self.dead_reason or "no engine replica is running")
        scores = {rank: load_score(self._inflight[rank], self.replicas[rank].last_stats) for rank in live}
        rank = self.router.choose(request, scores, pinned)
        sp = request.sampling_params
        self._owner[request.request_id] = rank
        self._seqs_left[request.request_id] = max(sp.n, sp.best_of or sp.n)
        self._inflight[rank] += 1
        self.requests_served[rank] += 1
        try:
            await self.replicas[rank].add_request(request)
        except BaseException:
            self._release(request.request_id)
            raise

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._release(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            await self.replicas[rank].abort_requests(ids)

    async def call_utility(self, method: str, *args: ipc.UtilityArg, timeout: float = 10.0) -> ipc.UtilityValue:
        """Call it on every live replica; stats are summed, booleans and-ed (reset_prefix_cache)."""
        ranks = self.alive_ranks()
        if not ranks:
            raise EngineDeadError(self.dead_reason or "no engine replica is running")
        results = await asyncio.gather(*(self.replicas[r].call_utility(method, *args, timeout=timeout)
                                         for r in ranks))
        if method == "reset_prefix_cache":
            ok = all(bool(r) for r in results)
            if ok:
                for rank in ranks:
                    self.router.prefix.forget(rank)
            return ok
        stats = [r for r in results if isinstance(r, EngineStats)]
        if stats and len(stats) == len(results):
            return sum_stats(stats)
        return results[0]

    def _release(self, request_id: str) -> int | None:
        rank = self._owner.pop(request_id, None)
        self._seqs_left.pop(request_id, None)
        if rank is not None:
            self._inflight[rank] -= 1
        return rank

    # -------------------------------------------------------------- callbacks from the replicas

    def _forward_outputs(self, msg: ipc.StepOutputs) -> None:
        for o in msg.outputs:
            if o.finish_reason is not None and o.request_id in self._seqs_left:
                self._seqs_left[o.request_id] -= 1
                if self._seqs_left[o.request_id] <= 0 or o.finish_reason == "error":
                    self._release(o.request_id)
        self.on_outputs(msg)

    def _replica_dead(self, client: EngineCoreClient, rank: int, reason: str) -> None:
        if client is not self.replicas[rank] or self._closing or not client.info:
            return  # a replaced replica, all being stopped, or a restart that failed (its caller retries)
        ids = [rid for rid, r in self._owner.items() if r == rank]
        for rid in ids:
            self._release(rid)
        if not any(r.is_alive for r in self.replicas):
            self.dead_reason = f"every engine replica is dead (last: replica {rank}: {reason})"
            if self.on_dead is not None:
                self.on_dead(self.dead_reason)
            return
        logger.error("engine replica %d is dead (%s); %d request(s) fail, the other replicas go on",
                     rank, reason, len(ids))
        if self.on_replica_dead is not None:
            self.on_replica_dead(rank, reason, ids)
