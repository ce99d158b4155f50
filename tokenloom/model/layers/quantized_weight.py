"""A linear weight kept in quantized blocks, and the slot a layer loads its (sharded) pieces into.

`QuantizedWeight` is the native kernels' form (tokenloom/kernels/quant.py): uint8 values, two a byte
for 4-bit weights, with a float32 scale and min per block of 32 (16 for Q6_K): w = q*scale + min.
GGUF blocks repack into it without changing a weight (tokenloom/model/loader/gguf_repack.py). It
shards like a tensor: rows for column-parallel layers and the vocabulary, columns (whole blocks) for
row-parallel ones; a column cut inside a block falls back to the dense slice.

Row-major blocks are the form for loading and sharding. Once a layer's weight is whole,
`finalize_quantized` swaps them for the column-interleaved `Panels` (`interleaved()`), the form the
fast many-row kernels read (csrc/quant_gemm.cpp), and drops the row-major copy: the weight's bytes
stay the same. Everything else still works on the interleaved form (rows are read back out of it for
an embedding lookup; sharding it again rebuilds the row-major blocks).

A K-quant (Q4_K, Q5_K, Q6_K) also keeps its scales as the file has them (`SuperBlocks`: an integer per
block times a float per 256 values), carried through sharding and merging, so that its panels hold those
instead of a float32 scale and min a block (tokenloom/kernels/quant.py `interleave`): a Q4_K weight then
costs 4.75 bits a value instead of 6, a Q6_K one 8.75 instead of 12, for the very same products.

`QuantizedSlot` stands in for a layer's `weight` while the checkpoint loads: the parallel layers'
`load` code narrows it and copies pieces into it as into a tensor, and `finalize` assembles the
pieces (a merged QKV of Q4_K and Q6_K parts converts both, losslessly, to their common form).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

SUPER_BLOCK = 256  # values a K-quant super-block (tokenloom/kernels/quant.py SUPER_BLOCK)


def _quant_ops():
    """tokenloom.kernels.quant, on first use: importing it loads (or builds) the native library, and the loader
    imports this module where no kernel runs (the EngineCore reading a model's shape)."""
    from tokenloom.kernels import quant  # lazy: importing it loads (or builds) the native kernels
    return quant


def row_major_bits(bits: int) -> int:
    """The row-major form's bits of a weight whose panels hold `bits` (6-bit panels come from bytes)."""
    return 8 if bits == 6 else bits


@dataclass
class SuperBlocks:
    """A K-quant's block scales and mins as integers times super-block factors (quant.super_block_scales)."""
    sub: torch.Tensor      # int8 [N, K/block_size, 2]: each block's sc and m
    factors: torch.Tensor  # float32 [N, K/256, 2]: each super-block's d and dm

    def rows(self, index: slice | torch.Tensor) -> SuperBlocks:
        return SuperBlocks(self.sub[index], self.factors[index])

    def columns(self, start: int, length: int, block_size: int) -> SuperBlocks | None:
        """Columns [start, start + length) of the weight: whole super-blocks, else None (plain floats)."""
        if start % SUPER_BLOCK or length % SUPER_BLOCK:
            return None
        s0 = start // SUPER_BLOCK
        return SuperBlocks(self.sub[:, start // block_size:(start + length) // block_size],
                           self.factors[:, s0:s0 + length // SUPER_BLOCK])

    def widened(self, repeat: int) -> SuperBlocks:
        """Each block as `repeat` smaller ones (QuantizedWeight.in_form)."""
        return SuperBlocks(self.sub.repeat_interleave(repeat, dim=1), self.factors)

    def contiguous(self) -> SuperBlocks:
        return SuperBlocks(self.sub.contiguous(), self.factors.contiguous())

    def zeros(self, rows: int) -> SuperBlocks:
        return SuperBlocks(self.sub.new_zeros((rows, *self.sub.shape[1:])),
                           self.factors.new_zeros((rows, *self.factors.shape[1:])))

    @staticmethod
    def cat(parts: list[SuperBlocks | None]) -> SuperBlocks | None:
        if any(p is None for p in parts):
            return None
        return SuperBlocks(torch.cat([p.sub for p in parts]), torch.cat([p.factors for p in parts]))


@dataclass
class Panels:
    """The column-interleaved form (tokenloom/kernels/quant.py `interleave`) of an [N, K] weight."""
    qpacked: torch.Tensor  # uint8 [P, K/32, 16*32*bits/8], P = N padded to 32, over 16
    scales: torch.Tensor   # float16 where exact (quant.compact_scales), else float32 [P, K/block_size, 16];
    #                        a K-quant's: int8 [P, K/block_size, 1 or 2, 16] (SuperBlocks.sub)
    mins: torch.Tensor     # the same dtype as scales [P, K/block_size, 16]; a K-quant's: float32
    #                        [P, K/256, 2, 16] (SuperBlocks.factors)
    columns: int           # N


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor | None  # uint8 [N, K * bits / 8]; None once only the interleaved form is kept
    scales: torch.Tensor | None   # float32 [N, K / block_size]
    mins: torch.Tensor | None     # float32 [N, K / block_size]
    bits: int                     # 4 or 8; 6 in panels whose 8-bit values all fit 6 bits (quant.panel_bits)
    block_size: int               # 32, or 16 for 8-bit
    activations_int8: bool = False  # the W4A8 path (else exact: float32 activations)
    panels: Panels | None = None    # the interleaved form, when built
    super_blocks: SuperBlocks | None = None  # a K-quant's scales as the file has them (row-major form only)

    is_mkldnn = False
    dtype = torch.float32  # what it multiplies like

    @property
    def shape(self) -> torch.Size:
        if self.qweight is None:
            return torch.Size((self.panels.columns, self.panels.qpacked.shape[1] * 32))
        return torch.Size((self.qweight.shape[0], self.qweight.shape[1] * 8 // self.bits))

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.mins]
        if self.super_blocks is not None:
            tensors += [self.super_blocks.sub, self.super_blocks.factors]
        if self.panels is not None:
            tensors += [self.panels.qpacked, self.panels.scales, self.panels.mins]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def data(self) -> QuantizedWeight:
        return self

    # ---- forms: row-major blocks and the interleaved panels ------------------------
    def interleaved(self) -> QuantizedWeight:
        """This weight holding only the interleaved form (the many-row kernels'; same bytes)."""
        if self.qweight is None:
            return self
        k = self.super_blocks
        bits = _quant_ops().panel_bits(self.qweight, self.bits)
        qpacked, scales, mins = _quant_ops().interleave(self.qweight, self.scales, self.mins, bits,
                                                        self.block_size, *((k.sub, k.factors) if k else ()))
        return replace(self, qweight=None, scales=None, mins=None, super_blocks=None, bits=bits,
                       panels=Panels(qpacked, scales, mins, self.qweight.shape[0]))

    def row_major(self) -> QuantizedWeight:
        """This weight in row-major blocks (rebuilt from the panels when only they are kept)."""
        if self.qweight is not None:
            return replace(self, panels=None) if self.panels is not None else self
        return self._from_panels(torch.arange(self.panels.columns))

    def _from_panels(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows `index` of the panels, in row-major blocks."""
        quant, p = _quant_ops(), self.panels
        q, scales, mins = quant.panel_rows(p.qpacked, p.scales, p.mins, self.bits, index)
        k = SuperBlocks(*quant.panel_super_blocks(p.scales, p.mins, index)) if p.scales.dtype == torch.int8 else None
        return replace(self, qweight=quant.pack_nibbles(q) if self.bits == 4 else q, scales=scales, mins=mins,
                       panels=None, super_blocks=k, bits=row_major_bits(self.bits))

    # ---- sharding --------------------------------------------------------------
    def rows(self, start: int, size: int) -> QuantizedWeight:
        w = self.row_major()
        span = slice(start, start + size)
        return replace(w, qweight=w.qweight[span], scales=w.scales[span], mins=w.mins[span],
                       super_blocks=w.super_blocks and w.super_blocks.rows(span))

    def index_rows(self, index: torch.Tensor) -> QuantizedWeight:
        if self.qweight is None:
            return self._from_panels(index)
        w = self.row_major()
        return replace(w, qweight=w.qweight[index], scales=w.scales[index], mins=w.mins[index],
                       super_blocks=w.super_blocks and w.super_blocks.rows(index))

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight | torch.Tensor:
        if dim == 0:
            return self.rows(start, length)
        if dim != 1:
            raise IndexError(f"a weight has 2 dimensions, not {dim + 1}")
        if start % self.block_size or length % self.block_size:  # not on block edges: the dense slice
            return self.dequantize().narrow(1, start, length)
        w = self.row_major()
        per = w.bits // 4  # half-bytes an element
        b0, nb = start // self.block_size, length // self.block_size
        return replace(w, qweight=w.qweight[:, start * per // 2:(start + length) * per // 2],
                       scales=w.scales[:, b0:b0 + nb], mins=w.mins[:, b0:b0 + nb],
                       super_blocks=w.super_blocks and w.super_blocks.columns(start, length, self.block_size))

    def __getitem__(self, rows: slice) -> QuantizedWeight:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("a quantized weight is indexed by a contiguous row slice")
        start, stop, _ = rows.indices(self.shape[0])
        return self.rows(start, max(0, stop - start))

    def unpacked(self) -> torch.Tensor:
        """uint8 [N, K], one element a byte."""
        w = self.row_major()
        return _quant_ops().unpacked(w.qweight, w.bits)

    def in_form(self, bits: int, block_size: int) -> QuantizedWeight:
        """The same weights as `bits`/`block_size` blocks (only widening: 4->8 bits, 32->16 blocks)."""
        w = self.row_major()
        if (bits, block_size) == (w.bits, w.block_size):
            return w
        if bits < w.bits or block_size > w.block_size:
            raise ValueError(f"cannot narrow {w.bits}-bit/{w.block_size} blocks to {bits}-bit/{block_size}")
        q = w.unpacked() if bits == 8 else w.qweight
        repeat = self.block_size // block_size
        return replace(w, qweight=q.contiguous(), scales=w.scales.repeat_interleave(repeat, dim=1),
                       mins=w.mins.repeat_interleave(repeat, dim=1), bits=bits, block_size=block_size,
                       super_blocks=w.super_blocks and w.super_blocks.widened(repeat))

    def contiguous(self) -> QuantizedWeight:
        w = self.row_major()
        return replace(w, qweight=w.qweight.contiguous(), scales=w.scales.contiguous(), mins=w.mins.contiguous(),
                       super_blocks=w.super_blocks and w.super_blocks.contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.row_major()
        return _quant_ops().dequantize(w.qweight, w.scales, w.mins, w.bits, w.block_size).to(dtype)

    def to(self, target) -> QuantizedWeight | torch.Tensor:
        """A device: this weight (CPU only); a dtype: the dense weight in it (the matmul-dtype modes)."""
        if isinstance(target, torch.dtype):
            return self.dequantize(target)
        if torch.device(target).type != "cpu":
            raise NotImplementedError("quantized weights run on the CPU kernels only")
        return self

    # ---- math ------------------------------------------------------------------
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Called ~120 times a decode step, so it goes straight to the ops (the Python wrappers and the
        import cost ~1 ms a step at batch 1)."""
        xf = x if x.dtype == torch.float32 else x.float()
        ops = torch.ops.tokenloom
        if self.panels is not None:
            p = self.panels
            op = ops.quant_gemm_a8 if self.activations_int8 else ops.quant_gemm
            out = op(xf, p.qpacked, p.scales, p.mins, p.columns, self.bits, self.block_size)
        else:
            op = ops.quant_matmul_a8 if self.activations_int8 else ops.quant_matmul
            out = op(xf, self.qweight, self.scales, self.mins, self.bits, self.block_size)
        if bias is not None:
            out.add_(bias)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows of ``ids`` (an embedding lookup), float32."""
        return self.index_rows(ids.reshape(-1)).dequantize().reshape(*ids.shape, self.shape[1])


def embedding_lookup(ids: torch.Tensor, weight: QuantizedWeight | torch.Tensor) -> torch.Tensor:
    """F.embedding for a dense or quantized table."""
    if isinstance(weight, QuantizedWeight):
        return weight.embedding(ids)
    return torch.nn.functional.embedding(ids, weight)


def common_form(weights: list[QuantizedWeight]) -> tuple[int, int]:
    return max(row_major_bits(w.bits) for w in weights), min(w.block_size for w in weights)


def cat_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    bits, block = common_form(weights)
    parts = [w.in_form(bits, block) for w in weights]
    first = parts[0]
    return replace(first, qweight=torch.cat([p.qweight for p in parts]), scales=torch.cat([p.scales for p in parts]),
                   mins=torch.cat([p.mins for p in parts]),
                   super_blocks=SuperBlocks.cat([p.super_blocks for p in parts]))


class QuantizedSlot:
    """A layer's weight [N, K] while loading: records (first row, piece) and assembles them at the end."""

    def __init__(self, shape: torch.Size | tuple[int, int]):
        self.shape = torch.Size(shape)
        self.pieces: list[tuple[int, QuantizedWeight | torch.Tensor]] = []
        self.zero_filled = False

    @property
    def data(self) -> QuantizedSlot:
        return self

    def narrow(self, dim: int, start: int, length: int) -> _SlotRows:
        if dim != 0:
            raise IndexError("a weight slot is filled by rows")
        return _SlotRows(self, start, length)

    def __getitem__(self, rows: slice) -> _SlotRows:
        start, stop, _ = rows.indices(self.shape[0])
        return _SlotRows(self, start, max(0, stop - start))

    def zero_(self) -> QuantizedSlot:
        """Rows no piece fills are zero (the vocabulary padding of the last tensor-parallel rank)."""
        self.zero_filled = True
        return self

    def copy_(self, src) -> QuantizedSlot:
        self._put(0, src, self.shape[0])
        return self

    def _put(self, start: int, src, rows: int) -> None:
        if tuple(src.shape) != (rows, self.shape[1]):
            raise ValueError(f"shape mismatch: piece {tuple(src.shape)}, slot rows {rows} x {self.shape[1]}")
        self.pieces.append((start, src))

    def finalize(self, what: str) -> QuantizedWeight | torch.Tensor:
        """The assembled weight: quantized when every piece is, else dense float32."""
        pieces = sorted(self.pieces, key=lambda p: p[0])
        filled = 0
        ordered = []
        for start, piece in pieces:
            if start != filled:
                if start < filled or not self.zero_filled:
                    raise ValueError(f"{what}: rows {filled}..{start} not loaded (or loaded twice)")
                ordered.append(_zeros_like_piece(piece, start - filled))
            ordered.append(piece)
            filled = start + piece.shape[0]
        if filled != self.shape[0]:
            if not self.zero_filled or not ordered:
                raise ValueError(f"{what}: rows {filled}..{self.shape[0]} not loaded")
            ordered.append(_zeros_like_piece(ordered[-1], self.shape[0] - filled))
        if all(isinstance(p, QuantizedWeight) for p in ordered):
            return cat_rows(ordered).contiguous()
        dense = [p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in ordered]
        return torch.cat(dense).contiguous()


class _SlotRows:
    def __init__(self, slot: QuantizedSlot, start: int, rows: int):
        self.slot, self.start = slot, start
        self.shape = torch.Size((rows, slot.shape[1]))

    def copy_(self, src) -> _SlotRows:
        self.slot._put(self.start, src, self.shape[0])
        return self

    def __getitem__(self, rows: slice) -> _SlotRows:
        start, stop, _ = rows.indices(self.shape[0])
        return _SlotRows(self.slot, self.start + start, max(0, stop - start))

    def zero_(self) -> _SlotRows:
        self.slot.zero_filled = True
        return self


def _zeros_like_piece(piece, rows: int):
    if isinstance(piece, QuantizedWeight):
        return replace(piece, qweight=piece.qweight.new_zeros((rows, piece.qweight.shape[1])),
                       scales=piece.scales.new_zeros((rows, piece.scales.shape[1])),
                       mins=piece.mins.new_zeros((rows, piece.mins.shape[1])),
                       super_blocks=piece.super_blocks and piece.super_blocks.zeros(rows))
    return piece.new_zeros((rows, piece.shape[1]))
