"""Read a Hugging Face style folder: config.json and *.safetensors shards."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from tokenloom.core.json_types import JsonObject
from tokenloom.model.arch_config import ArchConfig, hf_architecture
from tokenloom.model.model_errors import CorruptModelError, naming_the_file, one_line
from tokenloom.model.models.registry import model_class


class HFModelFolder:
    def __init__(self, path: str):
        self.path = path
        config_path = os.path.join(path, "config.json")
        self.hf_config = _read_json(config_path)
        with naming_the_file(config_path):
            model_class(hf_architecture(self.hf_config))  # an unsupported class says so before its sizes are read
            self.arch_config = ArchConfig.from_hf(self.hf_config)
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise CorruptModelError(f"{path}: no *.safetensors files (tokenloom reads safetensors weights or GGUF; "
                                    f"not .bin or .pt)")
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            eos = _read_json(gen_path).get("eos_token_id")
            if eos is not None:
                self.arch_config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)

    @property
    def num_tensors(self) -> int:
        total = 0
        for file in self.files:
            with _open(file) as f:
                total += len(f.keys())
        return total

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with _open(file) as f:
                for name in f.keys():
                    try:
                        tensor = f.get_tensor(name)
                    except (SafetensorError, OSError) as exc:
                        raise CorruptModelError(f"{file}: tensor {name} could not be read ({one_line(exc)})") from None
                    yield name, tensor.to(dtype)


def _read_json(path: str) -> JsonObject:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptModelError(f"{path}: not valid JSON ({one_line(exc)})") from None
    if not isinstance(value, dict):
        raise CorruptModelError(f"{path}: not a JSON object")
    return value


def _open(file: str):
    """safe_open, with an unreadable file (cut short, not safetensors) as a CorruptModelError naming it."""
    try:
        return safe_open(file, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CorruptModelError(f"{file}: not a readable safetensors file ({one_line(exc)})") from None
