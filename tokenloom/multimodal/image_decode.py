"""Bytes -> a decoded RGB image, within limits a client cannot exceed.

Pillow reads the header first: the pixel count is checked against `max_pixels` before any pixel is
decoded, so a small file that claims a huge canvas (a decompression bomb) costs nothing. A file Pillow
cannot identify, or whose data ends early, is an `ImageInputError`, never a stack trace.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from tokenloom.multimodal.errors import ImageInputError

# Formats a client may send. Pillow's other plug-ins (EPS through Ghostscript, PDF, ...) stay off the path.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be: its encoded size in bytes and its decoded size in pixels (width x height)."""

    max_bytes: int
    max_pixels: int


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image in `data`, decoded and converted to RGB (transparency composited onto white, as
    transformers' processors do)."""
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    if not data:
        raise ImageInputError("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
            width, height = image.size
            if width * height > limits.max_pixels:
                raise ImageInputError(f"the image is {width}x{height} pixels ({width * height}); the limit is "
                                      f"{limits.max_pixels} pixels")
            image.load()
    except ImageInputError:
        raise
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as exc:
        raise ImageInputError(f"the image is too large to decode ({exc})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageInputError(f"the data is not a decodable image ({type(exc).__name__}: {exc})") from None
    return rgb(image)


def rgb(image: Image.Image) -> Image.Image:
    """`image` in RGB, any transparency composited onto a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
