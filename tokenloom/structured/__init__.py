"""Structured outputs (xgrammar), reasoning-content and tool-call parsing.

Nothing here imports xgrammar at import time: requests without constraints pay nothing.
"""
from tokenloom.structured.errors import StructuredOutputError
from tokenloom.structured.spec import GrammarSpec, normalize_structured_outputs

__all__ = ["StructuredOutputError", "GrammarSpec", "normalize_structured_outputs"]
