"""Engine-side reasoning tracker: where the output is (thinking or answer) and the thinking budget.

Markers are found in decoded text (robust to how the tokenizer splits them). A request starts
in ``reasoning`` when its prompt leaves a start marker open, ``answer`` when the prompt closed
it, else ``undecided`` until the output shows whether it opens one. Once a budget of N thinking
tokens is spent, the end marker's tokens are forced one per step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenloom.tokenizer.tokenizer import Tokenizer

REASONING, ANSWER, UNDECIDED = "reasoning", "answer", "undecided"
_TAIL_TOKENS = 16


def prompt_phase(prompt_text: str, start: str, end: str) -> str:
    """Phase at the start of the output, from the prompt's text."""
    s, e = prompt_text.rfind(start), prompt_text.rfind(end)
    if s > e:
        return REASONING
    return ANSWER if e >= 0 else UNDECIDED


class ThinkingTracker:
    def __init__(self, tokenizer: Tokenizer, start: str, end: str, prompt_ids: list[int], budget: int | None) -> None:
        self.tokenizer = tokenizer
        self.start, self.end = start, end
        self.end_ids = tokenizer.encode(end, add_special_tokens=False)
        start_ids = tokenizer.encode(start, add_special_tokens=False)
        self.single_start_id = start_ids[0] if len(start_ids) == 1 else None
        tail = tokenizer.decode(list(prompt_ids[-64:]), skip_special_tokens=False)
        self.phase = prompt_phase(tail, start, end)
        self.budget = budget
        self.num_thinking = 0
        self.forced: list[int] = []
        self._out: list[int] = []  # output tokens of the current phase (bounded)

    def copy(self) -> "ThinkingTracker":
        other = ThinkingTracker.__new__(ThinkingTracker)
        other.__dict__.update(self.__dict__)
        other.forced, other._out = list(self.forced), list(self._out)
        return other

    @property
    def forced_token(self) -> int | None:
        """The token that must come next (budget spent), or None."""
        if self.phase == REASONING and self.budget is not None and not self.forced \
                and self.num_thinking >= self.budget:
            self.forced = list(self.end_ids)
        return self.forced[0] if self.forced else None

    def observe(self, token: int) -> tuple[bool, str]:
        """Record one output token; returns (token belongs to the answer, answer text that followed the end
        marker inside the same token)."""
        if self.phase == ANSWER:
            return True, ""
        self._out.append(token)
        if self.phase == UNDECIDED:
            text = self.tokenizer.decode(self._out, skip_special_tokens=False).lstrip()
            if text.startswith(self.start):
                self.phase, self._out = REASONING, []
            elif not self.start.startswith(text):
                self.phase = ANSWER
                return True, ""
            return False, ""
        self.num_thinking += 1
        if self.forced:
            self.forced.pop(0)
            if not self.forced:
                self.phase, self._out = ANSWER, []
            return False, ""
        self._out = self._out[-_TAIL_TOKENS:]
        text = self.tokenizer.decode(self._out, skip_special_tokens=False)
        at = text.find(self.end)
        if at >= 0:
            self.phase, self._out = ANSWER, []
            return False, text[at + len(self.end):].lstrip()
        return False, ""
