"""Decoded image -> normalised float32 pixels, the steps every vision preprocessor shares, done as
transformers' PIL image processors do them so the numbers match theirs: transparency composited onto white,
a PIL resize of the 8-bit image, then x * rescale_factor in float64 rounded to float32, then
(x - mean) / std in float32.

numpy and Pillow only, no torch: preprocessing may run in a process that never loads a model.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from tokenloom.multimodal.image_decode import rgb

# The 8-bit -> [0, 1] factor of every released preprocessor_config.json.
DEFAULT_RESCALE_FACTOR = 1 / 255

RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# preprocessor_config.json states `resample` as PIL's integer code.
RESAMPLING_BY_CODE = {int(mode): name for name, mode in RESAMPLING.items()}


def normalized_pixels(image: Image.Image, height: int, width: int, resample: str, mean: Sequence[float],
                      std: Sequence[float], rescale_factor: float = DEFAULT_RESCALE_FACTOR) -> np.ndarray:
    """[3, height, width] float32: `image` in RGB, resized, rescaled and normalised per channel."""
    resized = rgb(image).resize((width, height), resample=RESAMPLING[resample])
    pixels = (np.asarray(resized).astype(np.float64) * rescale_factor).astype(np.float32)
    pixels = (pixels - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))
