"""CLIP's image preprocessing, as transformers' CLIPImageProcessor (PIL backend) does it, so the pixels
match its to float32 rounding: resize the shortest edge (PIL, the config's filter, on the 8-bit image),
center crop (zero padding where the image is smaller), x * rescale_factor in float64 rounded to float32,
then (x - mean) / std in float32. LLaVA 1.5 uses it with a 336-pixel square crop.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL's code for the filter CLIP's configs name


@dataclass(frozen=True)
class CLIPPreprocessConfig:
    """The fields of a preprocessor_config.json that CLIPImageProcessor reads."""

    shortest_edge: int | None = 224  # None: resize to (resize_height, resize_width)
    resize_height: int | None = None
    resize_width: int | None = None
    crop_height: int = 224
    crop_width: int = 224
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    resample: int = BICUBIC

    @classmethod
    def from_json(cls, cfg: Mapping[str, JsonValue]) -> "CLIPPreprocessConfig":
        size = cfg.get("size", {"shortest_edge": 224})
        crop = cfg.get("crop_size", {"height": 224, "width": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if not isinstance(size, dict) or not isinstance(crop, dict):
            raise ConfigError(f"preprocessor_config.json: size and crop_size must be objects (got {size!r}, "
                              f"{crop!r})")
        try:
            return cls(shortest_edge=size.get("shortest_edge"), resize_height=size.get("height"),
                       resize_width=size.get("width"), crop_height=int(crop["height"]), crop_width=int(crop["width"]),
                       do_resize=bool(cfg.get("do_resize", True)), do_center_crop=bool(cfg.get("do_center_crop", True)),
                       do_rescale=bool(cfg.get("do_rescale", True)),
                       rescale_factor=float(cfg.get("rescale_factor", 1 / 255)),
                       do_normalize=bool(cfg.get("do_normalize", True)),
                       image_mean=tuple(float(v) for v in cfg.get("image_mean", OPENAI_CLIP_MEAN)),
                       image_std=tuple(float(v) for v in cfg.get("image_std", OPENAI_CLIP_STD)),
                       resample=int(cfg.get("resample", BICUBIC)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"preprocessor_config.json: {type(exc).__name__} {exc}") from None

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize: the shortest edge to `shortest_edge`, the other in proportion
        (truncated, as torchvision and transformers do)."""
        if self.shortest_edge is None:
            return self.resize_height, self.resize_width
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)


def clip_preprocess(image: Image.Image, config: CLIPPreprocessConfig) -> np.ndarray:
    """[3, crop_height, crop_width] float32 pixels of an RGB image."""
    if config.do_resize:
        height, width = config.resized_size(image.height, image.width)
        image = image.resize((width, height), resample=Image.Resampling(config.resample))
    pixels = np.asarray(image).transpose(2, 0, 1)
    if config.do_center_crop:
        pixels = center_crop(pixels, config.crop_height, config.crop_width)
    if config.do_rescale:
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
        pixels = (pixels - mean) / std
    return np.ascontiguousarray(pixels, dtype=np.float32)


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """The centre [C, height, width] of channel-first pixels, zero-padded (centred) where they are smaller."""
    _, h, w = pixels.shape
    top, left = (h - height) // 2, (w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top:top + height, left:left + width]
    canvas = np.zeros((pixels.shape[0], max(h, height), max(w, width)), dtype=pixels.dtype)
    pad_top, pad_left = -(-(canvas.shape[1] - h) // 2), -(-(canvas.shape[2] - w) // 2)
    canvas[:, pad_top:pad_top + h, pad_left:pad_left + w] = pixels
    top, left = (canvas.shape[1] - height) // 2, (canvas.shape[2] - width) // 2
    return canvas[:, top:top + height, left:left + width]
