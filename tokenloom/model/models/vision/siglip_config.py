"""SigLIP vision tower hyper-parameters (a checkpoint's `vision_config` with model_type siglip_vision_model)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue
from tokenloom.model.models.vision.activations import VISION_ACTIVATIONS
from tokenloom.model.models.vision.vision_config_fields import float_field, int_field, str_field


@dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"vision_config.hidden_size {self.hidden_size} is not a multiple of "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.image_size % self.patch_size:
            raise ConfigError(f"vision_config.image_size {self.image_size} is not a multiple of "
                              f"patch_size {self.patch_size}")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not one of "
                              f"{', '.join(VISION_ACTIVATIONS)}")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, JsonValue]) -> SiglipVisionConfig:
        return cls(
            hidden_size=int_field(vision_config, "hidden_size"),
            intermediate_size=int_field(vision_config, "intermediate_size"),
            num_hidden_layers=int_field(vision_config, "num_hidden_layers"),
            num_attention_heads=int_field(vision_config, "num_attention_heads"),
            image_size=int_field(vision_config, "image_size"),
            patch_size=int_field(vision_config, "patch_size"),
            num_channels=int_field(vision_config, "num_channels", 3),
            layer_norm_eps=float_field(vision_config, "layer_norm_eps", 1e-6),
            hidden_act=str_field(vision_config, "hidden_act", "gelu_pytorch_tanh"),
        )
