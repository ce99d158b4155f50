"""The error of a request the engine will not run (a 400 on the server).

Its own module so that code on the engine process's side (structured outputs' constraint checks) can raise it
without importing the input processor, whose tokenizer pulls in `tokenizers` and jinja2: the engine's modules
cost 13.0 MiB of RSS over torch's with them, 6.2 MiB without, in a process that never tokenizes (docs/performance.md,
"Memory").
"""
from __future__ import annotations


class RequestValidationError(ValueError):
    """A request the engine will not run; `param` names the offending field, `code` is OpenAI's."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
