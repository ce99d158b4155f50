"""What the vision-language models share: their text model answers for the decoder (forward, logits, the native
stack), and an image's preprocessed pixels reach the worker as float32 bytes (tokenloom.core.multimodal)."""
from __future__ import annotations

import numpy as np
import torch

from tokenloom.core.multimodal import ImageInput
from tokenloom.model.layers.attention import AttentionMetadata
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.stack_spec import NativeStackSpec


def pixel_tensor(image: ImageInput) -> torch.Tensor:
    """The image's preprocessed pixels as a float32 tensor of their shape (a copy: the request's bytes are
    read-only)."""
    return torch.from_numpy(np.frombuffer(image.pixel_values, np.float32).reshape(tuple(image.shape)).copy())


class VisionLanguageModel(InferenceModule):
    """A vision encoder beside a text model (`self.language_model`, set by the subclass): the encoder's rows replace
    the image placeholders' embeddings, and from there on the text model runs as it does alone."""

    language_model: InferenceModule

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.language_model.model(input_ids, positions, kv_caches, meta, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def native_stack_spec(self) -> NativeStackSpec | str:
        """The text model's: steps without image rows (decodes, text-only prompts) may run on the native stack."""
        return self.language_model.native_stack_spec()
