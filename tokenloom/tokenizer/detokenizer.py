"""Streaming detokenization with stop strings."""
from __future__ import annotations

from collections.abc import Sequence

from tokenloom.tokenizer.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turn generated token ids into text deltas, one step at a time.

    Each step decodes only a short window of recent tokens and diffs it against the text already
    read (the prefix/read-offset technique). A multi-byte character split across tokens is held back
    until complete, so deltas never contain a spurious U+FFFD. With `stop` strings, text that could be
    the start of a stop string is held back (at most max(len(stop)) - 1 characters); once a stop string
    appears, `stop_reason` is set, `text` ends before it (or just after it, with
    `include_stop_str_in_output`) and nothing further is emitted. `text` is always the concatenation of
    the deltas returned so far; call `flush()` when the request ends to release held-back text.

    `spaces_between_special_tokens` is accepted for API compatibility; like vLLM's fast-tokenizer path,
    special tokens are joined exactly as the tokenizer's decoder renders them.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: str | None = None
        self.output_token_ids: list[int] = []
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._decoded = ""
        self._emitted = 0
        self._max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def text(self) -> str:
        """All output text released so far (the concatenation of every delta)."""
        return self._decoded[: self._emitted]

    @property
    def finished(self) -> bool:
        """True once a stop string has matched."""
        return self.stop_reason is not None

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly released text ("" if none, or after a stop)."""
        if self.finished:
            return ""
        self.output_token_ids.extend(new_token_ids)
        self._ids.extend(new_token_ids)
        self._decoded += self._read_new_text(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Release everything held back (incomplete characters, possible stop prefixes) at request end."""
        if self.finished:
            return ""
        self._decoded += self._read_new_text(final=True)
        return self._release(final=True)

    def _read_new_text(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix):]

    def _release(self, final: bool) -> str:
        if not self.stop:
            end = len(self._decoded)
        else:
            end = self._find_stop(len(self._decoded))
            if end is None:
                end = len(self._decoded) if final else len(self._decoded) - self._partial_stop_len()
        end = max(end, self._emitted)
        delta = self._decoded[self._emitted:end]
        self._emitted = end
        if self.finished:
            self._decoded = self._decoded[:end]
        return delta

    def _find_stop(self, new_len: int) -> int | None:
        """Set `stop_reason` on the earliest stop string in unreleased text; return where text ends."""
        start = max(0, self._emitted - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._decoded.find(s, start, new_len)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.stop_reason = s
        return i + len(s) if self.include_stop_str_in_output else i

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self._decoded
        limit = min(self._max_stop - 1, len(text) - self._emitted)
        for k in range(limit, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
