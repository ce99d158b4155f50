"""An image as it crosses the engine boundary: preprocessed pixels, their content hash, and where in the
prompt its placeholder tokens sit.

The frontend decodes and preprocesses (tokenloom.multimodal, numpy only), so the engine receives exactly
what the vision tower consumes; the hash keys the encoder cache and enters the prefix cache's block hashes.
"""
from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, kw_only=True, array_like=True):
    """One image of a prompt. Its placeholder tokens are prompt positions offset .. offset + length - 1; the
    model replaces their embeddings with the image's `length` encoder rows."""

    content_hash: str  # sha256 hex of the preprocessed pixels and their shape
    pixel_values: bytes  # float32, C-contiguous, `shape`
    shape: list[int]  # [channels, height, width]; Qwen2.5-VL: [patches, values per patch]
    offset: int
    length: int
    grid_thw: list[int] = []  # Qwen2.5-VL: the patch grid (frames, rows, columns); empty for fixed-size towers
    # Gemma 3: the placeholders attend to each other both ways in prefill, so a prefill chunk holds all of the
    # ones still to compute or none (a chunk ending inside the image would compute its first rows blind to
    # the rest).
    attend_whole: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its placeholder positions lies in [start, end)."""
        return self.offset < end and start < self.end
