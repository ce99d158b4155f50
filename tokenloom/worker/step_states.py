"""Following a step's deltas: the one rule by which the runner's per-sequence states and the draft model's
stay in step with the scheduler (block copies into the caches first, then forks, then finished, new and
running sequences), applied once per step id by the runner."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from tokenloom.core.contract import CachedRequestData, ForkData, NewRequestData, SchedulerOutput

State = TypeVar("State")


def copy_blocks(kv_caches: list[torch.Tensor], copies: list[tuple[int, int]]) -> None:
    """The step's block copies (copy-on-write of a shared last block), in every layer."""
    for src, dst in copies:
        for cache in kv_caches:
            cache[:, dst].copy_(cache[:, src])


def follow_step(step: SchedulerOutput, kv_caches: list[torch.Tensor], states: dict[str, State],
                new_state: Callable[[NewRequestData], State], advance: Callable[[State, CachedRequestData], None],
                apply_forks: Callable[[dict[str, State], list[ForkData]], None] | None = None,
                every_sequence_known: bool = True) -> None:
    """Apply `step` to `states` (keyed by sequence key). `apply_forks`: how a fork's children get their
    states (before the finished keys: a parent may finish on the token that forked it); None leaves them
    out. `every_sequence_known`: a running sequence without a state is an error (the runner's); False skips
    it (a draft model creates a fork's sibling lazily)."""
    copy_blocks(kv_caches, step.block_copies)
    if apply_forks is not None and step.forks:
        apply_forks(states, step.forks)
    for key in step.finished_keys:
        states.pop(key, None)
    for new in step.new_requests:
        states[new.key] = new_state(new)
    for delta in step.cached_requests:
        st = states[delta.key] if every_sequence_known else states.get(delta.key)
        if st is not None:
            advance(st, delta)
