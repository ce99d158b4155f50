"""An image's content hash: the same pixels give the same hash whatever file they came in.

It hashes what the vision tower consumes (the preprocessed float32 pixels and their shape), so two requests
share an encoder-cache entry, and prefix-cache blocks, exactly when the tower would compute the same rows.
"""
from __future__ import annotations

import hashlib

import numpy as np


def image_content_hash(pixels: np.ndarray) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(pixels.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.hexdigest()
