"""Reasoning parsers: split a model's output into reasoning_content and content.

`ThinkReasoningParser` handles ``<think>...</think>`` (Qwen3, DeepSeek-R1 style). The prompt's
text tells whether reasoning is already open (a template that ends with ``<think>``) or closed
(``enable_thinking: false`` templates); otherwise the output must open it itself, and a model
that never does yields all content. One parser object serves one sequence: `extract()` for a
whole text, or `feed()` per delta then `finish()` when streaming; both give the same split.
"""
from __future__ import annotations

from tokenloom.structured.thinking import ANSWER, REASONING, UNDECIDED, prompt_phase


class ThinkReasoningParser:
    start = "<think>"
    end = "</think>"

    def __init__(self, prompt_text: str | None = None) -> None:
        self.initial = prompt_phase(prompt_text or "", self.start, self.end)
        self._text = ""
        self._sent = ("", "")

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning or None when the output has none, content). With final=False, text that could
        still turn into a marker is held back."""
        phase = self.initial
        body = text
        if phase == UNDECIDED:
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                phase, body = REASONING, stripped[len(self.start):]
            elif not final and self.start.startswith(stripped):
                return None, ""
            else:
                phase = ANSWER
        if phase == ANSWER:
            return None, text
        at = body.find(self.end)
        if at < 0:
            if not final:
                body = body[:len(body) - _partial_suffix(body, self.end)]
            return body.lstrip(), ""
        return body[:at].lstrip(), body[at + len(self.end):].lstrip()

    def extract(self, text: str) -> tuple[str | None, str]:
        return self.split(text, final=True)

    def feed(self, delta: str) -> tuple[str, str]:
        """Streaming: (reasoning delta, content delta) after appending `delta`."""
        self._text += delta
        return self._emit(self.split(self._text, final=False))

    def finish(self) -> tuple[str, str]:
        """Streaming: whatever was held back, once the output is complete."""
        return self._emit(self.split(self._text, final=True))

    def _emit(self, parts: tuple[str | None, str]) -> tuple[str, str]:
        reasoning, content = parts[0] or "", parts[1]
        sent_r, sent_c = self._sent
        # Held-back text only ever grows into these strings, so the already sent parts are prefixes.
        dr = reasoning[len(sent_r):] if reasoning.startswith(sent_r) else ""
        dc = content[len(sent_c):] if content.startswith(sent_c) else ""
        self._sent = (sent_r + dr, sent_c + dc)
        return dr, dc


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    "think": ThinkReasoningParser,
    "qwen3": ThinkReasoningParser,
    "deepseek_r1": ThinkReasoningParser,
}


def register_reasoning_parser(name: str, cls: type[ThinkReasoningParser]) -> None:
    REASONING_PARSERS[name] = cls


def get_reasoning_parser(name: str) -> type[ThinkReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") \
            from None
