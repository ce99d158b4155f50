"""Matmuls against block-quantized weights (csrc/quant_matmul.cpp): the ops, their torch references, fakes.

A quantized weight [N, K] is held as `qweight` uint8 (bits 4: two elements a byte, [N, K/2], byte j of a
32-element block holding element j in its low nibble and 16+j in its high one, as GGUF Q4_0/Q4_1 do;
bits 8: [N, K]) with float32 `scales` and `mins` [N, K/block]: w = q * scale + min, q unsigned.

- `quant_matmul` (exact): float32 activations times the weight dequantized inside the kernel.
- `quant_matmul_a8` (W4A8): activations quantized to int8 per 32-value block (scale amax/127, round half
  to even), integer dot products per block, then scaled: as llama.cpp multiplies Q4 by Q8 blocks.
"""
from __future__ import annotations

import torch

from tokenloom import kernels

ACTIVATION_BLOCK = 32


def unpack_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] in the kernel's 4-bit layout -> uint8 [N, K] one element a byte."""
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, 16)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(n, -1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values 0..15 -> the kernel's 4-bit layout [N, K/2]."""
    n = q.shape[0]
    blocks = q.reshape(n, -1, 32)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(n, -1).contiguous()


def unpacked(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_nibbles(qweight) if bits == 4 else qweight


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               block_size: int) -> torch.Tensor:
    """The float32 weight [N, K], each element q*scale + min rounded once (as the kernel's fma)."""
    q = unpacked(qweight, bits).double()
    n = q.shape[0]
    w = q.reshape(n, -1, block_size) * scales.double()[..., None] + mins.double()[..., None]
    return w.reshape(n, -1).float()


def quant_matmul_reference(x: torch.Tensor, qweight, scales, mins, bits: int, block_size: int) -> torch.Tensor:
    """Plain torch: x @ dequantize(...).T in float32."""
    return x.float() @ dequantize(qweight, scales, mins, bits, block_size).T


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [M, K] and float32 scales [M, K/32] of x, as the W4A8 kernel quantizes it."""
    m = x.shape[0]
    blocks = x.float().reshape(m, -1, ACTIVATION_BLOCK)
    amax = blocks.abs().amax(-1)
    # a true division (torch turns `127.0 / amax` into 127 * (1 / amax), one more rounding than the kernel's)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None])
    return q.reshape(m, -1).to(torch.int8), amax / 127.0


def quant_matmul_a8_reference(x: torch.Tensor, qweight, scales, mins, bits: int, block_size: int) -> torch.Tensor:
    """Plain torch W4A8: exact integer block dot products, each scaled by weight and activation scales."""
    x2 = x.reshape(-1, x.shape[-1])
    xq, dx = quantize_activations_reference(x2)
    q = unpacked(qweight, bits).double()
    n, k = q.shape
    # sum_j q_wj * q_xj per weight block, exact in float64
    prod = (xq.double()[:, None, :] * q[None, :, :]).reshape(x2.shape[0], n, k // block_size, block_size).sum(-1)
    xsum = xq.double().reshape(x2.shape[0], k // block_size, block_size).sum(-1)  # [M, K/bs]
    dx_w = dx.double().repeat_interleave(ACTIVATION_BLOCK // block_size, dim=1)  # [M, K/bs]
    out = (prod * scales.double()[None] * dx_w[:, None]).sum(-1) + (xsum * dx_w) @ mins.double().T
    return out.float().reshape(*x.shape[:-1], n)


def quant_matmul(x, qweight, scales, mins, bits: int, block_size: int) -> torch.Tensor:
    return torch.ops.tokenloom.quant_matmul(x, qweight, scales, mins, bits, block_size)


def quant_matmul_a8(x, qweight, scales, mins, bits: int, block_size: int) -> torch.Tensor:
    return torch.ops.tokenloom.quant_matmul_a8(x, qweight, scales, mins, bits, block_size)


def _register_fakes() -> None:
    for name in ("tokenloom::quant_matmul", "tokenloom::quant_matmul_a8"):
        @torch.library.register_fake(name)
        def _fake(x, qweight, scales, mins, bits, block_size):
            return x.new_empty((*x.shape[:-1], qweight.shape[0]))


if kernels.load():
    _register_fakes()
