"""Gemma 3's side of a prompt's images. Its chat template writes `<start_of_image>` for each image; that token
becomes `<start_of_image>`, `mm_tokens_per_image` (256) `<image_soft_token>`s and `<end_of_image>`, as
transformers' Gemma3Processor expands it. The soft tokens are the image's placeholders (the rows the encoder
fills, and the span whose tokens attend to each other both ways); the two markers stay text tokens.

Gemma3Processor also puts a blank line ("\\n\\n") before and after the sequence; the expansion here works on
token ids, so a prompt that wants those writes them itself (the released chat template does not).
"""
from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject
from tokenloom.core.multimodal import ImageInput
from tokenloom.multimodal.errors import ImageInputError
from tokenloom.multimodal.gemma3_preprocess import SiglipPreprocessConfig, preprocess_images
from tokenloom.multimodal.image_hash import image_content_hash

# Gemma 3's released config.json values (transformers' Gemma3Config defaults), for a file that leaves them out.
BOI_TOKEN_ID = 255_999
EOI_TOKEN_ID = 256_000
IMAGE_SOFT_TOKEN_ID = 262_144
MM_TOKENS_PER_IMAGE = 256


@dataclass(frozen=True)
class Gemma3ImageTokens:
    """What the frontend and the model need of a Gemma 3 config.json: the three image tokens and the count."""

    boi_token_id: int = BOI_TOKEN_ID
    eoi_token_id: int = EOI_TOKEN_ID
    image_token_id: int = IMAGE_SOFT_TOKEN_ID
    mm_tokens_per_image: int = MM_TOKENS_PER_IMAGE

    @classmethod
    def from_hf(cls, cfg: JsonObject) -> "Gemma3ImageTokens":
        """transformers saves `*_token_index` (4.x) or `*_token_id`; either is read."""
        def field(name: str, default: int) -> int:
            value = cfg.get(f"{name}_token_index", cfg.get(f"{name}_token_id", default))
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"config.json: {name}_token_index must be a non-negative integer (got {value!r})")
            return value
        count = cfg.get("mm_tokens_per_image", MM_TOKENS_PER_IMAGE)
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ConfigError(f"config.json: mm_tokens_per_image must be a positive integer (got {count!r})")
        return cls(field("boi", BOI_TOKEN_ID), field("eoi", EOI_TOKEN_ID), field("image", IMAGE_SOFT_TOKEN_ID),
                   count)

    def expand(self, token_ids: list[int], num_images: int) -> tuple[list[int], list[int]]:
        """The prompt with each `<start_of_image>` followed by its soft tokens and `<end_of_image>`, and where
        each image's soft tokens start."""
        found = token_ids.count(self.boi_token_id)
        if found != num_images:
            raise ImageInputError(f"the prompt has {found} image placeholder(s) but {num_images} image(s) were "
                                  f"given (one <start_of_image> per image, in order)")
        expanded: list[int] = []
        offsets: list[int] = []
        for token in token_ids:
            expanded.append(token)
            if token == self.boi_token_id:
                offsets.append(len(expanded))
                expanded.extend([self.image_token_id] * self.mm_tokens_per_image)
                expanded.append(self.eoi_token_id)
        return expanded, offsets


class Gemma3Images:
    def __init__(self, tokens: Gemma3ImageTokens, preprocess: SiglipPreprocessConfig):
        self.tokens = tokens
        self.preprocess = preprocess

    @classmethod
    def from_configs(cls, model_config: JsonObject, preprocessor_config: JsonObject) -> "Gemma3Images":
        return cls(Gemma3ImageTokens.from_hf(model_config), SiglipPreprocessConfig.from_hf(preprocessor_config))

    @property
    def placeholder_token_id(self) -> int:
        return self.tokens.boi_token_id

    def inputs(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        ids, offsets = self.tokens.expand(token_ids, len(images))
        length = self.tokens.mm_tokens_per_image
        inputs = []
        for image, offset in zip(images, offsets):
            pixels = preprocess_images([image], self.preprocess)[0]
            inputs.append(ImageInput(content_hash=image_content_hash(pixels), pixel_values=pixels.tobytes(),
                                     shape=list(pixels.shape), offset=offset, length=length, attend_whole=True))
        return ids, inputs
