"""An image's content hash: the same pixels give the same hash whatever file they came in.

It hashes what the vision tower consumes (the preprocessed float32 pixels and their shape), so two requests
share an encoder-cache entry, and prefix-cache blocks, exactly when the tower would compute the same rows.
"""
from __future__ import annotations

import hashlib

import numpy as np


def image_content_hash(pixels: np.ndarray, grid_thw: tuple[int, ...] = ()) -> str:
    """`grid_thw`: the patch grid of pixels listed as patches (Qwen2.5-VL), which the shape alone does not
    pin down (a 4 x 8 and an 8 x 4 grid both list 32 patches)."""
    h = hashlib.sha256()
    h.update(np.asarray((*pixels.shape, *grid_thw), dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.hexdigest()
