"""What a worker remembers about each sequence between steps (the persistent batch).

Built from `NewRequestData` once, then advanced by each step's `CachedRequestData`; dropped
when the scheduler lists the key as finished. An n > 1 sequence is split into its siblings by
the scheduler's fork event (`apply_forks`, the one place workers fork). It holds what only the
device side needs: the token history for inputs and penalties, the block table, and the seeded
generators, which must live where sampling happens (rank 0) so a seeded request draws the same
numbers whatever process it runs in.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenloom.core.contract import CachedRequestData, ForkData, ForkedSequence, NewRequestData
from tokenloom.core.multimodal import ImageInput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.models.vision.mrope import PromptRope

# Child c of a seeded request draws from seed + CHILD_SEED_STRIDE * c, so siblings differ.
CHILD_SEED_STRIDE = 1_000_003


@dataclass
class RequestState:
    key: str
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: list[int]
    bad_words_token_ids: list[list[int]]
    # One per sequence still to come out of this one: n (or best_of) before the fork, then one.
    generators: list[torch.Generator | None] = field(default_factory=list)
    index: int = 0  # the sequence's place among its request's (a fork's child: ForkedSequence.index)
    lora_int_id: int = 0  # its LoRA adapter (0: the base model)
    images: list[ImageInput] = field(default_factory=list)  # the prompt's, for a (re)computed prefill
    rope: PromptRope | None = None  # an M-RoPE model's positions of a prompt with images (the runner sets it)

    @classmethod
    def from_new(cls, new: NewRequestData, device: torch.device) -> "RequestState":
        params = new.sampling_params
        width = max(params.n, params.best_of or params.n)
        return cls(new.key, new.request_id, params, list(new.prompt_token_ids),
                   list(new.prompt_token_ids) + list(new.output_token_ids),
                   list(new.block_ids), new.num_computed_tokens,
                   [] if params.ignore_eos else list(new.eos_token_ids),
                   [list(w) for w in new.bad_words_token_ids],
                   [_generator(params.seed, child, device) for child in range(width)],
                   lora_int_id=new.lora_int_id, images=list(new.images))

    def apply(self, delta: CachedRequestData, last_sample: int | None = None) -> None:
        """Follow a delta; `last_sample`: the token this worker sampled for the sequence in its latest step,
        which the delta may take as the sequence's next input (async scheduling)."""
        del self.token_ids[delta.num_tokens - len(delta.new_token_ids) - delta.takes_last_sample:]
        self.token_ids.extend(delta.new_token_ids)
        if delta.takes_last_sample:
            if last_sample is None:
                raise RuntimeError(f"sequence {self.key}: no sample of the step before to take as its input")
            self.token_ids.append(last_sample)
        if delta.replace_block_ids:
            self.block_ids = list(delta.new_block_ids)
        else:
            self.block_ids.extend(delta.new_block_ids)
        self.num_computed_tokens = delta.num_computed_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def forks(self) -> bool:
        """Whether this step's sample splits the sequence into its n siblings."""
        return len(self.generators) > 1

    @property
    def needs_logprob(self) -> bool:
        return self.params.logprobs is not None or (self.params.best_of or 0) > self.params.n

    def child(self, forked: ForkedSequence) -> "RequestState":
        """A sibling split off this sequence: its tokens so far, the table the scheduler gave it, and the
        generator of its index, which drew its first token along with this sequence's."""
        return RequestState(forked.key, self.request_id, self.params, self.prompt_token_ids, list(self.token_ids),
                            list(forked.block_ids), forked.num_computed_tokens, self.eos_token_ids,
                            self.bad_words_token_ids, [self.generators[forked.index]], forked.index,
                            self.lora_int_id, self.images, self.rope)


def apply_forks(states: dict[str, RequestState], forks: list[ForkData]) -> None:
    """Split each forked sequence into its siblings, as the scheduler did; the parent keeps generator 0 and
    samples one row from then on. Applied before the step's other deltas (they may extend the children)."""
    for fork in forks:
        parent = states[fork.parent_key]
        for forked in fork.children:
            states[forked.key] = parent.child(forked)
        parent.generators = parent.generators[:1]


def _generator(seed: int | None, child: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((seed + CHILD_SEED_STRIDE * child) % (2 ** 63))
    return g
