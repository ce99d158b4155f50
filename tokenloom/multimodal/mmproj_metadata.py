"""A llama.cpp `mmproj` file's description of its vision tower: the `clip.*` metadata and the tensors' shapes.

llama.cpp keeps a vision-language model's image side in a GGUF of its own (general.architecture "clip"): the
tower's sizes under `clip.vision.*`, the projector's kind in `clip.projector_type`, the image normalisation in
`clip.vision.image_mean`/`image_std`, and tensors named `v.*` (the tower) and `mm.*` (the projector). This
reads the metadata and the tensor shapes only (memory-mapped, no tensor data, no torch), so the API process can
learn how many placeholders an image takes and how to preprocess it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gguf import GGUFReader

from tokenloom.config import ConfigError
from tokenloom.core.json_types import JsonValue


@dataclass(frozen=True)
class MmprojFile:
    path: str
    metadata: dict[str, JsonValue]  # the clip.* keys
    tensor_shapes: dict[str, tuple[int, ...]]  # torch order (rows first)

    @property
    def projector_type(self) -> str:
        kind = self.metadata.get("clip.projector_type", self.metadata.get("clip.vision.projector_type"))
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"--mmproj {self.path}: the file names no clip.projector_type")
        return kind

    def vision_int(self, key: str, default: int | None = None) -> int:
        value = self.metadata.get(f"clip.vision.{key}", default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"--mmproj {self.path}: clip.vision.{key} must be a non-negative integer "
                              f"(got {value!r})")
        return value

    def vision_float(self, key: str, default: float) -> float:
        value = self.metadata.get(f"clip.vision.{key}", default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"--mmproj {self.path}: clip.vision.{key} must be a number (got {value!r})")
        return float(value)

    def vision_floats(self, key: str, length: int) -> list[float]:
        value = self.metadata.get(f"clip.vision.{key}")
        if not isinstance(value, list) or len(value) != length or not all(isinstance(v, (int, float))
                                                                           for v in value):
            raise ConfigError(f"--mmproj {self.path}: clip.vision.{key} must be {length} numbers (got {value!r})")
        return [float(v) for v in value]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.tensor_shapes:
            raise ConfigError(f"--mmproj {self.path}: the file lacks tensor {name}")
        return self.tensor_shapes[name]


def read_mmproj(path: str) -> MmprojFile:
    """The file's clip.* metadata and tensor shapes; a missing file, a file that is not a GGUF or a GGUF that
    is not an mmproj is a one-line ConfigError naming it."""
    if not os.path.isfile(path):
        raise ConfigError(f"--mmproj {path}: no such file")
    try:
        reader = GGUFReader(path, mode="r")
    except Exception as exc:  # the reader raises assorted errors on a bad file
        reason = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        raise ConfigError(f"--mmproj {path}: not a readable GGUF file ({reason})") from None
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != "clip":
        found = arch.contents() if arch is not None else None
        raise ConfigError(f"--mmproj {path}: not an mmproj file (general.architecture {found!r}, want 'clip'); "
                          f"the model file goes first, the mmproj after --mmproj")
    metadata = {key: field.contents() for key, field in reader.fields.items() if key.startswith("clip.")}
    if metadata.get("clip.has_vision_encoder") is False:
        raise ConfigError(f"--mmproj {path}: the file has no vision encoder (clip.has_vision_encoder is false)")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return MmprojFile(path, metadata, shapes)
