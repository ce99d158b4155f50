"""The 8-bit KV cache format (`--kv-cache-dtype int8`, also spelled `fp8` and `fp8_e4m3`).

Each token's K (and V) row of one KV head is stored as head_dim int8 values followed by its float32 scale
(4 bytes): a cache of dtype int8 and shape [2, blocks, block_size, kv_heads, head_dim + 4]. The scale is
amax / 127 of the row, so every value is round(x / scale) in [-127, 127] and reads back as value * scale.

Why int8 with a scale per token and head rather than float8 with one scale per tensor (vLLM's k_scale and
v_scale): a row's own scale follows the outliers of that token and head (no calibration pass), and the CPU
widens int8 to float32 in one instruction, where float8 e4m3 has no conversion before AVX512-FP16. Why the
scale inside the row rather than in a tensor beside the cache: a block stays self-contained, so everything
that moves blocks as bytes (prefix caching shares them, KV offload and prefill/decode transfer copy them)
carries the scales with no change. Head_dim 64 takes 68 bytes a row against 128 in bfloat16: 1.88x the tokens.

These torch functions are the reference for the native `write_kv_cache` and attention kernels
(csrc/attention.cpp, csrc/prefill_attention.cpp), which quantize and read the same bytes.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 per row
QMAX = 127.0


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """The last dimension of a cache in `kv_dtype`: head_dim, plus the scale's bytes for int8."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: each row's values and its float32 scale (amax / 127)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / QMAX
    values = torch.where(scale > 0, x / scale, torch.zeros((), device=x.device)).round_().clamp_(-QMAX, QMAX)
    return torch.cat([values.to(torch.int8), scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., D] in `dtype`: value * scale, computed in float32."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def read_rows(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows in `dtype`: dequantized from int8, converted from a float cache."""
    if cache_rows.dtype == torch.int8:
        return dequantize_rows(cache_rows, dtype)
    return cache_rows.to(dtype)


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] as a cache in `cache_dtype` stores them."""
    return quantize_rows(x) if cache_dtype == torch.int8 else x.to(cache_dtype)
