"""On-disk cache of a GGUF model's dequantized weights, so a warm start skips parsing and dequantizing.

Entries live in `$TOKENLOOM_CACHE_DIR/weights` (default `~/.cache/tokenloom/weights`), keyed by the
file's absolute path, size, mtime and the runtime dtype; `TOKENLOOM_WEIGHT_CACHE=0` turns it off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Iterator

import torch

from tokenloom.model.arch_config import ArchConfig

_FORMAT = 1


def enabled() -> bool:
    return os.environ.get("TOKENLOOM_WEIGHT_CACHE", "1") != "0"


def _folder() -> Path:
    return Path(os.environ.get("TOKENLOOM_CACHE_DIR") or Path.home() / ".cache" / "tokenloom") / "weights"


def entry_stem(path: str, dtype: torch.dtype) -> Path:
    st = os.stat(path)
    raw = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{_FORMAT}"
    return _folder() / hashlib.sha256(raw.encode()).hexdigest()[:32]


class CachedWeights:
    """A cache hit: the architecture and the tensors, memory-mapped from safetensors."""

    def __init__(self, stem: Path):
        self.stem = stem
        with open(f"{stem}.json") as f:
            self.arch_config = ArchConfig(**json.load(f))
        from safetensors import safe_open
        with safe_open(f"{stem}.safetensors", framework="pt") as f:
            self.num_tensors = len(f.keys())

    @staticmethod
    def lookup(path: str, dtype: torch.dtype) -> "CachedWeights | None":
        if not enabled():
            return None
        stem = entry_stem(path, dtype)
        if os.path.isfile(f"{stem}.json") and os.path.isfile(f"{stem}.safetensors"):
            try:
                return CachedWeights(stem)
            except (OSError, ValueError, TypeError):
                return None
        return None

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open
        with safe_open(f"{self.stem}.safetensors", framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def store(path: str, dtype: torch.dtype, arch: ArchConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Write an entry atomically; a failure (read-only home, full disk) only costs the next start time."""
    if not enabled():
        return
    from safetensors.torch import save_file
    stem = entry_stem(path, dtype)
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{stem}.{os.getpid()}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, f"{stem}.safetensors")
        with open(f"{tmp}.json", "w") as f:
            json.dump(dataclasses.asdict(arch), f)
        os.replace(f"{tmp}.json", f"{stem}.json")
    except OSError:
        pass
