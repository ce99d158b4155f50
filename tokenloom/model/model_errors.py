"""The errors a model file or folder can raise while it loads, each one line naming the file and the reason.

A user sees these as they are: the CLI prints `tokenloom: error: <message>`, `tokenloom serve` reports the
engine's start-up failure in the same line, and the offline `LLM(...)` raises them. So a message must say
which file and what is wrong with it, without a traceback to read it from.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ModelFileError(ValueError):
    """A model the loader cannot use; the message names the file."""


class UnsupportedModelError(ModelFileError):
    """The model's architecture, quantization or layout is not supported."""


class CorruptModelError(ModelFileError):
    """The file is not what it claims to be: unreadable, cut short, missing keys or tensors, wrong shapes."""


def one_line(exc: BaseException) -> str:
    """The first line of a foreign library's message (some span several: a safetensors header dump)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


@contextmanager
def naming_the_file(path: str) -> Iterator[None]:
    """Re-raise a ModelFileError raised inside with `path` in front, unless it already names it (the model
    classes and layers know the tensor or setting at fault, not the file it came from)."""
    try:
        yield
    except ModelFileError as exc:
        message = str(exc)
        if path in message:
            raise
        raise type(exc)(f"{path}: {message}") from None
