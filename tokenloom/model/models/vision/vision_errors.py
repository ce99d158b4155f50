"""The error every vision input problem raises (pixels that disagree with their grid, placeholders that do not
match the images, an image no processor can handle): a client's mistake, which the server answers with an
OpenAI-shaped 400 like any other `RequestValidationError`."""
from __future__ import annotations

from tokenloom.core.errors import RequestValidationError


class VisionInputError(RequestValidationError):
    """Images or image placeholders a request sent that the encoder cannot take; the message says why."""

    def __init__(self, message: str, param: str | None = "image"):
        super().__init__(message, param, "invalid_image")
