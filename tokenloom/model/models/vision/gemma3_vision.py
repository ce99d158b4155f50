"""Gemma 3's image encoder: the SigLIP tower and the pooling projector, fixed-size images -> mm_tokens_per_image
rows each in the text model's width (transformers' `Gemma3Model.get_image_features`).

Parameter names are the released checkpoint's (`vision_tower.vision_model.*`, `multi_modal_projector.*`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.models.vision.gemma3_projector import Gemma3MultiModalProjector
from tokenloom.model.models.vision.siglip import SiglipVisionTower
from tokenloom.model.models.vision.siglip_config import SiglipVisionConfig
from tokenloom.model.models.vision.vision_config_fields import int_field


@dataclass(frozen=True)
class Gemma3VisionConfig:
    vision: SiglipVisionConfig
    text_hidden_size: int
    mm_tokens_per_image: int = 256

    def __post_init__(self) -> None:
        side = math.isqrt(self.mm_tokens_per_image)
        if side * side != self.mm_tokens_per_image:
            raise ConfigError(f"mm_tokens_per_image {self.mm_tokens_per_image} is not a square number")
        if self.vision.patches_per_side % side:
            raise ConfigError(f"the {self.vision.patches_per_side}x{self.vision.patches_per_side} patch grid does "
                              f"not pool evenly to {side}x{side} tokens (mm_tokens_per_image)")

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @classmethod
    def from_hf(cls, config: Mapping[str, JsonValue]) -> Gemma3VisionConfig:
        """From a Gemma3ForConditionalGeneration config.json (its vision_config and text_config)."""
        vision, text = config.get("vision_config"), config.get("text_config")
        if not isinstance(vision, Mapping) or not isinstance(text, Mapping):
            raise ConfigError("a Gemma 3 multimodal config needs vision_config and text_config sections")
        return cls(vision=SiglipVisionConfig.from_hf(vision), text_hidden_size=int_field(text, "hidden_size"),
                   mm_tokens_per_image=int_field(config, "mm_tokens_per_image", 256))


class Gemma3VisionEncoder(InferenceModule):
    # Parameter names are the released checkpoint's in full; transformers 5 saves SigLIP one level up.
    CHECKPOINT_PREFIXES = (
        ("vision_tower.vision_model.", "vision_tower.vision_model."),
        ("model.vision_tower.vision_model.", "vision_tower.vision_model."),
        ("vision_tower.", "vision_tower.vision_model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("multi_modal_projector.", "multi_modal_projector."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, config: Gemma3VisionConfig):
        super().__init__()
        self.config = config
        self.vision_tower = SiglipVisionTower(config.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(
            config.vision.hidden_size, config.text_hidden_size, config.vision.patches_per_side,
            config.tokens_per_side, config.vision.layer_norm_eps)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[images, 3, image_size, image_size] -> one [mm_tokens_per_image, text_hidden] tensor per image."""
        self.vision_tower.check_inputs(pixel_values)
        return list(self.forward(pixel_values).unbind(0))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))
