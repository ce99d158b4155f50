"""Jump-forward decoding: the text a grammar forces next, as the tokens the tokenizer would write it in.

A grammar often leaves one way on: the ``<tool_call>\\n{"name": "get_weather", "arguments": {"city": "``
scaffold of a forced tool call, a JSON schema's property names and punctuation. Sampled under the
bitmask, such a stretch costs an engine step per token, and a small model spells it in whatever pieces
the mask allows: on SmolLM2-135M-Instruct (2026-12, greedy) a required call's scaffold was unfinished
after 40 tokens (``<``, ``t``, ``oo``, ``l``, ...) where the tokenizer writes it in 21. Here the stretch
(xgrammar's `find_jump_forward_string`) becomes its canonical tokens: the scheduler appends them to the
sequence after its sampled token, in one step, and the next step computes their KV like a prefill chunk
before it samples again. Where the output starts with forced text, its first sample is restricted to the
first canonical token (`scheduler.structured_step.next_token_bitmask`).

Token boundary: the forced text is tokenized after the text of the sequence's last token (a tokenizer
may write the start of a text differently, e.g. SentencePiece's leading space); its tokens are used when
that last token comes back unchanged, else the forced text's own tokens are. Tokens are used only when
they decode to exactly the forced text and the grammar accepts each of them; otherwise nothing is forced
and the sequence samples under its bitmask as before.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.structured.thinking import ANSWER

if TYPE_CHECKING:
    import xgrammar as xgr

    from tokenloom.structured.matcher import StructuredState
    from tokenloom.tokenizer.tokenizer import Tokenizer


def forced_text(state: StructuredState) -> str:
    """The text the sequence's grammar forces next; '' when nothing is forced, or while the grammar does not
    apply (no grammar or tokenizer, a failed or finished grammar, reasoning not known to be over)."""
    state._materialize()
    m, t = state.matcher, state.thinking
    if state.failed or m is None or state.tokenizer is None or m.is_terminated():
        return ""
    if t is not None and t.phase != ANSWER:
        return ""
    return m.find_jump_forward_string()


def forced_tokens(state: StructuredState, last_token: int, limit: int) -> list[int]:
    """At most `limit` tokens of the forced text in its canonical tokenization, after `last_token` (the
    sequence's last token); [] when nothing is forced. The matcher is left where it was: the caller accepts
    the tokens as it appends them."""
    if limit <= 0:
        return []
    text = forced_text(state)
    if not text:
        return []
    tokenizer, matcher = state.tokenizer, state.matcher
    assert tokenizer is not None and matcher is not None  # forced_text checked both
    ids = canonical_tokens(tokenizer, text, last_token)[:limit]
    return ids if ids and _accepts(matcher, ids) else []


def canonical_tokens(tokenizer: Tokenizer, text: str, last_token: int) -> list[int]:
    """`text` as the tokenizer writes it after `last_token`: [] when no tokenization reproduces it exactly."""
    before = tokenizer.decode([last_token], skip_special_tokens=False)
    if before:
        ids = tokenizer.encode(before + text, add_special_tokens=False)
        if ids[:1] == [last_token] and _decodes_to(tokenizer, ids[1:], text):
            return ids[1:]
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if _decodes_to(tokenizer, ids, text) else []


def _decodes_to(tokenizer: Tokenizer, ids: list[int], text: str) -> bool:
    return bool(ids) and tokenizer.decode(ids, skip_special_tokens=False) == text


def _accepts(matcher: xgr.GrammarMatcher, ids: list[int]) -> bool:
    """Whether the grammar accepts `ids` in turn; the matcher is rolled back either way."""
    accepted = 0
    try:
        for token in ids:
            if not matcher.accept_token(token):
                return False
            accepted += 1
        return True
    finally:
        if accepted:
            matcher.rollback(accepted)
