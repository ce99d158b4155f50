"""The Qwen2.5-VL vision tower: pixel patches of any number of images -> one row per merged token, in the text
model's width (transformers' `Qwen2_5_VisionTransformerPretrainedModel`, the checkpoint's `visual.*`).

A patch row (channels x 2 frames x 14 x 14 pixels) is embedded by one linear map (the checkpoint's Conv3d
kernel equals its stride, so the convolution is a matmul over the flattened patch). The blocks are pre-norm
transformer blocks with RMSNorm, a 2-D rotary embedding (half the rotated pairs turn with the patch's row, half
with its column) and a gated MLP; most attend inside windows of `window_size` pixels, the
`fullatt_block_indexes` ones over each whole frame. The rows are kept in window order through the blocks and
put back in the processor's order after the merger, which folds each 2x2 square of patches into one token.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenloom.kernels import layer_ops
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.norm import RMSNorm
from tokenloom.model.models.vision.activations import VISION_ACTIVATIONS
from tokenloom.model.models.vision.packed_attention import PackedSegments
from tokenloom.model.models.vision.qwen2_5_vl_config import Qwen2_5_VLVisionConfig
from tokenloom.model.models.vision.qwen2_5_vl_grid import (
    GridInput,
    frame_lengths,
    grids_of,
    patch_positions,
    window_layout,
)
from tokenloom.multimodal.errors import ImageInputError

# The norms' epsilon: fixed in the reference implementation, absent from the config.
VISION_NORM_EPS = 1e-6


class Qwen2_5_VisionPatchEmbed(InferenceModule):
    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(
            config.hidden_size, config.in_channels, config.temporal_patch_size, config.patch_size,
            config.patch_size), requires_grad=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixel_values.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()


class Qwen2_5_VisionRotary(InferenceModule):
    """cos/sin of the 2-D rotary embedding for patches at given (row, column) positions."""

    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        self.register_buffer("inv_freq", self._inv_freq(torch.device("cpu")), persistent=False)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        axis_dim = self.head_dim // 2
        return 1.0 / (self.theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float, device=device) / axis_dim))

    def rebuild_buffers(self, device: torch.device) -> None:
        self.inv_freq = self._inv_freq(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [rows, 2] -> cos, sin: [rows, head_dim / 2], the row's angles then the column's (the
        rotate-half layout pairs element i with i + head_dim / 2)."""
        angles = (positions[..., None].float() * self.inv_freq).flatten(1)
        return angles.cos(), angles.sin()


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [rows, heads, head_dim] rotated by each row's own angles (cos, sin: [rows, head_dim / 2])."""
    if layer_ops.native(q) and cos.dtype == torch.float32:
        # The native op reads a position's angles from a table: here each row is its own position.
        rows = torch.arange(q.shape[0], device=q.device)
        return torch.ops.tokenloom.rotary_embedding(rows, q, k, cos, sin)
    return layer_ops.rotate_half(q, cos[:, None], sin[:, None]), layer_ops.rotate_half(k, cos[:, None], sin[:, None])


class Qwen2_5_VisionAttention(InferenceModule):
    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                segments: PackedSegments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, -1).unbind(1)
        q, k = rotate_qk(q, k, *rotary)
        out = segments.attend(q, k, v)
        return self.proj(out.reshape(x.shape[0], -1))


class Qwen2_5_VisionMLP(InferenceModule):
    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act = VISION_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Qwen2_5_VisionBlock(InferenceModule):
    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, VISION_NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, VISION_NORM_EPS)
        self.attn = Qwen2_5_VisionAttention(config)
        self.mlp = Qwen2_5_VisionMLP(config)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                segments: PackedSegments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, segments)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VisionMerger(InferenceModule):
    """Normalises each patch, concatenates each merge square's patches and maps them to the text width."""

    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        merged = config.hidden_size * config.merge_unit
        self.ln_q = RMSNorm(config.hidden_size, VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, config.out_hidden_size))
        self.merged = merged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2_5_VisionTower(InferenceModule):
    # Qwen2_5_VLForConditionalGeneration checkpoints name this module `visual` (released and transformers 5
    # saves alike; transformers' own in-memory name is model.visual).
    CHECKPOINT_PREFIXES = (("visual.", ""), ("model.visual.", ""))

    def __init__(self, config: Qwen2_5_VLVisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = Qwen2_5_VisionPatchEmbed(config)
        self.rotary = Qwen2_5_VisionRotary(config)
        self.blocks = nn.ModuleList(Qwen2_5_VisionBlock(config) for _ in range(config.depth))
        self.merger = Qwen2_5_VisionMerger(config)
        self.full_attention_blocks = frozenset(config.fullatt_block_indexes)

    def tokens_per_image(self, image_grid_thw: GridInput) -> list[int]:
        return [t * h * w // self.config.merge_unit for t, h, w in grids_of(image_grid_thw)]

    def checked_grids(self, pixel_values: torch.Tensor,
                      image_grid_thw: GridInput) -> list[tuple[int, int, int]]:
        """The grids, once they and the pixel rows are known to fit this tower and each other."""
        cfg = self.config
        grids = grids_of(image_grid_thw)
        if not grids:
            raise ImageInputError("no images to encode")
        if pixel_values.dim() != 2 or pixel_values.shape[1] != cfg.patch_pixels:
            raise ImageInputError(f"pixel_values must be [patches, {cfg.patch_pixels}], "
                                   f"got {list(pixel_values.shape)}")
        bad = [g for g in grids if min(g) <= 0 or g[1] % cfg.spatial_merge_size or g[2] % cfg.spatial_merge_size]
        if bad:
            raise ImageInputError(f"image_grid_thw rows {bad} are not positive multiples of the merge size "
                                   f"{cfg.spatial_merge_size}")
        if sum(t * h * w for t, h, w in grids) != pixel_values.shape[0]:
            raise ImageInputError(f"image_grid_thw describes {sum(t * h * w for t, h, w in grids)} patches, "
                                   f"pixel_values has {pixel_values.shape[0]}")
        return grids

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor,
               image_grid_thw: GridInput) -> list[torch.Tensor]:
        """pixel_values: [patches, patch_pixels] of every image, image_grid_thw: [images, 3] -> one
        [tokens, out_hidden_size] tensor per image."""
        grids = self.checked_grids(pixel_values, image_grid_thw)
        return list(self.forward(pixel_values, grids).split(self.tokens_per_image(grids)))

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        cfg = self.config
        device, unit = pixel_values.device, cfg.merge_unit
        window_tokens = cfg.window_size // (cfg.patch_size * cfg.spatial_merge_size)
        order, window_lengths = window_layout(grids, cfg.spatial_merge_size, window_tokens)
        order = order.to(device)
        windows = PackedSegments(window_lengths, device)
        frames = PackedSegments(frame_lengths(grids), device)

        def window_ordered(rows: torch.Tensor) -> torch.Tensor:
            return rows.reshape(-1, unit, *rows.shape[1:])[order].flatten(0, 1)

        x = window_ordered(self.patch_embed(pixel_values))
        cos, sin = self.rotary(window_ordered(patch_positions(grids, cfg.spatial_merge_size).to(device)))
        for index, block in enumerate(self.blocks):
            x = block(x, (cos, sin), frames if index in self.full_attention_blocks else windows)
        return self.merger(x)[torch.argsort(order)]
