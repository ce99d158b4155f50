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
scales and mins in float16 where that is exact (`compact_scales`), and a K-quant's (Q4_K, Q5_K, Q6_K) as
the file does: an integer per sub-block times a float per 256 values (`super_block_scales`).
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


SUPER_BLOCK = 256  # values a K-quant super-block: one d (and dmin) of the file each


def super_block_scales(sub: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 block scales and mins [..., K/block] of the K-quant form, as the kernels form them.

    sub: int8 [..., K/block, C], each block's integer scale sc and min m (C = 1: m = sc); factors: float32
    [..., K/256, 2], each super-block's d and dm. scale = d * sc and min = dm * m: GGUF's d and dmin are
    float16 (11-bit mantissas) and sc, m at most 8-bit integers, so each product is exact in float32, the
    float a repack stores (gguf_repack: d*sc and -(dmin*m) for Q4_K/Q5_K, -32*d*sc = (-32d)*sc for Q6_K).
    """
    per = sub.shape[-2] // factors.shape[-2]
    f = factors.float().repeat_interleave(per, dim=-2)
    return f[..., 0] * sub[..., 0].float(), f[..., 1] * sub[..., -1].float()


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _panel_lanes(t: torch.Tensor, pad: int) -> torch.Tensor:
    """[N, ...] per weight row -> [P, ..., 16], the 16 columns of a panel side by side (N padded by `pad`)."""
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    t = t.reshape(t.shape[0] // PANEL, PANEL, *t.shape[1:])
    return t.permute(0, *range(2, t.dim()), 1).contiguous()


PANEL = 16          # output columns side by side in the interleaved form (one 512-bit vector of int32)
TILE_COLUMNS = 32   # columns a kernel tile: the interleaved N is padded to a multiple of it


def panel_bits(qweight: torch.Tensor, bits: int) -> int:
    """The bits a weight's panels take: 6 for 8-bit values that all fit 6 bits (Q6_K's, Q5_K's, Q5_0's, and a
    merged Q4_K + Q6_K projection's), which cuts a Q6_K weight's bytes by a quarter; else `bits`."""
    if bits == 8 and qweight.numel() and int(qweight.max()) < 64:
        return 6
    return bits


def interleave(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
               block_size: int, sub: torch.Tensor | None = None,
               factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row-major blocks -> (qpacked uint8 [P, K/32, 16*32*bits/8], scales and mins float32 [P, K/block, 16]).

    P = N padded to 32, over 16. Per (panel, 32-block), 8-bit: group g (64 bytes) holds each column's
    elements 4g..4g+3 in its 4 bytes, columns side by side; 4-bit: 4 groups whose low nibbles are groups
    0..3 of the 8-bit form and high nibbles groups 4..7 (csrc/quant_gemm.cpp reads it so); 6-bit (from
    bytes below 64): the 4-bit form of the low nibbles, then per half block one group of the top 2 bits,
    each lane's byte j holding those of the half's elements 4g+j at bits 2g..2g+1.

    With a K-quant's `sub` and `factors` (`super_block_scales`) that give `scales` and `mins` bit for bit,
    the scales are those integers, int8 [P, K/block, C, 16], and the mins the factors, float32
    [P, K/256, 2, 16]: the K-quant form, which the kernels read instead of float32 scales (a Q4_K weight
    4.75 bits a value instead of 6, a Q6_K one 8.75 instead of 12).
    """
    q = unpacked(qweight, bits)
    n, k = q.shape
    pad = -n % TILE_COLUMNS
    k_form = sub is not None and factors is not None and k % SUPER_BLOCK == 0 and \
        all(_bitwise_equal(a, b) for a, b in zip(super_block_scales(sub, factors), (scales, mins)))
    if k_form and torch.equal(sub[..., 0], sub[..., 1]):
        sub = sub[..., :1]  # Q6_K: the min is -32 d times the scale's own integer
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        scales, mins = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scales, mins))
    panels = (n + pad) // PANEL
    groups = q.reshape(panels, PANEL, k // 32, 8, 4).permute(0, 2, 3, 1, 4)  # [P, K/32, group, column, byte]
    if bits == 6:
        top = (groups >> 4).reshape(panels, k // 32, 2, 4, PANEL, 4)  # [P, K/32, half, g, column, byte]
        top = sum(top[:, :, :, g] << (2 * g) for g in range(4))
        low = groups & 0xF
        groups = torch.cat([(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(panels, k // 32, -1),
                            top.reshape(panels, k // 32, -1)], dim=-1)
    elif bits == 4:
        groups = groups[:, :, :4] | (groups[:, :, 4:] << 4)
    qpacked = groups.reshape(panels, k // 32, -1).contiguous()
    if k_form:
        return qpacked, _panel_lanes(sub.to(torch.int8), pad), _panel_lanes(factors.float(), pad)
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
    panel, lane = rows // PANEL, rows % PANEL
    got = qpacked.reshape(panels, nb, -1, PANEL, 4)[panel, :, :, lane]  # [R, K/32, groups, 4]
    if bits == 6:  # 4 groups of low nibbles, then a group of top bits a half block
        top = got[:, :, 4:, None] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
        low = got[:, :, :4]
        got = torch.cat([low & 0xF, low >> 4], dim=2) | ((top & 3).reshape(got.shape[0], nb, 8, 4) << 4)
    elif bits == 4:
        got = torch.cat([got & 0xF, got >> 4], dim=2)
    if scales.dtype == torch.int8:
        row_scales, row_mins = super_block_scales(*panel_super_blocks(scales, mins, rows))
    else:
        row_scales, row_mins = scales[panel, :, lane].float(), mins[panel, :, lane].float()
    return got.reshape(rows.shape[0], -1), row_scales, row_mins


def panel_super_blocks(scales: torch.Tensor, mins: torch.Tensor,
                       rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `rows` of a K-quant form's panels as (sub int8 [R, K/block, 2], factors float32 [R, K/256, 2])."""
    panel, lane = rows // PANEL, rows % PANEL
    sub = scales[panel, ..., lane]  # [R, K/block, C]
    return sub.expand(*sub.shape[:-1], 2).contiguous(), mins[panel, ..., lane].float()


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
