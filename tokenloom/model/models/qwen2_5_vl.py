"""Qwen2.5-VL: its vision tower (vision/qwen2_5_vl_vision.py) and a Qwen2 text model whose rotary is M-RoPE.

An image's encoder rows are the tower's `encode` of its patch rows and grid; the runner scatters them over the
prompt's `<|image_pad|>` rows. Positions: a prompt with images has three position streams per token
(`prompt_rope`, vision/mrope.py); text tokens, and every decoded token (`index + delta`), have all three
equal, so only a forward over image tokens passes [3, T] positions and every other one runs the plain text
path (`TextMRotaryEmbedding`).

Checkpoint names: the released files and a transformers 5 save write `model.*` (the text model), `lm_head.*`
and `visual.*`; transformers 4.5x saves wrote `model.language_model.*` and `model.visual.*`. Both are read.
"""
from __future__ import annotations

import torch

from tokenloom.core.multimodal import ImageInput
from tokenloom.model.arch_config import ArchConfig, UnsupportedModelError, mrope_section
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.models.qwen2 import Qwen2ForCausalLM
from tokenloom.model.models.registry import register
from tokenloom.model.models.vision.mrope import PromptRope, TextMRotaryEmbedding, mrope_positions
from tokenloom.model.models.vision.qwen2_5_vl_config import Qwen2_5_VLVisionConfig
from tokenloom.model.models.vision.qwen2_5_vl_vision import Qwen2_5_VisionTower
from tokenloom.model.models.vision_language import VisionLanguageModel, pixel_tensor
from tokenloom.multimodal.qwen2_5_vl_images import Qwen2_5_VLImageTokens


@register("Qwen2_5_VLForConditionalGeneration")
class Qwen2_5_VLForConditionalGeneration(VisionLanguageModel):
    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__()
        if cfg.multimodal_config is None or not isinstance(cfg.multimodal_config.get("vision_config"), dict):
            raise UnsupportedModelError("a Qwen2.5-VL model needs its config.json's vision_config")
        self.config = cfg
        self.tokens = Qwen2_5_VLImageTokens.from_hf(cfg.multimodal_config)
        self.visual = Qwen2_5_VisionTower(Qwen2_5_VLVisionConfig.from_hf(cfg.multimodal_config["vision_config"]))
        self.language_model = Qwen2ForCausalLM(cfg, attention)
        rotary = TextMRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      mrope_section(cfg.multimodal_config))
        for layer in self.language_model.model.layers:
            layer.self_attn.rotary = rotary
        for p in self.visual.parameters():
            p.requires_grad_(False)

    def encode_images(self, images: list[ImageInput], device: torch.device) -> list[torch.Tensor]:
        """One [tokens, text_hidden] tensor per image: all of them through the tower in one packed call."""
        pixels = torch.cat([pixel_tensor(im)
                            for im in images]).to(device)
        dtype = next(self.visual.parameters()).dtype
        return self.visual.encode(pixels.to(dtype), [im.grid_thw for im in images])

    def prompt_rope(self, token_ids: list[int], images: list[ImageInput]) -> PromptRope:
        """The prompt's [3, P] positions and the decode delta."""
        positions, delta = mrope_positions(token_ids, self.tokens.image_token_id, [im.grid_thw for im in images],
                                           self.tokens.spatial_merge_size)
        return PromptRope(positions, delta)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)


    def checkpoint_names(self) -> set[str]:
        names = set(self.language_model.checkpoint_names())
        names.update(f"visual.{n}" for n, _ in self.visual.named_parameters())
        return names

    def covered_names(self, name: str) -> tuple[str, ...]:
        """The expected name (checkpoint_names) a checkpoint tensor fills, whichever layout it is written in."""
        return (_canonical(name),)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        name = _canonical(name)
        if not name.startswith("visual."):
            self.language_model.load_weight(name, tensor)
            return
        target = self.visual.get_parameter(name.removeprefix("visual."))
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.data.copy_(tensor)


def _canonical(name: str) -> str:
    """`name` in the released layout."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name
