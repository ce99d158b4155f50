"""CLIP's vision transformer, as transformers' CLIPVisionModel computes it, up to the layer a LLaVA
projector reads: patch embedding (a stride-`patch` convolution) with a CLS row in front, learned positions,
a pre-norm, then pre-norm encoder layers with bidirectional attention. The final layers past the deepest one
read, and the post-norm, are never computed (LLaVA 1.5 reads the penultimate layer).

Parameter names are the checkpoint's below `vision_tower.` (`vision_model.` in older files); the tower runs
whole on every tensor-parallel rank (0.3 B parameters against the text model's 7 B).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.models.vision.activations import activation
from tokenloom.multimodal.llava_config import CLIPVisionSizes


class CLIPVisionEmbeddings(InferenceModule):
    def __init__(self, sizes: CLIPVisionSizes):
        super().__init__()
        d = sizes.hidden_size
        self.class_embedding = nn.Parameter(torch.empty(d))
        self.patch_embedding = nn.Conv2d(sizes.num_channels, d, sizes.patch_size, sizes.patch_size, bias=False)
        self.position_embedding = nn.Embedding(sizes.num_patches + 1, d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(InferenceModule):
    def __init__(self, sizes: CLIPVisionSizes):
        super().__init__()
        d = sizes.hidden_size
        self.num_heads, self.head_dim = sizes.num_heads, d // sizes.num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t):
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class CLIPMLP(InferenceModule):
    def __init__(self, sizes: CLIPVisionSizes):
        super().__init__()
        self.fc1 = nn.Linear(sizes.hidden_size, sizes.intermediate_size)
        self.fc2 = nn.Linear(sizes.intermediate_size, sizes.hidden_size)
        self.act = activation(sizes.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(InferenceModule):
    def __init__(self, sizes: CLIPVisionSizes):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(sizes.hidden_size, eps=sizes.layer_norm_eps)
        self.self_attn = CLIPAttention(sizes)
        self.layer_norm2 = nn.LayerNorm(sizes.hidden_size, eps=sizes.layer_norm_eps)
        self.mlp = CLIPMLP(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(InferenceModule):
    def __init__(self, sizes: CLIPVisionSizes, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(sizes) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CLIPVisionTower(InferenceModule):
    def __init__(self, sizes: CLIPVisionSizes, num_layers: int):
        """`num_layers`: the encoder layers computed (the checkpoint may hold more)."""
        super().__init__()
        self.sizes = sizes
        self.embeddings = CLIPVisionEmbeddings(sizes)
        self.pre_layrnorm = nn.LayerNorm(sizes.hidden_size, eps=sizes.layer_norm_eps)  # the checkpoint's spelling
        self.encoder = CLIPEncoder(sizes, num_layers)

    def hidden_states(self, pixel_values: torch.Tensor, indices: tuple[int, ...]) -> list[torch.Tensor]:
        """[B, patches + 1, D] hidden states at HF's `hidden_states` indices (0: after the pre-norm; i: after
        encoder layer i; negative from the full tower's end)."""
        total = self.sizes.num_layers
        wanted = [i % (total + 1) for i in indices]
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        states = {0: x}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            states[i] = x
        return [states[i] for i in wanted]
