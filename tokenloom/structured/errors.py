"""The error every invalid constraint raises: a RequestValidationError (a 400 on the server)."""
from __future__ import annotations

from tokenloom.core.errors import RequestValidationError


class StructuredOutputError(RequestValidationError):
    """An invalid or unenforceable constraint; `param` names the request field, the message says what
    and where."""

    def __init__(self, message: str, param: str | None = "structured_outputs") -> None:
        super().__init__(message, param, "invalid_value")
