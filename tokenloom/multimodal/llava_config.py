"""LLaVA's config.json, typed: the CLIP tower's sizes, which of its layers feed the projector, and the
placeholder token. Read by the frontend (how many placeholder tokens an image takes) and by the model.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonObject, JsonValue

LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)
SELECT_STRATEGIES = ("default", "full")  # default: drop the CLS row; full: keep it


@dataclass(frozen=True)
class CLIPVisionSizes:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class LlavaConfig:
    image_token_index: int
    vision: CLIPVisionSizes
    feature_layers: tuple[int, ...]  # hidden-state indices (HF's: 0 the embeddings, -1 the last layer)
    select_strategy: str
    projector_hidden_act: str
    projector_bias: bool
    text_hidden_size: int

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and encoder rows) per image."""
        return self.vision.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def num_tower_layers(self) -> int:
        """Encoder layers the tower must run: up to the deepest one a feature is taken from."""
        n = self.vision.num_layers
        return max(i % (n + 1) for i in self.feature_layers)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, JsonValue]) -> "LlavaConfig":
        vision = cfg.get("vision_config") or {}
        text = cfg.get("text_config") or {}
        if not isinstance(vision, dict) or not isinstance(text, dict):
            raise ConfigError("config.json: vision_config and text_config must be objects")
        layers = cfg.get("vision_feature_layer", -2)
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        strategy = cfg.get("vision_feature_select_strategy", "default")
        if strategy not in SELECT_STRATEGIES:
            raise ConfigError(f"config.json: vision_feature_select_strategy {strategy!r} is not one of "
                              f"{', '.join(SELECT_STRATEGIES)}")
        sizes = CLIPVisionSizes(
            hidden_size=_int(vision, "hidden_size", 768), intermediate_size=_int(vision, "intermediate_size", 3072),
            num_layers=_int(vision, "num_hidden_layers", 12), num_heads=_int(vision, "num_attention_heads", 12),
            image_size=_int(vision, "image_size", 224), patch_size=_int(vision, "patch_size", 32),
            num_channels=_int(vision, "num_channels", 3),
            layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)),
            hidden_act=str(vision.get("hidden_act", "quick_gelu")))
        if any(not -sizes.num_layers - 1 <= i <= sizes.num_layers for i in layers):
            raise ConfigError(f"config.json: vision_feature_layer {layers} outside the tower's "
                              f"{sizes.num_layers} layers")
        return cls(image_token_index=_int(cfg, "image_token_index", 32000, positive=False), vision=sizes,
                   feature_layers=layers, select_strategy=strategy,
                   projector_hidden_act=str(cfg.get("projector_hidden_act", "gelu")),
                   projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
                   text_hidden_size=_int(text, "hidden_size", 4096))


def _int(cfg: JsonObject, name: str, default: int, positive: bool = True) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0) or value < 0:
        raise ConfigError(f"config.json: {name} must be a {'positive' if positive else 'non-negative'} integer "
                          f"(got {value!r})")
    return value
