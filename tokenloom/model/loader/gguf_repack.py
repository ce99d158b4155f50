"""GGUF quantized blocks -> QuantizedWeight (the native kernels' form), without a float copy of the weight.

Every supported type is read as unsigned values q with a float32 scale and min per block, w = q*scale + min:
- Q4_0 (32: fp16 d, 16 nibble bytes): the nibble bytes as they are; scale d, min -8d.
- Q4_1 (32: d, m, 16 nibble bytes): the nibble bytes as they are; scale d, min m.
- Q8_0 (32: d, 32 int8): q + 128 as a byte; scale d, min -128d.
- Q5_0 (32: d, 4 bytes of fifth bits, 16 nibble bytes): the 5-bit values as bytes; scale d, min -16d.
- Q4_K (256: d, dmin, 12 bytes of 6-bit sub-scales/mins, 128 nibble bytes): 8 sub-blocks of 32,
  scale d*sc, min -dmin*m, nibbles reordered into the 32-block layout.
- Q5_K (as Q4_K plus a fifth bit a value): bytes, sub-blocks of 32.
- Q6_K (256: 128 low-nibble bytes, 64 bytes of high 2-bit pairs, 16 int8 sub-scales, d): bytes, sub-blocks
  of 16, scale d*sc, min -32*d*sc.
The products d*sc are exact in float32 (11-bit by 8-bit mantissas), and the kernel forms q*scale + min with
one rounding, so each weight equals the `gguf` package's dequantized value or is one float32 ulp from it
(Q4_1/K-quants, whose reference rounds twice); Q4_0, Q5_0, Q8_0 and Q6_K match bit for bit.
K-quants also keep those factors (`SuperBlocks`: sc and m as int8 a sub-block, d and -dmin, or d and -32d,
a super-block), which the interleaved form stores instead of the float32 products.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from gguf.quants import Q4_K

from tokenloom.kernels.quant import pack_nibbles
from tokenloom.model.layers.quantized_weight import QuantizedWeight, SuperBlocks


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _weight(q: np.ndarray, scales: np.ndarray, mins: np.ndarray, rows: int, bits: int, block: int) -> QuantizedWeight:
    q = torch.from_numpy(np.ascontiguousarray(q)).reshape(rows, -1)
    return QuantizedWeight(q.contiguous(), torch.from_numpy(np.ascontiguousarray(scales, np.float32)).reshape(rows, -1),
                           torch.from_numpy(np.ascontiguousarray(mins, np.float32)).reshape(rows, -1), bits, block)


def repack_q4_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    d = _f16(blocks[:, 0:2])[:, 0]
    return _weight(blocks[:, 2:18], d, -8.0 * d, rows, 4, 32)


def repack_q4_1(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    d, m = _f16(blocks[:, 0:2])[:, 0], _f16(blocks[:, 2:4])[:, 0]
    return _weight(blocks[:, 4:20], d, m, rows, 4, 32)


def repack_q8_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    d = _f16(blocks[:, 0:2])[:, 0]
    return _weight(blocks[:, 2:34] ^ np.uint8(0x80), d, -128.0 * d, rows, 8, 32)


def repack_q5_0(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    d = _f16(blocks[:, 0:2])[:, 0]
    n = blocks.shape[0]
    fifth = np.ascontiguousarray(blocks[:, 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32)  # [n, 32]
    low = blocks[:, 6:22].reshape(n, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    q = (low & np.uint8(0x0F)).reshape(n, 32) | ((fifth & np.uint32(1)).astype(np.uint8) << np.uint8(4))
    return _weight(q, d, -16.0 * d, rows, 8, 32)


def _super_blocks(sc: np.ndarray, m: np.ndarray, d: np.ndarray, dm: np.ndarray, rows: int) -> SuperBlocks:
    """sc, m: [n, blocks] integers; d, dm: [n, 1] float32 (n super-blocks, row by row)."""
    sub = torch.from_numpy(np.stack([sc, m], axis=-1).astype(np.int8))
    factors = torch.from_numpy(np.concatenate([d, dm], axis=-1).astype(np.float32))
    return SuperBlocks(sub.reshape(rows, -1, 2), factors.reshape(rows, -1, 2))


def _k_scales(blocks: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, SuperBlocks]:
    """Per 32-value sub-block of a Q4_K/Q5_K super-block: (d*sc, -dmin*m) float32 [n, 8], and the factors."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), _super_blocks(sc, m, d, -dmin, rows)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] bytes -> [n, 8, 32] values: each 32 bytes hold sub-block 2i (low) and 2i+1 (high nibbles)."""
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, 8, 32)


def repack_q4_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    scale, minimum, factors = _k_scales(blocks, rows)
    q = torch.from_numpy(_k_low_nibbles(blocks[:, 16:144])).reshape(rows, -1)
    return replace(_weight(pack_nibbles(q).numpy(), scale, minimum, rows, 4, 32), super_blocks=factors)


def repack_q5_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    scale, minimum, factors = _k_scales(blocks, rows)
    n = blocks.shape[0]
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = _k_low_nibbles(blocks[:, 48:176]) | ((qh & np.uint8(1)) << np.uint8(4))
    return replace(_weight(q, scale, minimum, rows, 8, 32), super_blocks=factors)


def repack_q6_k(blocks: np.ndarray, rows: int) -> QuantizedWeight:
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc_int = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    sc = sc_int.astype(np.float32)
    d = _f16(blocks[:, 208:210])
    scale = d * sc  # [n, 16]
    low = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (low & np.uint8(0x0F)).reshape(n, 2, 4, 32)  # as gguf: per half, 4 runs of 32
    high = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (high & np.uint8(0x03)).reshape(n, 2, 4, 32)
    q = (low | (high << np.uint8(4))).reshape(n, 256)
    factors = _super_blocks(sc_int, sc_int, d, -32.0 * d, rows)
    return replace(_weight(q, scale, -32.0 * scale, rows, 8, 16), super_blocks=factors)


_REPACK = {"Q4_0": (repack_q4_0, 32, 18), "Q4_1": (repack_q4_1, 32, 20), "Q8_0": (repack_q8_0, 32, 34),
           "Q5_0": (repack_q5_0, 32, 22),
           "Q4_K": (repack_q4_k, 256, 144), "Q5_K": (repack_q5_k, 256, 176), "Q6_K": (repack_q6_k, 256, 210)}
SUPPORTED = frozenset(_REPACK)


def repack(type_name: str, raw: np.ndarray, rows: int, cols: int) -> QuantizedWeight:
    """The [rows, cols] weight whose GGUF blocks (`type_name`) are the bytes `raw`."""
    fn, block, size = _REPACK[type_name]
    if cols % block:
        raise ValueError(f"{type_name} weight with {cols} columns, not a multiple of its {block}-value block")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows * cols // block, size)
    return fn(blocks, rows)
