"""Bidirectional attention over a packed sequence cut into independent segments (the images of a batch, or
the windows of an image), with torch's SDPA and no variable-length kernel.

The segments are gathered into a padded [segments, longest, heads, head_dim] batch; a padded key is masked
out, a padded query is computed and dropped. One SDPA call serves every segment, where a loop of one call per
segment (transformers' path without flash-attention) costs a Python round trip per window: a 1024x1024 image
has 100 windows per windowed block in Qwen2.5-VL.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class PackedSegments:
    """The gather pattern of one segmentation, built once per forward and shared by every layer using it."""

    def __init__(self, lengths: Sequence[int], device: torch.device):
        lengths_t = torch.tensor(list(lengths), dtype=torch.long, device=device)
        longest = int(lengths_t.max())
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        offsets = torch.arange(longest, device=device)
        self.present = offsets[None, :] < lengths_t[:, None]
        # A padded slot reads row 0; its key is masked and its query's output is dropped.
        self.gather = torch.where(self.present, starts[:, None] + offsets[None, :], 0)
        self.all_full = bool(self.present.all())
        self.key_mask = None if self.all_full else self.present[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [rows, heads, head_dim] -> [rows, heads, head_dim], each row attending within its segment."""
        if self.all_full:  # equal segments: a reshape, no gather
            q, k, v = (x.reshape(*self.gather.shape, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        else:
            q, k, v = (x[self.gather].transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.key_mask).transpose(1, 2)
        return out.reshape(-1, *out.shape[2:]) if self.all_full else out[self.present]
