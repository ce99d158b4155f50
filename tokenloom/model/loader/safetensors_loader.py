"""Read a Hugging Face style folder: config.json and *.safetensors shards."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

from tokenloom.model.arch_config import ArchConfig


class HFModelFolder:
    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "config.json")) as f:
            self.hf_config = json.load(f)
        self.arch_config = ArchConfig.from_hf(self.hf_config)
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise FileNotFoundError(f"{path}: no *.safetensors files")
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                self.arch_config.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)

    @property
    def num_tensors(self) -> int:
        total = 0
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                total += len(f.keys())
        return total

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)
