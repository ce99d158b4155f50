"""How one request ends badly in the API process (the engine's death is core_client.EngineDeadError)."""
from __future__ import annotations


class RequestFailedError(RuntimeError):
    """The engine failed this one request (the others go on)."""


class DuplicateRequestIdError(ValueError):
    """A request id that an open request already uses."""


class RequestTimeoutError(RuntimeError):
    """The request waited or ran longer than its timeout; it was aborted in the engine."""
