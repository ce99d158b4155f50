"""The proposer interface and the n-gram (prompt lookup) proposer.

A proposer looks at a sequence's tokens and returns up to `num_tokens` guesses of what comes next.
The scheduler asks it for every decoding sequence before building the step, so the drafts travel in
the step contract and every tensor-parallel rank verifies the same ones. Proposers that need the
target's hidden states (EAGLE, MTP heads) would implement the same `propose` but run in the worker
after the forward; the contract already carries per-key draft tokens either way.
"""
from __future__ import annotations

from tokenloom.config import SpeculativeConfig


class Proposer:
    """Drafts tokens for one sequence. Drafts are deterministic (no draft distribution), so verification
    uses the deterministic-draft rule (`rejection_sampler.accept_deterministic`)."""

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
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


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    raise ValueError(f"no proposer for method {config.method!r}")
