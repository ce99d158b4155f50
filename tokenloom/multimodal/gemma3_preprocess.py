"""Images -> Gemma 3's `pixel_values`, as transformers' Gemma3ImageProcessor (and SiglipImageProcessor) make
them: every image resized (bilinear, aspect ratio not kept) to the tower's fixed square, rescaled to [0, 1]
and normalised with mean = std = 0.5, so values lie in [-1, 1].

Pan-and-scan (extra crops of elongated images, off in the released configs) is not done: a config asking for
it is refused rather than silently ignored.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue
from tokenloom.multimodal.image_pixels import (
    DEFAULT_RESCALE_FACTOR,
    RESAMPLING,
    RESAMPLING_BY_CODE,
    normalized_pixels,
)

IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class SiglipPreprocessConfig:
    height: int = 896
    width: int = 896
    resample: str = "bilinear"
    rescale_factor: float = DEFAULT_RESCALE_FACTOR
    image_mean: tuple[float, float, float] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, float, float] = IMAGENET_STANDARD_STD

    def __post_init__(self) -> None:
        if self.height <= 0 or self.width <= 0:
            raise ConfigError(f"the image size {self.width}x{self.height} must be positive")
        if self.resample not in RESAMPLING:
            raise ConfigError(f"resample {self.resample!r} is not one of {', '.join(RESAMPLING)}")

    @classmethod
    def from_hf(cls, processor_config: Mapping[str, JsonValue]) -> SiglipPreprocessConfig:
        if processor_config.get("do_pan_and_scan"):
            raise ConfigError("do_pan_and_scan is not supported: set it to false in preprocessor_config.json")
        size = processor_config.get("size")
        if not isinstance(size, Mapping) or "height" not in size or "width" not in size:
            raise ConfigError(f"preprocessor_config.json size must be {{height, width}}, got {size!r}")
        defaults = cls()
        resample_code = processor_config.get("resample", int(RESAMPLING["bilinear"]))
        if resample_code not in RESAMPLING_BY_CODE:
            raise ConfigError(f"resample {resample_code!r} is not a PIL resampling code "
                              f"({', '.join(f'{v}={k}' for k, v in RESAMPLING_BY_CODE.items())})")
        return cls(
            height=int(size["height"]), width=int(size["width"]), resample=RESAMPLING_BY_CODE[resample_code],
            rescale_factor=float(processor_config.get("rescale_factor", defaults.rescale_factor)),
            image_mean=tuple(processor_config.get("image_mean", defaults.image_mean)),
            image_std=tuple(processor_config.get("image_std", defaults.image_std)),
        )


def preprocess_images(images: Sequence[Image.Image], config: SiglipPreprocessConfig) -> np.ndarray:
    """[images, 3, height, width] float32."""
    return np.stack([normalized_pixels(image, config.height, config.width, config.resample, config.image_mean,
                                       config.image_std, config.rescale_factor) for image in images])
