"""A request as the engine sees it: tokens so far, tokens computed, and its KV blocks."""
from __future__ import annotations

import enum
import itertools
import time
from typing import Any

import torch

from tokenloom.sampling_params import SamplingParams


_ARRIVAL_ORDER = itertools.count()  # breaks ties between equal arrival timestamps


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence. A request with n>1 runs as one sequence until its prompt is computed, then forks."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 arrival_time: float | None = None, priority: int = 0, eos_token_ids: list[int] = (),
                 bad_words_token_ids: list[list[int]] = (), cache_salt: str | None = None, index: int = 0,
                 device: torch.device | str = "cpu"):
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.arrival_seq = next(_ARRIVAL_ORDER)
        self.priority = priority
        self.eos_token_ids = [] if params.ignore_eos else list(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids or ()) | set(self.eos_token_ids)
        self.bad_words_token_ids = [list(w) for w in bad_words_token_ids]
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set on first schedule
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.first_scheduled_time = 0.0
        self.first_token_time = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        width = max(params.n, params.best_of or params.n)
        self.pending_forks = width - 1 if index == 0 else 0
        self.device = device
        self.generators = [self._generator(i) for i in range(width)] if index == 0 else []
        self.generator = self.generators[0] if self.generators else None
        self.structured: Any = None  # tokenloom.structured StructuredState, set by the EngineCore

    def _generator(self, child: int) -> torch.Generator | None:
        if self.params.seed is None:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed((self.params.seed + 1_000_003 * child) % (2 ** 63))
        return g

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def needs_logprob(self) -> bool:
        return self.params.logprobs is not None or (self.params.best_of or 0) > self.params.n

    def fork(self, index: int) -> "Request":
        """A child sequence sharing everything computed so far (blocks are shared by the caller)."""
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.index = index
        child.token_ids = list(self.token_ids)
        child.block_ids = list(self.block_ids)
        child.block_hashes = list(self.block_hashes)
        child.pending_forks = 0
        child.generators = []
        child.generator = self.generators[index] if self.generators else None
        child.prompt_logprobs = None
        child.structured = self.structured.fork() if self.structured is not None else None
        return child

    def sort_key(self) -> tuple:
        """Scheduling order: priority, then arrival (timestamps can tie; the order requests were added
        cannot), then sequence index."""
        return (self.priority, self.arrival_time, self.arrival_seq, self.index)
