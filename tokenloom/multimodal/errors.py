"""The error of an image the engine will not take: a 400 on the server, naming the image's field."""
from __future__ import annotations

from tokenloom.core.errors import RequestValidationError


class ImageInputError(RequestValidationError):
    """An image that cannot be used: undecodable, too large, too many, from a source not allowed, or sent to a
    model that reads no images."""

    def __init__(self, message: str, param: str | None = "image"):
        super().__init__(message, param, "invalid_image")
