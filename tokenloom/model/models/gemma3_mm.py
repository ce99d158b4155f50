"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): the SigLIP tower and pooling projector
(vision/gemma3_vision.py) and tokenloom's Gemma 3 text model.

An image's encoder rows replace its `<image_soft_token>` rows after the text rows are embedded and scaled by
sqrt(hidden_size); the image rows are not scaled (transformers' Gemma3Model scatters them into the scaled
embeddings). In prefill the soft tokens of one image attend to each other both ways: the frontend marks each
image `attend_whole` (multimodal/gemma3_images.py), the scheduler keeps it in one chunk and the runner adds its
span to the chunk's causal mask (worker/image_attention.py); decoding is causal.

Checkpoint names: the released files write `language_model.model.*`, `vision_tower.vision_model.*` and
`multi_modal_projector.*`; transformers 5.24's `save_pretrained` the same with SigLIP one level up
(`vision_tower.*`); transformers 5's module names are `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*` and `lm_head.*`. All are read.
"""
from __future__ import annotations

import torch

from tokenloom.core.multimodal import ImageInput
from tokenloom.model.arch_config import ArchConfig, UnsupportedModelError
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.models.gemma3 import Gemma3ForCausalLM
from tokenloom.model.models.registry import register
from tokenloom.model.models.vision.gemma3_vision import Gemma3VisionConfig, Gemma3VisionEncoder
from tokenloom.model.models.vision_language import VisionLanguageModel, pixel_tensor
from tokenloom.multimodal.gemma3_images import Gemma3ImageTokens

_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


@register("Gemma3ForConditionalGeneration")
class Gemma3ForConditionalGeneration(VisionLanguageModel):
    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__()
        if cfg.multimodal_config is None or not isinstance(cfg.multimodal_config.get("vision_config"), dict):
            raise UnsupportedModelError("a Gemma 3 multimodal model needs its config.json's vision_config")
        self.config = cfg
        self.tokens = Gemma3ImageTokens.from_hf(cfg.multimodal_config)
        self.encoder = Gemma3VisionEncoder(Gemma3VisionConfig.from_hf(cfg.multimodal_config))
        self.language_model = Gemma3ForCausalLM(cfg, attention)
        for p in self.encoder.parameters():
            p.requires_grad_(False)

    def encode_images(self, images: list[ImageInput], device: torch.device) -> list[torch.Tensor]:
        """One [mm_tokens_per_image, text_hidden] tensor per image, all of them (one fixed size) in one batch."""
        pixels = torch.stack([pixel_tensor(im)
                              for im in images]).to(device)
        dtype = next(self.encoder.parameters()).dtype
        return self.encoder.encode(pixels.to(dtype))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed(input_ids)


    def checkpoint_names(self) -> set[str]:
        names = {f"language_model.{n}" for n in self.language_model.checkpoint_names()}
        names.update(f"encoder.{n}" for n, _ in self.encoder.named_parameters())
        return names

    def covered_names(self, name: str) -> tuple[str, ...]:
        """The expected name (checkpoint_names) a checkpoint tensor fills, whichever layout it is written in."""
        return (_canonical(name),)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        part, _, rest = _canonical(name).partition(".")
        if part == "language_model":
            self.language_model.load_weight(rest, tensor)
            return
        if part != "encoder":
            raise ValueError(f"unexpected tensor {name} in a Gemma 3 checkpoint")
        target = self.encoder.get_parameter(rest)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.data.copy_(tensor)


def _canonical(name: str) -> str:
    """`name` as checkpoint_names spells it: `language_model.` + the text model's own name, or `encoder.` + the
    encoder's parameter name."""
    for prefix, text_name in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return "language_model." + text_name + name.removeprefix(prefix)
    for prefix, encoder_name in Gemma3VisionEncoder.CHECKPOINT_PREFIXES:
        if name.startswith(prefix):
            return "encoder." + encoder_name + name.removeprefix(prefix)
    return name
