"""Logits processors the tests load by name (`--logits-processors logits_processor_examples:BanToken`), as a
user's own module would be loaded."""
from __future__ import annotations

import torch

from tokenloom import LogitsProcessor


class BanToken(LogitsProcessor):
    """Bans the token id a request names in its arguments: {"ban": id}."""

    @classmethod
    def validate_params(cls, params) -> None:
        ban = (params.extra_args or {}).get("ban")
        if ban is not None and not (isinstance(ban, int) and ban >= 0):
            raise ValueError(f"ban must be a token id (an int >= 0), got {ban!r}")

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        for i, row in enumerate(rows):
            ban = (row.params.extra_args or {}).get("ban")
            if ban is not None:
                logits[i, ban] = float("-inf")
        return logits


class RaiseWhenAsked(LogitsProcessor):
    """Raises in any step that holds a request asking for it: {"raise": true}."""

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        if any((row.params.extra_args or {}).get("raise") for row in rows):
            raise RuntimeError("this processor was asked to fail")
        return logits
