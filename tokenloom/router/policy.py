"""How the router picks a worker: round_robin, least_load, cache_aware (the names of SGLang's router).

* round_robin: the next healthy worker in turn.
* least_load: the healthy worker with the fewest requests open through this router.
* cache_aware: prefix affinity with a load guard, as SGLang's router does it. Each worker keeps an
  approximate record of the prompts sent to it (`PrefixRecord`: a hash chain over
  `CHUNK_CHARS`-character chunks of the prompt text, least recently used out). When the load is
  unbalanced (the busiest worker has more than `balance_abs_threshold` open requests over the
  idlest AND more than `balance_rel_threshold` times as many) the idlest worker gets the request.
  Otherwise the worker with the longest recorded prefix gets it if that prefix covers more than
  `cache_threshold` of the prompt; else the worker with the smallest record (the most room in its
  cache). The chosen worker's record takes the prompt.

Workers that tie (idle ones, or equal records) take their turns in the order of their URLs
(core/turns.py), so sequential requests to an idle pool spread over it instead of all going to the
first worker.

Load is the router's own count of open requests per worker: exact for the traffic through it,
immediate (no polling of the workers' /metrics), and blind to traffic that bypasses the router.
"""
from __future__ import annotations

import itertools
import json
from collections import OrderedDict
from typing import Protocol

from tokenloom.core.json_types import JsonValue
from tokenloom.core.turns import Turns
from tokenloom.router.workers import Worker

POLICIES = ("round_robin", "least_load", "cache_aware")

# 32 characters are ~8 tokens of English text: fine enough that a shared system prompt is matched to
# within a fraction of one 16-token KV block, coarse enough that a 4,000-character prompt is 125 hashes.
CHUNK_CHARS = 32
# Prompt text considered: shared prefixes (system prompts, documents) sit at the start; past this the
# hashing costs more than the routing gains.
MAX_PREFIX_CHARS = 32 * 1024


def prompt_text(body: JsonValue) -> str:
    """The text a request's KV cache starts with: the completion prompt, or the chat messages in order."""
    if not isinstance(body, dict):
        return ""
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    parts = []
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            content = message.get("content")
            parts.append(f"{message.get('role', '')}:{content if isinstance(content, str) else json.dumps(content)}\n")
    return "".join(parts)


class RoutingPolicy(Protocol):
    """Chooses the worker of one request (its parsed JSON body) and says why (a /metrics label)."""

    name: str

    def choose(self, workers: list[Worker], body: JsonValue) -> tuple[Worker, str]: ...


class PrefixRecord:
    """One worker's approximate prefix tree: chunk-chain hashes of the prompts it got, LRU-bounded."""

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def hashes(text: str) -> list[int]:
        text = text[:MAX_PREFIX_CHARS]
        out, parent = [], 0
        for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
            parent = hash((parent, text[start:start + CHUNK_CHARS]))
            out.append(parent)
        return out

    def __len__(self) -> int:
        return len(self._chunks)

    def matched(self, hashes: list[int]) -> int:
        """How many leading chunks of the prompt this worker has seen."""
        n = 0
        for h in hashes:
            if h not in self._chunks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._chunks[h] = None
            self._chunks.move_to_end(h)
        while len(self._chunks) > self.max_chunks:
            self._chunks.popitem(last=False)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[Worker], body: JsonValue) -> tuple[Worker, str]:
        return workers[next(self._counter) % len(workers)], "round_robin"


def _url(worker: Worker) -> str:
    return worker.url


class LeastLoad:
    name = "least_load"

    def __init__(self) -> None:
        self.turns: Turns[str] = Turns()

    def choose(self, workers: list[Worker], body: JsonValue) -> tuple[Worker, str]:
        return self.turns.least(workers, lambda w: w.inflight, _url), "least_load"


class CacheAware:
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 20) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.records: dict[str, PrefixRecord] = {}
        self.turns: Turns[str] = Turns()

    def _record(self, worker: Worker) -> PrefixRecord:
        if worker.url not in self.records:
            self.records[worker.url] = PrefixRecord(self.max_tree_size)
        return self.records[worker.url]

    def choose(self, workers: list[Worker], body: JsonValue) -> tuple[Worker, str]:
        """Returns the worker and why: "balance" (load unbalanced), "prefix" (match above the threshold)
        or "fresh" (no good match: the smallest record)."""
        hashes = PrefixRecord.hashes(prompt_text(body))
        busiest = max(w.inflight for w in workers)
        idlest = min(w.inflight for w in workers)
        if busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest:
            chosen, why = self.turns.least(workers, lambda w: w.inflight, _url), "balance"
        else:
            best = max(workers, key=lambda w: (self._record(w).matched(hashes), -w.inflight))
            rate = self._record(best).matched(hashes) / len(hashes) if hashes else 0.0
            if rate > self.cache_threshold:
                chosen, why = best, "prefix"
            else:
                chosen, why = self.turns.least(workers, lambda w: (len(self._record(w)), w.inflight), _url), "fresh"
        self._record(chosen).insert(hashes)
        return chosen, why


def make_policy(name: str, **cache_aware_args: float) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(**cache_aware_args)
    raise ValueError(f"unknown router policy {name!r} (one of {', '.join(POLICIES)})")
