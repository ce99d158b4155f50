"""Continuous batching with one token budget per step, chunked prefill, and preemption by recompute."""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from tokenloom.config import SchedulerConfig
from tokenloom.engine.request import Request, RequestStatus
from tokenloom.scheduler.kv_cache_manager import KVCacheManager


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """After this step the request knows all its tokens' KV, so it samples the next one."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) to copy before the forward

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    """Running requests first (a decode costs one token, a partial prefill its next chunk), then waiting
    ones in (priority, arrival) order, within max_num_batched_tokens and max_num_seqs."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 prefix_reorder_window: int = 8):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.requests: dict[tuple[str, int], Request] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0
        self.prefix_reorder_window = prefix_reorder_window

    # ---- queue management -------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[(request.request_id, request.index)] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        keys = [r.sort_key() for r in self.waiting]
        pos = bisect.bisect_left(keys, request.sort_key()) if front else bisect.bisect_right(keys, request.sort_key())
        self.waiting.insert(pos, request)

    def abort(self, request_id: str) -> list[Request]:
        aborted = [r for (rid, _), r in list(self.requests.items()) if rid == request_id]
        for r in aborted:
            self.finish(r, "abort")
        return aborted

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        self.requests.pop((request.request_id, request.index), None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(block_copies=self.pending_copies)
        self.pending_copies = []
        budget = self.config.max_num_batched_tokens

        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate(req, n):
                victim = max(self.running, key=Request.sort_key)
                victim_index = self.running.index(victim)
                if victim_index < i:
                    i -= 1
                    done = next(s for s in out.scheduled if s.request is victim)
                    out.scheduled.remove(done)
                    budget += done.num_new_tokens
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            idx = self._pick_waiting()
            req = self.waiting[idx]
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached_tokens = len(cached) * self.kv.block_size
            n = self._chunk(req, req.num_tokens - num_cached_tokens, budget)
            if not self.kv.allocate(req, n, cached):
                break
            self.waiting.pop(idx)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached_tokens
                self.kv.record_prefix_query(req, num_cached_tokens)
            req.num_computed_tokens = num_cached_tokens
            req.status = RequestStatus.RUNNING
            if not req.first_scheduled_time:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _chunk(self, req: Request, remaining: int, budget: int) -> int:
        n = min(remaining, budget)
        if remaining > 1:
            n = min(n, self.config.long_prefill_token_threshold)
        return max(n, 1) if budget > 0 else 0

    def _pick_waiting(self) -> int:
        """Among the first waiting requests of the head's priority, prefer one with a cached prefix.

        Bounded reordering: only a small window is considered, so nobody starves."""
        head = self.waiting[0]
        if not self.kv.pool.enable_caching or head.num_computed_tokens or head.num_cached_tokens >= 0:
            return 0
        for idx, req in enumerate(self.waiting[: self.prefix_reorder_window]):
            if req.priority != head.priority:
                break
            if req.num_cached_tokens < 0 and self.kv.find_cached_prefix(req):
                return idx
        return 0

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        if req.prompt_logprobs is not None and req.num_output_tokens == 0:
            req.prompt_logprobs = [None]  # the recompute reports the prompt's positions again
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    # ---- after the forward -------------------------------------------------
    def fork(self, parent: Request) -> list[Request]:
        """Split a request with n>1 into its sequences once its prompt is computed."""
        children = []
        needs_copy = parent.num_computed_tokens % self.kv.block_size != 0
        for index in range(1, parent.pending_forks + 1):
            child = parent.fork(index)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self.requests[(child.request_id, child.index)] = child
            children.append(child)
            if needs_copy and self.kv.pool.num_free == 0:
                # No block to copy the partial last block into: recompute this sequence later.
                child.block_ids = []
                self._preempt(child)
                continue
            copy = self.kv.fork(parent, child)
            if copy:
                self.pending_copies.append(copy)
        parent.pending_forks = 0
        return children
