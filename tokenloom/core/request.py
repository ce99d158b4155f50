"""A request as the engine sees it: tokens so far, tokens computed, and its KV blocks."""
from __future__ import annotations

import enum
import itertools
import time
from typing import Any

from tokenloom.core.contract import sequence_key
from tokenloom.core.lora_request import LoRARequest
from tokenloom.core.multimodal import ImageInput
from tokenloom.core.sampling_params import SamplingParams

_ARRIVAL_ORDER = itertools.count()  # breaks ties between equal arrival timestamps


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its KV is being loaded in the background
    FINISHED = "finished"


class Request:
    """One sequence. A request with n>1 runs as one sequence until its prompt is computed, then forks.

    The scheduler owns it. The workers keep their own copy of what they need (`RequestState`); the
    `sent_*` fields record what they have been told, so each step sends them only what changed."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 arrival_time: float | None = None, priority: int = 0, eos_token_ids: list[int] = (),
                 bad_words_token_ids: list[list[int]] = (), cache_salt: str | None = None, index: int = 0,
                 lora_request: LoRARequest | None = None, images: list[ImageInput] = ()):
        self.request_id = request_id
        self.index = index
        self.key = sequence_key(request_id, index)
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
        self.lora_request = lora_request
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        self.images = list(images)  # placeholder spans in the prompt, in order
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prompt tokens served from the prefix cache, set on first schedule
        self.block_ids: list[int] = []
        self.num_released_blocks = 0  # block_ids[:n] were freed behind a sliding window (NULL_BLOCK)
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.sent_to_workers = False
        self.sent_tokens = 0  # token_ids[:sent_tokens] are known to the workers
        self.sent_blocks = 0  # block_ids[:sent_blocks] likewise
        self.spec_token_ids: list[int] = []  # drafts scheduled this step (speculative decoding)
        # Their grammar bitmasks, one per verified position (1 + len(drafts)), when a grammar constrains any.
        self.spec_bitmasks: list[bytes | None] | None = None
        self.resend_blocks = False  # the block table changed wholesale (preempted, blocks released): send it all
        # Async scheduling: steps in flight that sample this sequence, whose tokens the scheduler does not know
        # yet (vLLM's output placeholders); and the newest step that computes it, as (step id, tokens).
        self.num_output_placeholders = 0
        self.latest_step = (0, 0)
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.first_scheduled_time = 0.0
        self.first_token_time = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        width = max(params.n, params.best_of or params.n)
        self.pending_forks = width - 1 if index == 0 else 0
        self.structured: Any = None  # tokenloom.structured StructuredState, set by the EngineCore
        self.kv_transfer_params: dict | None = None  # set when it finishes: what a KV consumer needs (PD)

    @property
    def block_hash_salt(self) -> str | None:
        """What the prefix cache mixes into every block hash besides the tokens: the cache salt and the LoRA
        adapter, so blocks computed under one adapter are never served to another (or to the base model)."""
        if not self.lora_int_id:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora_int_id}"

    def block_salt(self, start: int, end: int) -> str | None:
        """The prefix-cache salt of the block holding tokens [start, end): `block_hash_salt`, plus the content
        hash of each image whose placeholders lie in it, so the same text with another image never hits."""
        images = [f"{im.content_hash}@{im.offset}" for im in self.images if im.overlaps(start, end)]
        if not images:
            return self.block_hash_salt
        return f"{self.block_hash_salt or ''}\x00image:{','.join(images)}"

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

    def fork(self, index: int) -> "Request":
        """A child sequence sharing everything computed so far (blocks are shared by the caller). The workers
        hear of it through the scheduler's fork event (`ForkData`), which copies the parent's state there."""
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.index = index
        child.key = sequence_key(self.request_id, index)
        child.sent_to_workers = False  # until the fork event has told them
        child.token_ids = list(self.token_ids)
        child.block_ids = list(self.block_ids)
        child.block_hashes = list(self.block_hashes)
        child.pending_forks = 0
        child.prompt_logprobs = None
        child.structured = self.structured.fork() if self.structured is not None else None
        return child

    def sort_key(self) -> tuple:
        """Scheduling order: priority, then arrival (timestamps can tie; the order requests were added
        cannot), then sequence index."""
        return (self.priority, self.arrival_time, self.arrival_seq, self.index)
