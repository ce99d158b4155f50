"""The error every vision input problem raises (pixels that disagree with their grid, placeholders that do not
match the images, an image no processor can handle): a client's mistake, for the server to answer with a 400."""
from __future__ import annotations


class VisionInputError(ValueError):
    """Images or image placeholders a request sent that the encoder cannot take; the message says why."""
