"""Where each patch of a Qwen2.5-VL image sits and which patches attend together: pure functions of the
images' patch grids (`image_grid_thw`: frames, patch rows, patch columns per image).

The processor lays the patches of an image out merge-block by merge-block: each spatial_merge_size x
spatial_merge_size square of neighbouring patches is contiguous (it becomes one text token), and the squares
run row-major. The tower then regroups those squares window by window, so that each attention window is a
contiguous run of rows; `window_layout` gives that order and the run lengths.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.multimodal.errors import ImageInputError

GridTHW = tuple[int, int, int]
# image_grid_thw as the processor returns it (numpy), as transformers passes it (a tensor), or as plain rows.
GridInput = torch.Tensor | np.ndarray | Sequence[Sequence[int]]


def grids_of(image_grid_thw: GridInput) -> list[GridTHW]:
    """`image_grid_thw` as (frames, rows, columns) tuples of Python ints."""
    rows = image_grid_thw.tolist() if isinstance(image_grid_thw, (torch.Tensor, np.ndarray)) else image_grid_thw
    if any(len(row) != 3 for row in rows):
        raise ImageInputError(f"image_grid_thw rows must be (frames, rows, columns), got {rows!r}")
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def patch_positions(grids: Sequence[GridTHW], merge: int) -> torch.Tensor:
    """[num_patches, 2] (row, column) of every patch, in the processor's merge-block order; every frame of a
    video repeats its image's positions (the tower's rotary embedding is 2-D)."""
    positions = []
    for frames, rows, cols in grids:
        row = torch.arange(rows).view(rows // merge, merge, 1, 1).expand(-1, -1, cols // merge, merge)
        col = torch.arange(cols).view(1, 1, cols // merge, merge).expand(rows // merge, merge, -1, -1)
        block_major = torch.stack([row.permute(0, 2, 1, 3).flatten(), col.permute(0, 2, 1, 3).flatten()], dim=-1)
        positions.append(block_major.repeat(frames, 1))
    return torch.cat(positions)


def frame_lengths(grids: Sequence[GridTHW]) -> list[int]:
    """Patches per frame, image after image: the segments of the full-attention blocks."""
    return [rows * cols for frames, rows, cols in grids for _ in range(frames)]


def window_layout(grids: Sequence[GridTHW], merge: int, window_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """(order, lengths): `order` lists the merged tokens (indices into the processor's order) window by window,
    each window a `window_tokens` x `window_tokens` square of merged tokens, windows row-major within a frame
    (the right and bottom edge windows are smaller when the grid does not divide); `lengths` is the number
    of patches in each window, in that order."""
    order, lengths = [], []
    offset = 0
    for frames, rows, cols in grids:
        token_rows, token_cols = rows // merge, cols // merge
        tokens = torch.arange(frames * token_rows * token_cols).view(frames, token_rows, token_cols)
        pad_rows, pad_cols = -token_rows % window_tokens, -token_cols % window_tokens
        padded = F.pad(tokens, (0, pad_cols, 0, pad_rows), value=-1)
        windows_down = (token_rows + pad_rows) // window_tokens
        windows_across = (token_cols + pad_cols) // window_tokens
        windows = (padded.view(frames, windows_down, window_tokens, windows_across, window_tokens)
                   .permute(0, 1, 3, 2, 4).reshape(-1, window_tokens * window_tokens))
        present = windows >= 0
        order.append(windows[present] + offset)
        lengths.extend((present.sum(-1) * merge * merge).tolist())
        offset += tokens.numel()
    return torch.cat(order), lengths
