"""Which logits rows of a step sample, and how: one `SamplingRow` per draw, with its generator.

The runner's plan covers plain decodes (one draw per sibling generator, before an n > 1 fork), verify spans
whose drafts were chosen deterministically (position j samples as the plain decode would after drafts[:j])
or drawn from a draft model (verified by the rejection sampler), and prompt-logprob rows. The draft model
builds its rows with the same `sampling_row`, and its generators with the same `seeded_generator`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from tokenloom.core.contract import SchedulerOutput
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.model.sampler import SamplingRow
from tokenloom.worker.batch_layout import LogitRow
from tokenloom.worker.request_state import RequestState


def seeded_generator(seed: int | None, offset: int, device: torch.device) -> torch.Generator | None:
    """A generator on `device` seeded with seed + offset (None for an unseeded request: the global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed((seed + offset) % (2 ** 63))
    return g


def sampling_row(r: RequestState, output_token_ids: list[int], generator: torch.Generator | None,
                 params: SamplingParams | None = None) -> SamplingRow:
    """Sequence `r`'s row as if it had generated `output_token_ids` (penalties, min_tokens, bad words)."""
    return SamplingRow(params or r.params, r.prompt_token_ids, output_token_ids, generator,
                       r.bad_words_token_ids, r.eos_token_ids, r.key)


class VerifyRow(NamedTuple):
    """One position of a verify span whose drafts a draft model sampled (the rejection sampler's input)."""

    logits_row: int
    row: SamplingRow
    mask: bytes | None


@dataclass
class SamplingPlan:
    sample_idx: list[int] = field(default_factory=list)  # the logits row of each draw
    rows: list[SamplingRow] = field(default_factory=list)
    owners: list[RequestState] = field(default_factory=list)
    masks: list[bytes | None] = field(default_factory=list)  # grammar bitmask of each draw
    prompt_rows: dict[str, tuple[RequestState, list[int]]] = field(default_factory=dict)  # prompt logprobs
    positions: dict[str, int] = field(default_factory=dict)  # deterministic verify spans: positions seen
    sampled_drafts: dict[str, list[VerifyRow]] = field(default_factory=dict)  # verified by rejection

    @classmethod
    def for_step(cls, logit_rows: list[LogitRow], step: SchedulerOutput, drafts_sampled: bool) -> SamplingPlan:
        """`drafts_sampled`: a draft model proposed this step's drafts (random ones were drawn from it)."""
        plan = cls()
        bitmasks, spec = step.grammar_bitmask, step.spec_token_ids
        for i, (r, _, samples) in enumerate(logit_rows):
            if not samples:
                plan.prompt_rows.setdefault(r.key, (r, []))[1].append(i)
                continue
            params = replace(r.params, logprobs=0) if r.needs_logprob and r.params.logprobs is None else r.params
            drafts = spec.get(r.key)
            if not drafts:
                for g in r.generators:
                    plan._draw(i, sampling_row(r, r.output_token_ids, g, params), r, bitmasks.get(r.key))
                continue
            spec_masks = step.spec_grammar_bitmask.get(r.key)
            if drafts_sampled and not params.is_greedy:
                verify = plan.sampled_drafts.setdefault(r.key, [])
                j = len(verify)
                verify.append(VerifyRow(i, sampling_row(r, r.output_token_ids + drafts[:j], r.generators[0], params),
                                        spec_masks[j] if spec_masks else None))
                continue
            j = plan.positions.get(r.key, 0)
            plan.positions[r.key] = j + 1
            plan._draw(i, sampling_row(r, r.output_token_ids + drafts[:j], r.generators[0], params), r,
                       spec_masks[j] if spec_masks else None)
        return plan

    def _draw(self, logits_row: int, row: SamplingRow, owner: RequestState, mask: bytes | None) -> None:
        self.sample_idx.append(logits_row)
        self.rows.append(row)
        self.owners.append(owner)
        self.masks.append(mask)
