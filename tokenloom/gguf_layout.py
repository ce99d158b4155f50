"""What llama.cpp's converter does to a checkpoint's layout, undone where a GGUF is read.

For Llama and Mistral the converter permutes the rows of the q and k projections: it interleaves each head's
two rotary halves, for its own rotary kernel. Model weights and LoRA adapters (whose B matrices share those
rows) are read back through the same function.
"""
from __future__ import annotations

import torch


def unpermute_qk(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """The Hugging Face row order of a q or k tensor (rows on dim 0) that llama.cpp's converter permuted."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)
