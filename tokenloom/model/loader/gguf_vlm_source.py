"""A vision-language model from two GGUF files, as llama.cpp users have it: the text model's GGUF and the
`mmproj` GGUF with the vision tower and projector (`tokenloom serve model.gguf --mmproj mmproj.gguf`).

The pair reads as the Hugging Face checkpoint of the same model: the architecture and config.json the two files'
metadata describe (tokenloom.multimodal.mmproj_config), the text model's tensors in transformers 5's layout
(`model.language_model.*`, `lm_head.*`: every vision-language class reads it), the tower's and projector's under
their checkpoint names (mmproj_tensors). So the model classes that serve a safetensors folder serve the pair
unchanged. The text model's quantized blocks stay quantized where they would alone (on the CPU's native kernels);
the tower and projector load dense.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch

from tokenloom.model.arch_config import ArchConfig
from tokenloom.model.loader.gguf_loader import GGUFModelFile
from tokenloom.model.loader.mmproj_tensors import MmprojTensors
from tokenloom.multimodal.mmproj_config import gguf_vision_config


class GGUFVisionLanguageSource:
    def __init__(self, model_path: str, mmproj_path: str):
        vision = gguf_vision_config(model_path, mmproj_path)
        self.text = GGUFModelFile(model_path)
        config = vision.model_config
        self.arch_config: ArchConfig = replace(self.text.arch_config, architecture=config["architectures"][0],
                                               multimodal_config=config)
        self.mmproj = MmprojTensors(mmproj_path, vision.projector_type, config["vision_config"]["hidden_size"])

    @property
    def num_tensors(self) -> int:
        return self.text.num_tensors + self.mmproj.num_tensors

    def tensors(self, dtype: torch.dtype, quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """`quantized`: the text model's 2-D weights in a type the native kernels multiply come as their blocks
        (GGUFModelFile.tensors); the tower's always dense."""
        for name, tensor in self.text.tensors(dtype, quantized=quantized):
            yield _text_name(name), tensor
        for name, tensor in self.mmproj.tensors():
            yield name, tensor.to(dtype)


def _text_name(name: str) -> str:
    return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name
