"""Attention over a paged KV cache, for one flat batch of mixed prefills and decodes.

The runner lays the flat batch out decodes first (one query token each), then
prefill chunks. Decodes are attended in one batched call over their gathered
blocks; each prefill chunk is one SDPA call (few per step). No per-token loops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenloom.kernels.kv_int8 import read_rows, to_cache
from tokenloom.profiler import PROFILER


@dataclass
class PrefillChunk:
    start: int  # first query token in the flat batch
    end: int
    context_len: int  # tokens in the KV cache for this request after this step
    block_table: torch.Tensor  # [num_blocks] block ids
    # Position ranges [lo, hi) whose queries attend to every key of the range, later ones too (Gemma 3's
    # image tokens in prefill); causal elsewhere. Set by the runner for a model that asks for it.
    bidirectional: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None  # [num_decodes]
    # [num_decodes, 1, 1, max_blocks * block_size]: True = attend, or additive (0 / -inf) in the KV cache dtype
    decode_mask: torch.Tensor | None
    prefills: list[PrefillChunk]
    # [2, num_decodes * max_blocks, block elements]: reused buffer for the decodes' gathered K and V.
    # Fresh tens-of-MB temporaries each layer cost page faults that can double a decode step on CPU.
    decode_workspace: torch.Tensor | None = None
    # Blocks each group of decodes attends over (its longest context); None: all of decode_block_tables.
    decode_group_blocks: list[int] | None = None
    # Per sliding window: the decodes' tables, mask and group widths cut to the window (see decode_window).
    decode_windows: dict[int, "DecodeView"] = field(default_factory=dict)


@dataclass
class DecodeView:
    """What decode attention reads: block tables [n, width], mask [n, 1, 1, width * block_size] (True or 0 =
    attend) and each group's block count (None: the whole width)."""

    tables: torch.Tensor
    mask: torch.Tensor
    group_blocks: list[int] | None


def decode_window(meta: AttentionMetadata, window: int, block_size: int) -> DecodeView:
    """The decodes' view for a layer that attends over the last `window` positions: each sequence's table
    starts at the block holding its first position in the window, so a windowed layer reads about
    window / block_size blocks per sequence whatever its context (and never a block the scheduler has
    released behind the window). Built once per step and window, shared by the layers."""
    view = meta.decode_windows.get(window)
    if view is not None:
        return view
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    starts = (lens - window).clamp(min=0) // block_size  # first block in each sequence's window
    ends = (lens + block_size - 1) // block_size
    spans = (ends - starts).tolist()
    width = max(spans)
    cols = (starts.unsqueeze(1) + torch.arange(width, device=lens.device)).clamp(max=tables.shape[1] - 1)
    positions = starts.unsqueeze(1) * block_size + torch.arange(width * block_size, device=lens.device)
    outside = (positions >= lens.unsqueeze(1)) | (positions < (lens - window).unsqueeze(1))
    if meta.decode_mask.is_floating_point():
        mask = torch.zeros(outside.shape, dtype=meta.decode_mask.dtype, device=outside.device)
        mask.masked_fill_(outside, float("-inf"))
    else:
        mask = ~outside
    group = decode_group_size(len(spans), lens.device)
    view = DecodeView(tables.gather(1, cols), mask.view(len(spans), 1, 1, -1),
                      [max(spans[i:i + group]) for i in range(0, len(spans), group)])
    meta.decode_windows[window] = view
    return view


# Decode sequences attended per call on CPU; 16 keeps a group's gathered K/V (a few MB at a few hundred
# tokens) in cache, measured 15-25% faster than one call over 64 sequences.
DECODE_GROUP = 16


# Below this many gathered tokens in a group (sequences x padded context), SDPA beats the block-diagonal
# GEMMs, whose fixed cost of ~70 us per group and layer dominates (bfloat16, one sequence of 256 tokens:
# 39 vs 94 us; 6 x 256: 135 vs 156 us; 12 x 256: 262 vs 210 us).
BLOCK_DIAGONAL_MIN_TOKENS = 2048


def decode_group_size(num_decodes: int, device: torch.device) -> int:
    """Decodes attended together: all of them on CUDA, DECODE_GROUP at a time on CPU."""
    return num_decodes if device.type == "cuda" else min(num_decodes, DECODE_GROUP)


class TorchAttention:
    """Reference backend in plain torch; runs on CPU and CUDA.

    `scale` multiplies the scores (default head_dim**-0.5); with `sliding_window` W, the query at position p
    attends to positions p-W+1..p only (HF's convention), in prefill, chunked prefill and decode."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window

    def __call__(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, blocks, block_size, KVH, D] (D + 4 bytes a row for
        the 8-bit cache, kv_int8.py). Returns [T, H*D]."""
        with PROFILER.section("attention"):
            return self._attend(q, k, v, kv_cache, meta)

    def _attend(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        flat_shape = (-1, self.num_kv_heads, k_cache.shape[-1])
        k_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, to_cache(k, k_cache.dtype))
        v_cache.view(flat_shape).index_copy_(0, meta.slot_mapping, to_cache(v, v_cache.dtype))
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            d = meta.num_decodes
            self._decode(q[:d], k_cache, v_cache, meta, out[:d])
        for chunk in meta.prefills:
            out[chunk.start:chunk.end] = self._prefill(q, k, v, k_cache, v_cache, chunk)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """One query per sequence, so the heads sharing a KV head act as that head's queries (no GQA copy).

        Sequences go DECODE_GROUP at a time, so each group's gathered K and V are still in the CPU's cache
        when they are read (one pass over the whole batch would spill them to memory and read them back).
        The runner orders decodes by context length, so a group gathers and attends over only the blocks
        its own longest sequence needs. A reduced-precision KV cache is read in its own dtype (half the
        bytes); on CPU a group of over BLOCK_DIAGONAL_MIN_TOKENS gathered tokens takes the block-diagonal
        GEMMs (batch-64 decode step 260 -> 230 ms, measured interleaved) and a smaller one SDPA. With
        float32 K/V the two tie and SDPA stays. The 8-bit cache is gathered as bytes and dequantized to the
        query's dtype."""
        b = q.shape[0]
        if out is None:
            out = torch.empty(b, self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        view = (DecodeView(meta.decode_block_tables, meta.decode_mask, meta.decode_group_blocks)
                if self.sliding_window is None else decode_window(meta, self.sliding_window, k_cache.shape[1]))
        tables, mask = view.tables, view.mask
        group = decode_group_size(b, q.device)
        for i, start in enumerate(range(0, b, group)):
            end = min(start + group, b)
            n = end - start
            width = tables.shape[1] if view.group_blocks is None else view.group_blocks[i]
            ws = meta.decode_workspace
            group_tables = tables[start:end, :width]
            keys = _gather_blocks(k_cache, group_tables, None if ws is None else ws[0, :n * width])
            values = _gather_blocks(v_cache, group_tables, None if ws is None else ws[1, :n * width])
            if k_cache.dtype == torch.int8:
                keys, values = (read_rows(x.view(n, -1, self.num_kv_heads, k_cache.shape[-1]), q.dtype).view(n, -1)
                                for x in (keys, values))
            group_q = q[start:end].view(n, self.num_kv_heads, self.group, self.head_dim)
            group_mask = mask[start:end, :, :, :width * k_cache.shape[1]]
            if group_mask.is_floating_point() and group_mask.dtype != keys.dtype:
                group_mask = group_mask.to(keys.dtype)
            block_diagonal = (keys.dtype != torch.float32 and not q.is_cuda and group_mask.is_floating_point()
                              and n * width * k_cache.shape[1] > BLOCK_DIAGONAL_MIN_TOKENS)
            if block_diagonal:
                width_kv = self.num_kv_heads * self.head_dim
                o = self._block_diagonal((group_q * self.scale).to(keys.dtype), keys.view(n, -1, width_kv),
                                         values.view(n, -1, width_kv), group_mask.view(n, 1, -1))
                out[start:end].view(o.shape).copy_(o)
                continue
            keys = keys.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            values = values.view(n, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
            o = F.scaled_dot_product_attention(group_q.to(keys.dtype), keys, values, attn_mask=group_mask,
                                               scale=self.scale)
            out[start:end] = o.reshape(n, -1)
        return out

    def _block_diagonal(self, q, keys, values, mask) -> torch.Tensor:
        """Decode attention for reduced-precision K/V on CPU as two batched GEMMs per group.

        q: [n, KVH, G, D], already scaled; keys, values: [n, L, KVH*D] as gathered; mask: [n, 1, L] additive.
        Each sequence's queries form a block-diagonal [KVH*G, KVH*D] matrix (zeros where a query head
        meets another KV head's columns), so all heads' scores come from one [KVH*G, KVH*D] x [KVH*D, L]
        product. It computes KVH times the useful FLOPs, yet beats SDPA, whose per-head GEMMs with G query
        rows are dominated by call overhead. The output keeps the diagonal blocks. The scores stay in the
        KV dtype (the GEMM already rounded them; softmax accumulates in float32 inside), which skips two
        casts of the largest tensor here."""
        n, kvh, g, d = q.shape
        blocks = q.new_zeros(n, kvh, g, kvh, d)
        torch.diagonal(blocks, dim1=1, dim2=3).copy_(q.permute(0, 2, 3, 1))
        scores = torch.bmm(blocks.view(n, kvh * g, kvh * d), keys.transpose(1, 2))
        probs = torch.softmax(scores.add_(mask), dim=-1)
        out = torch.bmm(probs, values).view(n, kvh, g, kvh, d)
        return torch.diagonal(out, dim1=1, dim2=3).permute(0, 3, 1, 2)  # [n, KVH, G, D], a strided view

    def _prefill(self, q, k, v, k_cache, v_cache, chunk: PrefillChunk) -> torch.Tensor:
        n = chunk.end - chunk.start
        qs = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
        window = self.sliding_window
        offset = chunk.context_len - n  # position of the chunk's first query
        if chunk.context_len == n:
            keys, values = k[chunk.start:chunk.end], v[chunk.start:chunk.end]
            if k_cache.dtype == torch.int8:  # attend to what the cache holds, as the native kernel does
                keys, values = (read_rows(to_cache(x, torch.int8), q.dtype) for x in (keys, values))
            first = 0
        else:
            # A windowed layer gathers from the block holding its first query's first key on.
            block_size = k_cache.shape[1]
            first_block = 0 if window is None else max(0, offset - window + 1) // block_size
            first = first_block * block_size
            blocks = chunk.block_table[first_block: (chunk.context_len + block_size - 1) // block_size]
            length = chunk.context_len - first
            row = k_cache.shape[-1]
            keys = read_rows(_gather_blocks(k_cache, blocks).view(-1, self.num_kv_heads, row)[:length], q.dtype)
            values = read_rows(_gather_blocks(v_cache, blocks).view(-1, self.num_kv_heads, row)[:length], q.dtype)
        if chunk.context_len == n and (window is None or window >= n) and not chunk.bidirectional:
            mask, causal = None, True
        else:
            rows = torch.arange(n, device=q.device).unsqueeze(1) + offset
            cols = torch.arange(first, chunk.context_len, device=q.device).unsqueeze(0)
            mask = cols <= rows
            for lo, hi in chunk.bidirectional:
                mask |= (rows >= lo) & (rows < hi) & (cols >= lo) & (cols < hi)
            if window is not None:  # transformers: window AND (causal OR same image)
                mask &= cols > rows - window
            causal = False
        keys = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = values.transpose(0, 1).unsqueeze(0).to(q.dtype)
        out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, is_causal=causal,
                                             scale=self.scale, enable_gqa=self.group > 1)
        return out.squeeze(0).transpose(0, 1).reshape(n, -1)


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the given blocks out of one layer's K or V cache (index_select on whole blocks is
    several times faster than advanced indexing on CPU)."""
    return torch.index_select(cache.view(cache.shape[0], -1), 0, block_ids.reshape(-1), out=out)
