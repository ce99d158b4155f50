"""The step contract: what the scheduler sends the workers each step, and what comes back.

Plain msgspec structs keyed by a sequence's key (`sequence_key`), never live `Request`
objects, so a step crosses a process or machine boundary as msgpack. Workers keep each
sequence's state between steps (`executor.request_state`), so a step carries deltas only:
a new sequence once with its prompt and parameters, then per step the tokens it gained,
its new KV blocks and how many tokens to compute. The scheduler alone decides a
sequence's fate (stop checks, freeing); workers only compute and sample.
"""
from __future__ import annotations

import msgspec

from tokenloom.core.kv_metadata import KVConnectorMetadata, KVConnectorOutput
from tokenloom.core.lora_request import LoRASlotLoad
from tokenloom.core.multimodal import ImageInput
from tokenloom.core.sampling_params import SamplingParams

# One token's logprobs: [[token_id, logprob, rank], ...], the chosen token first, then the top-k.
TokenLogprobs = list[list[float]]


def sequence_key(request_id: str, index: int) -> str:
    """A request's sequence 0 is keyed by its id; the siblings of n > 1 by id#index. The one place a key is
    named: nothing reads a key back (a sequence's index travels as data, `ForkedSequence.index`)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class NewRequestData(msgspec.Struct, kw_only=True, array_like=True):
    """A sequence the workers have not seen: everything they need to compute and sample it."""

    key: str
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # prompt tokens served from the prefix cache
    eos_token_ids: list[int] = []
    bad_words_token_ids: list[list[int]] = []
    output_token_ids: list[int] = []  # sampled elsewhere already (a remote prefill's first token)
    lora_int_id: int = 0  # its LoRA adapter (0: the base model); resident in a slot whenever it is scheduled
    images: list[ImageInput] = []  # its prompt's images: encoded when a step's tokens reach their placeholders


class CachedRequestData(msgspec.Struct, kw_only=True, array_like=True):
    """A known sequence scheduled again: only what changed since the workers last saw it."""

    key: str
    new_token_ids: list[int]  # tokens appended since (the previous step's samples)
    new_block_ids: list[int]
    num_computed_tokens: int
    # The sequence's token count once the delta is applied. Tokens a worker holds past it (and past the new ones)
    # are dropped: a sample it fed forward into a step whose outputs were then thrown away (async scheduling).
    num_tokens: int
    replace_block_ids: bool = False  # new_block_ids is the whole table (after a preemption, or blocks released)
    # Async scheduling: the sequence's last input is the token this worker sampled for it in the step before,
    # which the scheduler has not seen yet (that step is still in flight when this one is scheduled).
    takes_last_sample: bool = False


class ForkedSequence(msgspec.Struct, kw_only=True, array_like=True):
    """One child of a fork, as the scheduler holds it when the workers first hear of it."""

    key: str
    # Its place among the request's sequences: the parent's sampler generator of that number becomes the
    # child's (seeded from seed + CHILD_SEED_STRIDE * index; it already drew the child's first token).
    index: int
    block_ids: list[int]  # the child's whole block table: shared full blocks, its copy of the partial last one
    num_computed_tokens: int


class ForkData(msgspec.Struct, kw_only=True, array_like=True):
    """A sequence of an n > 1 (or best_of) request split into its siblings: the step before sampled one token per
    sibling under the parent's key, and the scheduler forked them when it applied that step. Sent once, in the
    next step; the workers apply it before that step's other deltas, so each child starts as a copy of the
    parent's state as they know it. The partial last block's KV copy travels in the same step's block_copies."""

    parent_key: str
    children: list[ForkedSequence]  # the children still alive (one that already finished is not created)


class SchedulerOutput(msgspec.Struct, kw_only=True):
    step_id: int = 0  # workers apply a step's deltas and block copies once, however often it is re-run
    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    # Tokens each scheduled sequence computes this step (a decode 1; a prefill chunk more).
    num_scheduled_tokens: dict[str, int] = {}
    forks: list[ForkData] = []  # applied first: the sequences they create may be scheduled or finished below
    finished_keys: list[str] = []  # the workers drop these sequences' state
    block_copies: list[tuple[int, int]] = []  # (src, dst) KV blocks to copy before the forward
    # Sampling rows constrained by a grammar: key -> int32 bitmask over the vocabulary, as bytes.
    grammar_bitmask: dict[str, bytes] = {}
    # Speculative decoding: key -> draft tokens to verify after the sequence's last token. Such a key's
    # num_scheduled_tokens is 1 + len(drafts) and it samples at every one of those positions.
    spec_token_ids: dict[str, list[int]] = {}
    # Constrained speculative rows: one bitmask (or None) per position, 1 + len(drafts) of them.
    spec_grammar_bitmask: dict[str, list[bytes | None]] = {}
    # A proposer in the worker (draft model) drafts for the next step after sampling this one; off while
    # speculation is paused (disable_by_batch_size), so an idle draft model costs nothing.
    propose_drafts: bool = False
    kv_connector: KVConnectorMetadata | None = None  # KV loads, saves and publications (tokenloom.kv_transfer)
    lora_loads: list[LoRASlotLoad] = []  # adapters to put into slots before the forward (applied once per step id)
    # Images (content hashes) whose encoder rows no sequence will read again: the workers drop them.
    encoder_cache_frees: list[str] = []

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def __bool__(self) -> bool:
        return (bool(self.num_scheduled_tokens) or bool(self.forks) or self.kv_connector is not None
                or bool(self.lora_loads) or bool(self.encoder_cache_frees))

    def subset(self, keys: list[str]) -> "SchedulerOutput":
        """The same step computing some sequences only: how fault isolation re-runs part of a failed batch.
        It keeps every delta (the failure may have come before any worker saw them); the step id makes
        workers apply them once."""
        return msgspec.structs.replace(
            self, num_scheduled_tokens={k: self.num_scheduled_tokens[k] for k in keys},
            grammar_bitmask={k: v for k, v in self.grammar_bitmask.items() if k in keys},
            spec_token_ids={k: v for k, v in self.spec_token_ids.items() if k in keys},
            spec_grammar_bitmask={k: v for k, v in self.spec_grammar_bitmask.items() if k in keys})


class SampledSequence(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one sequence sampled in one step: one token, or with speculation the accepted drafts and one more."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # per token, when the request asked for them


class ExpertLoadReport(msgspec.Struct, kw_only=True):
    """The expert load balancer's figures at a re-placement (tokenloom.worker.expert_balancer). Imbalance is the
    max / mean of the tokens each rank's experts computed (1.0: even), averaged over the MoE layers."""

    rebalances: int  # re-placements so far
    experts_moved: int  # expert copies that changed rank, so far
    window_steps: int  # steps the figures cover
    imbalance: float  # measured over the window, under the placement it ran with
    planned_imbalance: float  # the same window's load under the new placement


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    # Per scheduled key that sampled: one entry per sequence (n > 1 forks sample all siblings at once).
    sampled: dict[str, list[SampledSequence]] = {}
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}  # this step's prompt positions, per key
    # A worker-side proposer's drafts for the next step, per key that sampled (the scheduler verifies them
    # next step through spec_token_ids, or a prefix of them).
    draft_token_ids: dict[str, list[int]] = {}
    pooled: dict[str, list[float]] = {}  # embedding requests computed this step: key -> embedding
    kv_connector: KVConnectorOutput | None = None  # transfers sent, loads failed
    expert_load: ExpertLoadReport | None = None  # the step after which the experts were re-placed
