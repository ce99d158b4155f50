"""Matmuls against block-quantized weights (csrc/quant_matmul.cpp): the ops, their torch references, fakes.

A quantized weight [N, K] is held as `qweight` uint8 (bits 4: two elements a byte, [N, K/2], byte j of a
32-element block holding element j in its low nibble and 16+j in its high one, as GGUF Q4_0/Q4_1 do;
bits 8: [N, K]) with float32 `scales` and `mins` [N, K/block]: w = q * scale + min, q unsigned.

- `quant_matmul` (exact): float32 activations times the weight dequantized inside the kernel.
- `quant_matmul_a8` (W4A8): activations quantized to int8 per 32-value block (scale amax/127, round half
  to even), integer dot products per block, then scaled: as llama.cpp multiplies Q4 by Q8 blocks.

`quant_gemm` / `quant_gemm_a8` (csrc/quant_gemm.cpp) compute the same two products on the weight's
column-interleaved form (`interleave`): 16 output columns side by side, one SIMD lane each, so the kernels
need no horizontal sums and stay fast at hundreds of rows. `panel_rows` reads rows back out of that form
(the embedding lookup of a tied table that is only kept interleaved). The interleaved form keeps block
scales and mins in float16 where that is exact (`compact_scales`).
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


PANEL = 16          # output columns side by side in the interleaved form (one 512-bit vector of int32)
TILE_COLUMNS = 32   # columns a kernel tile: the interleaved N is padded to a multiple of it


def interleave(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-major blocks -> (qpacked uint8 [P, K/32, 16*32*bits/8], scales and mins float32 [P, K/block, 16]).

    P = N padded to 32, over 16. Per (panel, 32-block), 8-bit: group g (64 bytes) holds each column's
    elements 4g..4g+3 in its 4 bytes, columns side by side; 4-bit: 4 groups whose low nibbles are groups
    0..3 of the 8-bit form and high nibbles groups 4..7 (csrc/quant_gemm.cpp reads it so).
    """
    q = unpacked(qweight, bits)
    n, k = q.shape
    pad = -n % TILE_COLUMNS
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scales, mins = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scales, mins))
    panels = (n + pad) // PANEL
    groups = q.reshape(panels, PANEL, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [P, K/32, group, column, byte]
    if bits == 4:
        groups = groups[:, :, :4] | (groups[:, :, 4:] << 4)
    qpacked = groups.reshape(panels, k // 32, -1).contiguous()
    scales, mins = compact_scales(scales, mins)
    return (qpacked, *(t.reshape(panels, PANEL, -1).permute(0, 2, 1).contiguous() for t in (scales, mins)))


def compact_scales(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block scales and mins as float16 when every one of them is a float16 exactly, else as given.

    GGUF's Q4_0, Q4_1, Q8_0 and Q5_0 store float16 scales, and their mins are a scale times -8, -16 or
    -128 (or a float16 of the file): halving these bytes takes a batch-1 decode step of the embedded
    model from 115 to 96 MiB read, where the kernels are memory-bound. The kernels widen each back to
    float32 on load, so the products do not change by a bit. K-quants' scales (a float16 times a 6-bit
    integer) do not fit and stay float32.
    """
    half = (scales.half(), mins.half())
    if all(torch.equal(h.float(), t) for h, t in zip(half, (scales, mins))):
        return half
    return scales, mins


def panel_rows(qpacked: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weight rows (output columns) `rows` of the interleaved form: (uint8 [R, K] one element a byte,
    scales and mins [R, K/block]), the row-major form's `unpacked(...)[rows]`, `scales[rows]`, `mins[rows]`."""
    panels, nb = qpacked.shape[:2]
    groups = qpacked.reshape(panels, nb, -1, PANEL, 4)
    panel, lane = rows // PANEL, rows % PANEL
    got = groups[panel, :, :, lane]  # [R, K/32, groups, 4]
    if bits == 4:
        got = torch.cat([got & 0xF, got >> 4], dim=2)
    return got.reshape(rows.shape[0], -1), scales[panel, :, lane].float(), mins[panel, :, lane].float()


def quant_gemm(x, qpacked, scales, mins, n: int, bits: int, block_size: int) -> torch.Tensor:
    return torch.ops.tokenloom.quant_gemm(x, qpacked, scales, mins, n, bits, block_size)


def quant_gemm_a8(x, qpacked, scales, mins, n: int, bits: int, block_size: int) -> torch.Tensor:
    return torch.ops.tokenloom.quant_gemm_a8(x, qpacked, scales, mins, n, bits, block_size)


def quant_matmul(x, qweight, scales, mins, bits: int, block_size: int) -> torch.Tensor:
    return torch.ops.tokenloom.quant_matmul(x, qweight, scales, mins, bits, block_size)


def quant_matmul_a8(x, qweight, scales, mins, bits: int, block_size: int) -> torch.Tensor:
    return torch.ops.tokenloom.quant_matmul_a8(x, qweight, scales, mins, bits, block_size)


def _register_fakes() -> None:
    for name in ("tokenloom::quant_matmul", "tokenloom::quant_matmul_a8"):
        @torch.library.register_fake(name)
        def _fake(x, qweight, scales, mins, bits, block_size):
            return x.new_empty((*x.shape[:-1], qweight.shape[0]))
    for name in ("tokenloom::quant_gemm", "tokenloom::quant_gemm_a8"):
        @torch.library.register_fake(name)
        def _fake_gemm(x, qpacked, scales, mins, n, bits, block_size):
            return x.new_empty((*x.shape[:-1], n))


if kernels.load():
    _register_fakes()
