"""What the sampler, and a logits processor, know of one row of a step's batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.core.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One row of the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (for penalties, min_tokens, bad words)
    # Per-request RNG (on the logits' device), seeded when params.seed is set;
    # None = use the global RNG.
    generator: torch.Generator | None = None
    # Token-id sequences to ban. A single-token sequence is always banned; for a longer
    # one, its last token is banned when the previous ones match the output's tail.
    bad_words_token_ids: list[list[int]] = ()
    eos_token_ids: list[int] = ()
    # The request's id: what a logits processor keys its own per-request memory by.
    request_id: str = ""
