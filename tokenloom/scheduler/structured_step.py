"""A grammar's part of a step, decided by the scheduler: the bitmask of a constrained sequence that samples,
and for one that verifies drafts, which of them its grammar allows.

Trimming happens before the step's KV slots are allocated: a draft the grammar forbids could never be
accepted, so the sequence is neither given a slot nor a position for it, and the token count the step
contract carries, the slots allocated and the drafts verified agree. Bitmasks are int32 rows over the
vocabulary as bytes (`tokenloom.structured.matcher`), applied by the rank that samples.
"""
from __future__ import annotations

from tokenloom.structured.matcher import StructuredState, bitmask_row, draft_bitmasks


def next_token_bitmask(state: StructuredState, vocab_size: int) -> bytes | None:
    """The allowed next tokens of a constrained sequence that samples one token; None when nothing constrains
    it now (a reasoning phase, a finished or failed grammar)."""
    return bitmask_row(state, vocab_size)


def constrain_drafts(state: StructuredState, drafts: list[int],
                     vocab_size: int) -> tuple[list[int], list[bytes | None] | None]:
    """The drafts a constrained sequence verifies (the longest prefix its grammar allows) and their bitmasks,
    one per verified position (1 + len(kept)), or None when no position is constrained. No draft is kept when
    the grammar cannot be advanced tentatively (reasoning phases, a failed grammar): the sequence then
    samples one token under `next_token_bitmask`."""
    result = draft_bitmasks(state, drafts, vocab_size)
    if result is None:
        return [], None
    masks, kept = result
    if not kept:
        return [], None
    return drafts[:kept], masks if any(m is not None for m in masks) else None
