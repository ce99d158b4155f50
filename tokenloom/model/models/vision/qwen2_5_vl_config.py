"""The Qwen2.5-VL vision tower's hyper-parameters, read from the `vision_config` of a checkpoint's config.json."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue
from tokenloom.model.models.vision.activations import VISION_ACTIVATIONS
from tokenloom.model.models.vision.vision_config_fields import (
    float_field,
    int_field,
    int_list_field,
    str_field,
)

# The vision rotary base when the file states none: transformers' default for this tower.
DEFAULT_VISION_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class Qwen2_5_VLVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    # Pixels per side of one attention window (112 = 4 merged tokens of 28 pixels).
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = DEFAULT_VISION_ROPE_THETA

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config.hidden_size {self.hidden_size} is not a multiple of "
                              f"num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ConfigError(f"the vision head size {self.head_dim} must be a multiple of 4: its rotary "
                              "embedding splits it between the height and width axes")
        merged_patch = self.patch_size * self.spatial_merge_size
        if self.window_size % merged_patch:
            raise ConfigError(f"vision_config.window_size {self.window_size} is not a multiple of "
                              f"patch_size * spatial_merge_size = {merged_patch}")
        if any(not 0 <= i < self.depth for i in self.fullatt_block_indexes):
            raise ConfigError(f"vision_config.fullatt_block_indexes {list(self.fullatt_block_indexes)} name "
                              f"blocks outside 0..{self.depth - 1}")
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act {self.hidden_act!r} is not one of "
                              f"{', '.join(VISION_ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches folded into one text token (a spatial_merge_size x spatial_merge_size square)."""
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def patch_pixels(self) -> int:
        """Values in one row of `pixel_values`: channels x frames x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_hf(cls, vision_config: Mapping[str, JsonValue]) -> Qwen2_5_VLVisionConfig:
        rope = vision_config.get("rope_parameters")
        rope_theta = DEFAULT_VISION_ROPE_THETA
        if isinstance(rope, Mapping):
            rope_theta = float_field(rope, "rope_theta", DEFAULT_VISION_ROPE_THETA)
        # Released checkpoints spell the channel count `in_chans`; transformers' own configs `in_channels`.
        channels_key = "in_chans" if "in_chans" in vision_config else "in_channels"
        return cls(
            depth=int_field(vision_config, "depth"),
            hidden_size=int_field(vision_config, "hidden_size"),
            intermediate_size=int_field(vision_config, "intermediate_size"),
            num_heads=int_field(vision_config, "num_heads"),
            out_hidden_size=int_field(vision_config, "out_hidden_size"),
            patch_size=int_field(vision_config, "patch_size", 14),
            temporal_patch_size=int_field(vision_config, "temporal_patch_size", 2),
            spatial_merge_size=int_field(vision_config, "spatial_merge_size", 2),
            in_channels=int_field(vision_config, channels_key, 3),
            window_size=int_field(vision_config, "window_size", 112),
            fullatt_block_indexes=int_list_field(vision_config, "fullatt_block_indexes", (7, 15, 23, 31)),
            hidden_act=str_field(vision_config, "hidden_act", "silu"),
            rope_theta=rope_theta,
        )
