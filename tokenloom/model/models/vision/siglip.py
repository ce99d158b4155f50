"""The SigLIP vision tower (transformers' `SiglipVisionModel` without its pooling head, which Gemma 3 does not
use): fixed-size images -> one row per patch. Pre-norm transformer blocks with LayerNorm, plain bidirectional
attention and a two-layer MLP, over patch embeddings plus a learned position embedding per patch.

The module tree is the checkpoint's: `vision_model.embeddings`, `vision_model.encoder.layers.N`,
`vision_model.post_layernorm`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.models.vision.activations import VISION_ACTIVATIONS
from tokenloom.model.models.vision.siglip_config import SiglipVisionConfig
from tokenloom.multimodal.errors import ImageInputError


class SiglipEmbeddings(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, kernel_size=config.patch_size,
                                         stride=config.patch_size)
        self.position_embedding = nn.Embedding(config.patches_per_side ** 2, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class SiglipAttention(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj = nn.Linear(size, size)
        self.k_proj = nn.Linear(size, size)
        self.v_proj = nn.Linear(size, size)
        self.out_proj = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, rows, _ = x.shape
        q, k, v = (proj(x).view(batch, rows, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, rows, -1))


class SiglipMLP(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act = VISION_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = SiglipAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = SiglipMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipTransformer(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class SiglipVisionTower(InferenceModule):
    def __init__(self, config: SiglipVisionConfig):
        super().__init__()
        self.config = config
        self.vision_model = SiglipTransformer(config)

    def check_inputs(self, pixel_values: torch.Tensor) -> None:
        cfg = self.config
        want = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ImageInputError(f"pixel_values must be [images, {', '.join(map(str, want))}], "
                             f"got {list(pixel_values.shape)}")

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, channels, size, size] -> [images, patches, hidden_size]."""
        return self.vision_model(pixel_values)
