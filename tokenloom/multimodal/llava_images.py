"""LLaVA's side of a prompt's images: one `<image>` token per image, expanded to the tower's fixed row count,
the pixels CLIP-preprocessed to the tower's square."""
from __future__ import annotations

from PIL import Image

from tokenloom.core.json_types import JsonObject
from tokenloom.core.multimodal import ImageInput
from tokenloom.multimodal.clip_preprocess import CLIPPreprocessConfig, clip_preprocess
from tokenloom.multimodal.image_decode import rgb
from tokenloom.multimodal.image_hash import image_content_hash
from tokenloom.multimodal.llava_config import LlavaConfig
from tokenloom.multimodal.placeholders import expand_placeholders


class LlavaImages:
    def __init__(self, llava: LlavaConfig, preprocess: CLIPPreprocessConfig):
        self.llava = llava
        self.preprocess = preprocess

    @classmethod
    def from_configs(cls, model_config: JsonObject, preprocessor_config: JsonObject) -> "LlavaImages":
        return cls(LlavaConfig.from_hf(model_config), CLIPPreprocessConfig.from_json(preprocessor_config))

    @property
    def placeholder_token_id(self) -> int:
        return self.llava.image_token_index

    def inputs(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        length = self.llava.num_image_tokens
        ids, offsets = expand_placeholders(token_ids, self.placeholder_token_id, [length] * len(images))
        inputs = []
        for image, offset in zip(images, offsets):
            pixels = clip_preprocess(rgb(image), self.preprocess)
            inputs.append(ImageInput(content_hash=image_content_hash(pixels), pixel_values=pixels.tobytes(),
                                     shape=list(pixels.shape), offset=offset, length=length))
        return ids, inputs
