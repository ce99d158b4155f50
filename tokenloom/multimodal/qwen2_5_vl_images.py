"""Qwen2.5-VL's side of a prompt's images. Its chat template writes `<|vision_start|><|image_pad|><|vision_end|>`
for each image; the one `<|image_pad|>` becomes one token per merged patch square of the image's grid (an image's
token count follows its size, `smart_resize`). Each image travels as its patch rows and its grid (frames, rows,
columns), which the tower and the text model's 3-stream positions both need.
"""
from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.core.multimodal import ImageInput
from tokenloom.multimodal.image_hash import image_content_hash
from tokenloom.multimodal.placeholders import expand_placeholders
from tokenloom.multimodal.qwen2_5_vl_preprocess import Qwen2VLPreprocessConfig, preprocess_images

# Qwen2.5-VL's released config.json values, for a file that leaves them out.
IMAGE_PAD_TOKEN_ID = 151655
DEFAULT_SPATIAL_MERGE_SIZE = 2
DEFAULT_PATCH_SIZE = 14


@dataclass(frozen=True)
class Qwen2_5_VLImageTokens:
    """What the frontend needs of a Qwen2.5-VL config.json: the placeholder and the tower's patch geometry."""

    image_token_id: int
    patch_size: int
    spatial_merge_size: int

    @classmethod
    def from_hf(cls, cfg: JsonObject) -> "Qwen2_5_VLImageTokens":
        vision = cfg.get("vision_config") or {}
        if not isinstance(vision, dict):
            raise ConfigError("config.json: vision_config must be an object")
        values = (cfg.get("image_token_id", IMAGE_PAD_TOKEN_ID), vision.get("patch_size", DEFAULT_PATCH_SIZE),
                  vision.get("spatial_merge_size", DEFAULT_SPATIAL_MERGE_SIZE))
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
            raise ConfigError(f"config.json: image_token_id, vision_config.patch_size and spatial_merge_size must "
                              f"be non-negative integers (got {values})")
        return cls(*values)


class Qwen2_5_VLImages:
    def __init__(self, tokens: Qwen2_5_VLImageTokens, preprocess: Qwen2VLPreprocessConfig):
        if (preprocess.patch_size, preprocess.merge_size) != (tokens.patch_size, tokens.spatial_merge_size):
            raise ConfigError(f"preprocessor_config.json cuts {preprocess.patch_size}-pixel patches merged "
                              f"{preprocess.merge_size} x {preprocess.merge_size}, but the vision tower takes "
                              f"{tokens.patch_size}-pixel patches merged {tokens.spatial_merge_size} x "
                              f"{tokens.spatial_merge_size}")
        self.tokens = tokens
        self.preprocess = preprocess

    @classmethod
    def from_configs(cls, model_config: JsonObject, preprocessor_config: JsonObject) -> "Qwen2_5_VLImages":
        return cls(Qwen2_5_VLImageTokens.from_hf(model_config), Qwen2VLPreprocessConfig.from_hf(preprocessor_config))

    @property
    def placeholder_token_id(self) -> int:
        return self.tokens.image_token_id

    def inputs(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        merge = self.preprocess.merge_size
        prepared = [preprocess_images([image], self.preprocess) for image in images]
        lengths = [pixels.tokens_per_image(merge)[0] for pixels in prepared]
        ids, offsets = expand_placeholders(token_ids, self.placeholder_token_id, lengths)
        inputs = []
        for pixels, offset, length in zip(prepared, offsets, lengths):
            grid = [int(v) for v in pixels.image_grid_thw[0]]
            values = pixels.pixel_values
            inputs.append(ImageInput(content_hash=image_content_hash(values, tuple(grid)),
                                     pixel_values=values.tobytes(), shape=list(values.shape), offset=offset,
                                     length=length, grid_thw=grid))
        return ids, inputs
