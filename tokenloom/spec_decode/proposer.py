"""The proposer interfaces and the n-gram (prompt lookup) proposer.

Two seams, one per place a proposer can run:

* `Proposer`, in the scheduler: looks at a sequence's tokens and returns up to `num_tokens` guesses of
  what comes next. The scheduler asks it for every decoding sequence before building the step, so the
  drafts travel in the step contract and every tensor-parallel rank verifies the same ones (n-gram).
* `WorkerProposer`, in the worker: runs right after a step's sampling, batched over the sequences that
  sampled, with state of its own on the device (a draft model's weights and KV cache; an EAGLE or MTP
  head would read the target's hidden states there). Its drafts go back in `ModelRunnerOutput`, and the
  scheduler schedules them (or a prefix: token budget, max_tokens, grammar) next step through the same
  `spec_token_ids`. Its drafts may be sampled: `draft_probs` gives the distribution each was drawn
  from, which the rejection sampler needs.
"""
from __future__ import annotations

import torch

from tokenloom.config import SpeculativeConfig

# Methods whose proposer runs in the worker (its drafts come back in ModelRunnerOutput.draft_token_ids).
WORKER_METHODS = ("draft_model",)


class Proposer:
    """Drafts tokens for one sequence. Drafts are deterministic (no draft distribution), so verification
    uses the deterministic-draft rule (`rejection_sampler.accept_deterministic`)."""

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        raise NotImplementedError


class WorkerProposer:
    """Drafts for every sequence that sampled in a step, in the worker that sampled them."""

    def update_states(self, step) -> None:
        """Follow the step's deltas (new, finished and moved sequences, block copies), once per step."""
        raise NotImplementedError

    def propose(self, sampled: list[tuple[object, list[int]]]) -> dict[str, list[int]]:
        """Drafts per key, given each sequence's state and the tokens it sampled this step."""
        raise NotImplementedError

    def draft_probs(self, key: str, drafts: list[int]) -> torch.Tensor | None:
        """[len(drafts), V]: the distribution each of these drafts (a prefix of the last proposal) was drawn
        from; None when they were chosen deterministically (greedy)."""
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed it.

    Searching backwards from the end finds the latest match first, which on repetitive text (code being
    edited, quoted passages) is the one most likely to continue the same way. The search is pure Python
    over the sequence; at ~1k tokens it costs tens of microseconds, small against a ~20 ms decode step."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        length = len(token_ids)
        if num_tokens <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            tail = token_ids[length - n:]
            first = tail[0]
            # Latest start i < length - n with token_ids[i:i+n] == tail.
            i = length - n - 1
            while i >= 0:
                if token_ids[i] == first and token_ids[i:i + n] == tail:
                    follow = token_ids[i + n:i + n + num_tokens]
                    if follow:
                        return follow
                i -= 1
        return []


def make_proposer(config: SpeculativeConfig) -> Proposer | None:
    """The scheduler's proposer; None for a method whose proposer runs in the worker."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method in WORKER_METHODS:
        return None
    raise ValueError(f"no proposer for method {config.method!r}")
