"""Gemma 3's multimodal projector (transformers' `Gemma3MultiModalProjector`, the checkpoint's
`multi_modal_projector.*`): the SigLIP tower's 64x64 patch grid average-pooled to `mm_tokens_per_image` (16x16 = 256)
tokens, RMS-normalised the Gemma way (scale 1 + weight), then mapped to the text width by one matrix stored
[vision_hidden, text_hidden] (so applied as x @ W, without a transpose)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.norm import GemmaRMSNorm


class Gemma3MultiModalProjector(InferenceModule):
    def __init__(self, vision_hidden: int, text_hidden: int, patches_per_side: int, tokens_per_side: int,
                 eps: float):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision_hidden, text_hidden),
                                                       requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision_hidden, eps)
        self.patches_per_side = patches_per_side
        self.pool = patches_per_side // tokens_per_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision_hidden] -> [images, tokens, text_hidden]."""
        images, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(images, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, kernel_size=self.pool, stride=self.pool).flatten(2).transpose(1, 2)
        return (self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight).to(patches.dtype)
