"""Images -> Qwen2.5-VL's `pixel_values` and `image_grid_thw`, as transformers' Qwen2VLImageProcessor makes them.

Each image is resized (bicubic) to the size `smart_resize` picks: both sides multiples of patch x merge
(28 pixels), the pixel count within [min_pixels, max_pixels], the aspect ratio kept as closely as that allows.
It is then cut into 14 x 14 patches listed merge square by merge square (the tower's order), each patch row
holding channels x temporal_patch_size x 14 x 14 values: a still image repeats its one frame.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue
from tokenloom.multimodal.clip_preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.image_pixels import (
    DEFAULT_RESCALE_FACTOR,
    RESAMPLING,
    RESAMPLING_BY_CODE,
    normalized_pixels,
)

# The reference processor refuses images more elongated than this.
MAX_ASPECT_RATIO = 200


class ImageSizeError(ImageInputError):
    """An image the processor cannot bring to a patch grid (empty, or too elongated)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio as close to the original's as those allow."""
    if min(height, width) < 1:
        raise ImageSizeError(f"an image of {width}x{height} pixels has no pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageSizeError(f"an image of {width}x{height} pixels is more elongated than "
                             f"{MAX_ASPECT_RATIO}:1")
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / shrink / factor) * factor)
        new_width = max(factor, math.floor(width / shrink / factor) * factor)
    elif new_height * new_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * grow / factor) * factor
        new_width = math.ceil(width * grow / factor) * factor
    return new_height, new_width


@dataclass(frozen=True)
class Qwen2VLPreprocessConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: str = "bicubic"
    rescale_factor: float = DEFAULT_RESCALE_FACTOR
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ConfigError(f"min_pixels {self.min_pixels} and max_pixels {self.max_pixels} must satisfy "
                              "0 < min_pixels <= max_pixels")
        if self.resample not in RESAMPLING:
            raise ConfigError(f"resample {self.resample!r} is not one of {', '.join(RESAMPLING)}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, processor_config: Mapping[str, JsonValue]) -> Qwen2VLPreprocessConfig:
        """From a preprocessor_config.json: `min_pixels`/`max_pixels`, or the newer
        `size: {shortest_edge, longest_edge}` spelling of the same bounds."""
        size = processor_config.get("size")
        size = size if isinstance(size, Mapping) else {}
        defaults = cls()
        resample_code = processor_config.get("resample", int(RESAMPLING["bicubic"]))
        if resample_code not in RESAMPLING_BY_CODE:
            raise ConfigError(f"resample {resample_code!r} is not a PIL resampling code "
                              f"({', '.join(f'{v}={k}' for k, v in RESAMPLING_BY_CODE.items())})")
        return cls(
            min_pixels=int(processor_config.get("min_pixels", size.get("shortest_edge", defaults.min_pixels))),
            max_pixels=int(processor_config.get("max_pixels", size.get("longest_edge", defaults.max_pixels))),
            patch_size=int(processor_config.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(processor_config.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(processor_config.get("merge_size", defaults.merge_size)),
            resample=RESAMPLING_BY_CODE[resample_code],
            rescale_factor=float(processor_config.get("rescale_factor", defaults.rescale_factor)),
            image_mean=tuple(processor_config.get("image_mean", defaults.image_mean)),
            image_std=tuple(processor_config.get("image_std", defaults.image_std)),
        )


@dataclass(frozen=True)
class Qwen2VLImageInputs:
    pixel_values: np.ndarray  # [patches, channels * temporal_patch_size * patch_size**2] float32
    image_grid_thw: np.ndarray  # [images, 3] int64: frames, patch rows, patch columns

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """Placeholder tokens each image takes in the prompt (one per merge square of patches)."""
        return [int(t * h * w) // (merge_size * merge_size) for t, h, w in self.image_grid_thw]


def patchify(pixels: np.ndarray, config: Qwen2VLPreprocessConfig) -> np.ndarray:
    """[channels, height, width] -> [patches, patch values], patches merge square by merge square."""
    channels, height, width = pixels.shape
    p, m = config.patch_size, config.merge_size
    rows, cols = height // p, width // p
    blocks = pixels.reshape(channels, rows // m, m, p, cols // m, m, p)
    # -> square row, square column, row in square, column in square, channel, pixel row, pixel column
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], config.temporal_patch_size, p, p))
    return frames.reshape(rows * cols, channels * config.temporal_patch_size * p * p)


def preprocess_images(images: Sequence[Image.Image], config: Qwen2VLPreprocessConfig) -> Qwen2VLImageInputs:
    patches, grids = [], []
    for image in images:
        height, width = smart_resize(image.height, image.width, config.factor, config.min_pixels, config.max_pixels)
        pixels = normalized_pixels(image, height, width, config.resample, config.image_mean, config.image_std,
                                   config.rescale_factor)
        patches.append(patchify(pixels, config))
        grids.append((1, height // config.patch_size, width // config.patch_size))
    return Qwen2VLImageInputs(pixel_values=np.concatenate(patches), image_grid_thw=np.array(grids, dtype=np.int64))
