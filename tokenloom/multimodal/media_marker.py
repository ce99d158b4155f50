"""Where an image goes in a prompt for a GGUF text model whose vocabulary has no image token.

llama.cpp's mtmd marks each image with the text `<__media__>` and puts the image's embeddings there. tokenloom
does the same: the tokenizer gains the marker as one special token (an id past the text model's vocabulary),
the model family expands it into the image's placeholder run as its own image token, and each placeholder is
then written as `fill_id`, a token of the vocabulary: the encoder's rows replace those positions' embeddings,
so which token they hold never reaches the model.
"""
from __future__ import annotations

from typing import Protocol

from PIL import Image

from tokenloom.core.multimodal import ImageInput

MEDIA_MARKER = "<__media__>"  # llama.cpp mtmd's default marker


class PlaceholderFamily(Protocol):
    @property
    def placeholder_token_id(self) -> int: ...

    def inputs(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]: ...


class MarkedImages:
    def __init__(self, family: PlaceholderFamily, fill_id: int):
        self.family = family
        self.fill_id = fill_id

    @property
    def placeholder_token_id(self) -> int:
        return self.family.placeholder_token_id

    def inputs(self, token_ids: list[int], images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        ids, inputs = self.family.inputs(token_ids, images)
        marker = self.placeholder_token_id
        return [self.fill_id if t == marker else t for t in ids], inputs
