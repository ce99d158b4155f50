"""A multimodal model's frontend half: how its prompts take images.

`ImageProcessor.for_model` reads the model folder's config.json and preprocessor_config.json (None for a
model that reads no images), `for_gguf` the metadata of a GGUF and its mmproj file, and picks the family
(`FAMILIES`, by config.json's architecture) whose placeholders and preprocessing its prompts use; `prepare`
turns a tokenized prompt and its decoded images into the prompt with each placeholder expanded and one
`ImageInput` per image, ready for the engine.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Protocol

from PIL import Image

from tokenloom.config import ConfigError, MultiModalConfig
from tokenloom.core.json_types import JsonObject
from tokenloom.core.multimodal import ImageInput
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.gemma3_images import Gemma3Images
from tokenloom.multimodal.image_decode import ImageLimits, decode_image
from tokenloom.multimodal.llava_images import LlavaImages
from tokenloom.multimodal.media_marker import MEDIA_MARKER, MarkedImages
from tokenloom.multimodal.mmproj_config import gguf_vision_config
from tokenloom.multimodal.qwen2_5_vl_images import Qwen2_5_VLImages
from tokenloom.tokenizer import Tokenizer


class ModelImages(Protocol):
    """One model family's side of a prompt's images: its placeholder token, and how a prompt and its images
    become the expanded prompt and the engine's ImageInputs (a blocking call: preprocessing)."""

    @property
    def placeholder_token_id(self) -> int: ...

    def inputs(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]: ...


# config.json's architecture -> its family, built from config.json and preprocessor_config.json.
FAMILIES: dict[str, Callable[[JsonObject, JsonObject], ModelImages]] = {
    "LlavaForConditionalGeneration": LlavaImages.from_configs,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLImages.from_configs,
    "Gemma3ForConditionalGeneration": Gemma3Images.from_configs,
}


# config.json's architecture -> the text a prompt writes for each image, where no chat template renders image
# parts (a GGUF's template is its text model's).
IMAGE_TEXT = {"LlavaForConditionalGeneration": "<image>", "Gemma3ForConditionalGeneration": "<start_of_image>",
              "Qwen2_5_VLForConditionalGeneration": "<|vision_start|><|image_pad|><|vision_end|>"}


class ImageProcessor:
    def __init__(self, family: ModelImages, config: MultiModalConfig, image_text: str | None = None):
        """`image_text`: the text the chat renderer writes for an image part itself (a GGUF with its mmproj);
        None: the chat template renders `{"type": "image"}` parts (a model folder's)."""
        self.family = family
        self.config = config
        self.image_text = image_text
        self.limits = ImageLimits(config.max_image_bytes, config.max_image_pixels)

    @classmethod
    def for_gguf(cls, model_path: str, mmproj: str, config: MultiModalConfig,
                 tokenizer: Tokenizer) -> "ImageProcessor":
        """The processor of a GGUF text model and its llama.cpp mmproj file: the family of the model they make
        together, its settings from the two files' metadata (mmproj_config). A vocabulary without an image
        token gets llama.cpp's media marker (media_marker)."""
        vision = gguf_vision_config(model_path, mmproj)
        model_config = dict(vision.model_config)
        arch = model_config["architectures"][0]
        image_text = IMAGE_TEXT[arch]
        if vision.uses_marker:
            image_text = MEDIA_MARKER
            model_config["image_token_index"] = tokenizer.add_special_token(MEDIA_MARKER)
        family = FAMILIES[arch](model_config, vision.preprocessor_config)
        if vision.uses_marker:
            family = MarkedImages(family, tokenizer.unk_token_id or 0)
        return cls(family, config, image_text)

    @classmethod
    def for_model(cls, path: str | None, config: MultiModalConfig) -> "ImageProcessor | None":
        """The processor of the model at `path`, or None when it reads no images (a text model, a GGUF)."""
        if path is None or not os.path.isdir(path):
            return None
        model_config = _read_json(os.path.join(path, "config.json"))
        family = FAMILIES.get((model_config.get("architectures") or [None])[0])
        if family is None:
            return None
        preprocessor = os.path.join(path, "preprocessor_config.json")
        if not os.path.isfile(preprocessor):
            raise ConfigError(f"{path}: a vision-language model folder needs its preprocessor_config.json")
        return cls(family(model_config, _read_json(preprocessor)), config)

    @property
    def placeholder_token_id(self) -> int:
        return self.family.placeholder_token_id

    def decode(self, data: bytes) -> Image.Image:
        """An image sent as bytes, decoded within the configured limits (a blocking call: run it off the
        event loop)."""
        return decode_image(data, self.limits)

    def check_count(self, num_images: int) -> None:
        limit = self.config.max_images
        if num_images > limit:
            raise ImageInputError(f"the prompt has {num_images} images; at most {limit} are allowed per prompt "
                                  f"(--limit-mm-per-prompt)")

    def prepare(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with its placeholders expanded, and its images preprocessed (a blocking call)."""
        self.check_count(len(images))
        for image in images:
            if image.width * image.height > self.limits.max_pixels:
                raise ImageInputError(f"the image is {image.width}x{image.height} pixels; the limit is "
                                      f"{self.limits.max_pixels} pixels")
        return self.family.inputs(token_ids, images)


def _read_json(path: str) -> JsonObject:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return value
