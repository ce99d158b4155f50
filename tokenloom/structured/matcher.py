"""Per-sequence constraint state in the engine, and the batch bitmask the runner applies.

`StructuredState` wraps an xgrammar `GrammarMatcher` (made from a compiled grammar that may
still be compiling: it is only waited for when the sequence first samples) and an optional
`ThinkingTracker` (constraints start after the reasoning ends; a spent thinking budget forces
the end marker). The scheduler turns a state into a bitmask row (`bitmask_row`) for each
sequence that samples; the worker that samples masks the logits with them
(`apply_token_bitmask`). A batch without constrained rows costs nothing.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from tokenloom.structured.thinking import ANSWER, REASONING, UNDECIDED, ThinkingTracker

if TYPE_CHECKING:
    import xgrammar as xgr

    from tokenloom.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger("tokenloom.structured")


class StructuredState:
    """One sequence's matcher and reasoning phase. `ready` yields (compiled grammar or None, tracker
    factory or None, the tokenizer or None); the tokenizer writes the text a grammar forces as tokens
    (`tokenloom.structured.jump_forward`), and without one nothing is forced."""

    def __init__(self, ready: Future, stop_token_ids: list[int]) -> None:
        self.ready = ready
        self.stop_token_ids = list(stop_token_ids)
        self.matcher: xgr.GrammarMatcher | None = None
        self.thinking: ThinkingTracker | None = None
        self.tokenizer: Tokenizer | None = None
        self.failed: str | None = None
        self._materialized = False

    def fork(self) -> "StructuredState":
        """A fresh state for a sibling sequence (forks happen before any output token: a forced stretch is
        appended after each sibling's first sampled token)."""
        return StructuredState(self.ready, self.stop_token_ids)

    def _materialize(self) -> None:
        if self._materialized:
            return
        self._materialized = True
        try:
            compiled, make_tracker, self.tokenizer = self.ready.result()
            if compiled is not None:
                import xgrammar as xgr  # lazy: xgrammar imports torch (~2 s), for structured requests only
                self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_token_ids or None)
            self.thinking = make_tracker() if make_tracker is not None else None
        except Exception as e:  # noqa: BLE001 - the request fails alone
            self.failed = f"{type(e).__name__}: {e}"
            logger.warning("structured output setup failed: %s", self.failed)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this sequence's allowed tokens into bitmask[row]; False when the row is unconstrained."""
        self._materialize()
        if self.failed:
            return False
        t = self.thinking
        if t is not None:
            forced = t.forced_token
            if forced is not None:
                bitmask[row].zero_()
                _set_bit(bitmask, row, forced)
                return True
            if t.phase == REASONING or (t.phase == UNDECIDED and self.matcher is None):
                return False
        m = self.matcher
        if m is None or m.is_terminated():
            return False
        need = m.fill_next_token_bitmask(bitmask, row)
        if t is not None and t.phase == UNDECIDED and t.single_start_id is not None:
            _set_bit(bitmask, row, t.single_start_id)  # the model may still open its reasoning
            need = True
        return bool(need)

    def accept(self, token: int) -> str | None:
        """Advance past a sampled token; returns a finish reason ("stop" once the grammar is done, "error"
        if the token broke it) or None to go on."""
        self._materialize()
        if self.failed:
            return "error"
        t = self.thinking
        if t is not None:
            if t.phase == UNDECIDED and self.matcher is not None:
                if t.single_start_id is not None and token == t.single_start_id:
                    t.phase = REASONING
                    return None
                t.phase = ANSWER
            elif t.phase != ANSWER:
                is_answer, rest = t.observe(token)
                if not is_answer:
                    if rest and self.matcher is not None and not self.matcher.accept_string(rest):
                        return self._reject(token)
                    return None
        m = self.matcher
        if m is None:
            return None
        if not m.accept_token(token):
            if token in self.stop_token_ids:
                return None  # a stop token ends the request anyway
            return self._reject(token)
        return "stop" if m.is_terminated() else None

    def _reject(self, token: int) -> str:
        logger.warning("token %d violates the grammar; ending the sequence", token)
        self.failed = f"token {token} violates the grammar"
        return "error"


def _set_bit(bitmask: torch.Tensor, row: int, token: int) -> None:
    word, bit = divmod(token, 32)
    if word < bitmask.shape[1]:
        value = int(bitmask[row, word]) | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


def bitmask_row(state: StructuredState, vocab_size: int) -> bytes | None:
    """The sequence's allowed next tokens as an int32 bitmask (bytes, to cross the step contract), or None
    when nothing constrains it. The scheduler computes it; the rank that samples applies it."""
    row = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    return row.numpy().tobytes() if state.fill(row, 0) else None


def draft_bitmasks(state: StructuredState, drafts: list[int], vocab_size: int) -> tuple[list[bytes | None], int] | None:
    """Bitmasks for a speculative verify span: the allowed tokens after the sequence, then after each draft.

    The matcher advances over the drafts the grammar allows (stopping at the first it forbids, or at a stop
    token) and is rolled back afterwards: the scheduler advances it for real over the tokens the target
    accepts. Returns (masks, drafts kept); len(masks) == kept + 1. None when the state cannot be
    advanced tentatively (reasoning phases, a failed grammar): then the sequence decodes without drafts."""
    state._materialize()
    m = state.matcher
    if state.failed or state.thinking is not None or m is None or m.is_terminated():
        return None
    words = (vocab_size + 31) // 32
    masks: list[bytes | None] = []
    kept = 0
    try:
        for j in range(len(drafts) + 1):
            if m.is_terminated():  # the grammar ended with the previous draft: the sequence stops there
                masks.append(None)
                break
            row = torch.full((1, words), -1, dtype=torch.int32)
            masks.append(row.numpy().tobytes() if m.fill_next_token_bitmask(row, 0) else None)
            if j == len(drafts):
                break
            d = drafts[j]
            word, bit = divmod(d, 32)
            allowed = word < words and (int(row[0, word]) >> bit) & 1
            if not allowed or d in state.stop_token_ids or not m.accept_token(d):
                break
            kept += 1
    finally:
        if kept:
            m.rollback(kept)
    return masks, kept


def apply_token_bitmask(logits: torch.Tensor, rows: list[bytes | None]) -> None:
    """Mask, in place, the logits [B, V] of the rows that have a bitmask."""
    constrained = [i for i, row in enumerate(rows) if row is not None]
    if not constrained:
        return
    B, V = logits.shape
    bitmask = torch.stack([torch.frombuffer(bytearray(rows[i]), dtype=torch.int32) for i in constrained])
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        import xgrammar as xgr  # lazy: xgrammar imports torch (~2 s), for structured requests only
        full = torch.full((B, bitmask.shape[1]), -1, dtype=torch.int32)
        full[constrained] = bitmask
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=V, indices=constrained)
        return
    idx = torch.tensor(constrained, dtype=torch.long, device=logits.device)
    bits = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().view(len(constrained), -1)[:, :V]
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
