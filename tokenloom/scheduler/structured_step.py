"""A grammar's part of a step, decided by the scheduler: the bitmask of a constrained sequence that samples,
for one that verifies drafts which of them its grammar allows, and the tokens a grammar forces after a
sampled token (jump-forward decoding, `tokenloom.structured.jump_forward`).

Trimming happens before the step's KV slots are allocated: a draft the grammar forbids could never be
accepted, so the sequence is neither given a slot nor a position for it, and the token count the step
contract carries, the slots allocated and the drafts verified agree. Bitmasks are int32 rows over the
vocabulary as bytes (`tokenloom.structured.matcher`), applied by the rank that samples.
"""
from __future__ import annotations

import torch

from tokenloom.structured.jump_forward import forced_tokens
from tokenloom.structured.matcher import StructuredState, bitmask_row, draft_bitmasks


def next_token_bitmask(state: StructuredState, vocab_size: int, last_token: int) -> bytes | None:
    """The allowed next tokens of a constrained sequence that samples one token after `last_token`; None when
    nothing constrains it now (a reasoning phase, a finished or failed grammar). Where the grammar forces
    text (at the start of the output: later a forced stretch is appended with the token before it), only
    the first token of its canonical tokenization, so the stretch costs what the tokenizer writes it in."""
    forced = forced_tokens(state, last_token, 1)
    if forced:
        return one_token_row(forced[0], vocab_size)
    return bitmask_row(state, vocab_size)


def forced_token_logprobs(token: int, num_top: int) -> list[list[float]]:
    """A forced token's logprobs entry: logprob 0 at rank 1, the only token its position allows, as the
    sampler reports a position whose bitmask allows one token (it reads logprobs after the mask); its top
    list holds that token alone (the others have probability 0)."""
    return [[token, 0.0, 1]] + ([[token, 0.0, 1]] if num_top > 0 else [])


def one_token_row(token: int, vocab_size: int) -> bytes:
    """An int32 bitmask row over the vocabulary that allows `token` alone."""
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    word, bit = divmod(token, 32)
    row[word] = (1 << bit) - (1 << 32) if bit == 31 else 1 << bit
    return row.numpy().tobytes()


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
