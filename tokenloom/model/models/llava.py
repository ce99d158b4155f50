"""LLaVA (1.5 and its relatives): a CLIP vision tower, a two-layer projector, and a Llama-family text model.

An image's encoder rows are `encode(pixel_values)`: the tower's hidden states at `vision_feature_layer` (one
index, or several concatenated), without the CLS row under the "default" strategy, through
linear -> activation -> linear into the text model's width. The runner scatters them over the prompt's
placeholder rows (`forward(..., inputs_embeds=...)`); everything else is the text model's.

Checkpoint names: transformers writes them two ways, both read here. The original layout
(`language_model.model.*`, `language_model.lm_head.*`, `vision_tower.vision_model.*` or `vision_tower.*`,
`multi_modal_projector.*`) and the one of transformers 4.52+ (`model.language_model.*`, `lm_head.*`,
`model.vision_tower.*`, `model.multi_modal_projector.*`).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from tokenloom.core.multimodal import ImageInput
from tokenloom.model.arch_config import ArchConfig, UnsupportedModelError
from tokenloom.model.layers.attention_backend import AttentionBackend
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.models.llama import LlamaForCausalLM
from tokenloom.model.models.registry import register
from tokenloom.model.models.vision.activations import activation
from tokenloom.model.models.vision.clip_vision import CLIPVisionTower
from tokenloom.model.models.vision_language import VisionLanguageModel, pixel_tensor
from tokenloom.multimodal.llava_config import LlavaConfig

_TOWER_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


class LlavaProjector(InferenceModule):
    def __init__(self, llava: LlavaConfig):
        super().__init__()
        width = llava.vision.hidden_size * len(llava.feature_layers)
        self.linear_1 = nn.Linear(width, llava.text_hidden_size, bias=llava.projector_bias)
        self.linear_2 = nn.Linear(llava.text_hidden_size, llava.text_hidden_size, bias=llava.projector_bias)
        self.act = activation(llava.projector_hidden_act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


@register("LlavaForConditionalGeneration")
class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(self, cfg: ArchConfig, attention: AttentionBackend):
        super().__init__()
        if cfg.multimodal_config is None:
            raise UnsupportedModelError("a LLaVA model needs its config.json's vision_config")
        self.config = cfg
        self.llava = LlavaConfig.from_hf(cfg.multimodal_config)
        self.vision_tower = CLIPVisionTower(self.llava.vision, self.llava.num_tower_layers)
        self.multi_modal_projector = LlavaProjector(self.llava)
        self.language_model = LlamaForCausalLM(cfg, attention)
        for p in (*self.vision_tower.parameters(), *self.multi_modal_projector.parameters()):
            p.requires_grad_(False)

    @property
    def num_image_tokens(self) -> int:
        return self.llava.num_image_tokens

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, num_image_tokens, text_hidden] rows for B preprocessed images [B, 3, H, W]."""
        states = self.vision_tower.hidden_states(pixel_values, self.llava.feature_layers)
        if self.llava.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def encode_images(self, images: list[ImageInput], device: torch.device) -> list[torch.Tensor]:
        """One [num_image_tokens, text_hidden] tensor per image, the images of one pixel shape in one batch."""
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, im in enumerate(images):
            by_shape.setdefault(tuple(im.shape), []).append(i)
        rows: list[torch.Tensor | None] = [None] * len(images)
        for shape, group in by_shape.items():
            pixels = torch.stack([pixel_tensor(images[i]) for i in group]).to(device)
            for i, encoded in zip(group, self.encode(pixels)):
                rows[i] = encoded
        return rows

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)


    def checkpoint_names(self) -> set[str]:
        names = {f"language_model.{n}" for n in self.language_model.checkpoint_names()}
        names.update(f"vision_tower.{n}" for n, _ in self.vision_tower.named_parameters())
        names.update(f"multi_modal_projector.{n}" for n, _ in self.multi_modal_projector.named_parameters())
        return names

    def covered_names(self, name: str) -> tuple[str, ...]:
        """The expected name (checkpoint_names) a checkpoint tensor fills, whichever layout it is written in."""
        return (self._canonical(name) or name,)

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        canonical = self._canonical(name)
        if canonical is None:  # a tower layer past the deepest one read, or the unused post-norm
            return
        part, _, rest = canonical.partition(".")
        if part == "language_model":
            self.language_model.load_weight(rest, tensor)
            return
        target = getattr(self, part).get_parameter(rest)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, "
                             f"model {tuple(target.shape)}")
        target.data.copy_(tensor)

    def _canonical(self, name: str) -> str | None:
        """`name` in the original layout, with `vision_tower.` directly over the tower's modules; None for a
        tensor the model does not compute with."""
        if name.startswith("model.language_model."):
            return "language_model.model." + name.removeprefix("model.language_model.")
        if name.startswith("lm_head."):
            return "language_model." + name
        name = name.removeprefix("model.")
        if not name.startswith("vision_tower."):
            return name
        rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
        if rest.startswith("post_layernorm."):
            return None
        layer = _TOWER_LAYER.match(rest)
        if layer and int(layer.group(1)) >= self.llava.num_tower_layers:
            return None
        return "vision_tower." + rest
