"""The FlashInfer backend's step layout, and its choice.

The kernels themselves need CUDA (the `gpu` test at the end). On CPU, the page lists the backend plans
are checked by attending through them with FlashInfer's documented semantics (each sequence's pages in
CSR order, the last page partly filled, the causal mask aligned to the end of the context) and comparing
with the torch backend over the same mixed step.
"""
from __future__ import annotations

import pytest
import torch

from tokenloom.model.layers.attention_backend import ScheduledSpan, TorchAttentionBackend
from tokenloom.model.layers.attention_flashinfer import paged_kv_layout
from tokenloom.model.layers.attention_select import choose_attention_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4


def _csr_attention(q, k_cache, v_cache, layout):
    """Attention as FlashInfer defines it over a CSR page layout (a slow, obvious reading of the docs)."""
    out = []
    for i in range(len(layout.last_page_len)):
        pages = layout.kv_indices[layout.kv_indptr[i]:layout.kv_indptr[i + 1]].long()
        context = (len(pages) - 1) * BLOCK + int(layout.last_page_len[i])
        keys = k_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[:context].repeat_interleave(HEADS // KV_HEADS, 1)
        values = v_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[:context].repeat_interleave(HEADS // KV_HEADS, 1)
        rows = q[layout.qo_indptr[i]:layout.qo_indptr[i + 1]]
        n = rows.shape[0]
        scores = torch.einsum("qhd,khd->hqk", rows, keys) * HEAD_DIM ** -0.5
        visible = torch.arange(context).unsqueeze(0) <= (torch.arange(n) + context - n).unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, -1))
    return torch.cat(out)


def _mixed_step(seed: int = 0):
    """Three decodes then two chunks (one fresh prompt, one appended to cached tokens), blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(5, 1), (12, 1), (3, 1), (0, 7), (9, 6)]  # (tokens already cached, tokens this step)
    perm = torch.randperm(64, generator=g).tolist()
    spans, row = [], 0
    for start, n in shapes:
        pages = -(-(start + n) // BLOCK)
        spans.append(ScheduledSpan(row, start, n, [perm.pop() for _ in range(pages)]))
        row += n
    return spans, g


def test_page_lists_cover_each_context_with_a_partial_last_page():
    spans, _ = _mixed_step()
    layout = paged_kv_layout(spans, BLOCK)
    assert layout.qo_indptr.tolist() == [0, 1, 2, 3, 10, 16]
    assert layout.kv_indptr.tolist() == [0, 2, 6, 7, 9, 13]  # ceil(6/4), ceil(13/4), 1, ceil(7/4), ceil(15/4)
    assert layout.last_page_len.tolist() == [2, 1, 4, 3, 3]
    assert layout.kv_indices.tolist() == [b for s in spans for b in s.block_ids]
    assert all(t.dtype == torch.int32 for t in (layout.qo_indptr, layout.kv_indptr, layout.kv_indices))


def test_attention_through_the_planned_pages_equals_the_torch_backend():
    spans, g = _mixed_step(seed=1)
    cache = torch.randn(2, 64, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    rows = sum(s.num_tokens for s in spans)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g)
    slots = torch.tensor([s.block_ids[p // BLOCK] * BLOCK + p % BLOCK
                          for s in spans for p in range(s.start, s.start + s.num_tokens)])

    torch_backend = TorchAttentionBackend()
    torch_cache = cache.clone()
    torch_backend.bind(torch_cache)
    expected = torch_backend.make_impl(HEADS, KV_HEADS, HEAD_DIM)(
        q, k, v, torch_cache, torch_backend.build_metadata(spans, slots))

    written = cache.clone()  # FlashInfer reads the cache after this step's K/V are written, as the impl does
    written[0].view(-1, KV_HEADS, HEAD_DIM)[slots] = k
    written[1].view(-1, KV_HEADS, HEAD_DIM)[slots] = v
    got = _csr_attention(q, written[0], written[1], paged_kv_layout(spans, BLOCK))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_auto_picks_flashinfer_only_on_cuda_without_windows():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_attention_backend("auto", cpu, torch.bfloat16) == "torch"
    assert choose_attention_backend("auto", cuda, torch.bfloat16, windowed=True) == "torch"
    assert choose_attention_backend("flashinfer", cpu, torch.float32) == "flashinfer"


@pytest.mark.gpu
def test_flashinfer_backend_matches_torch_backend_on_cuda():
    pytest.importorskip("flashinfer", reason="gpu: flashinfer-python is not installed")
    from tokenloom.model.layers.attention_flashinfer import FlashInferBackend
    spans, g = _mixed_step(seed=2)
    dev = torch.device("cuda")
    cache = torch.randn(2, 64, BLOCK, KV_HEADS, 64, generator=g).to(dev, torch.bfloat16)
    rows = sum(s.num_tokens for s in spans)
    q, k, v = (torch.randn(rows, h, 64, generator=g).to(dev, torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
    slots = torch.tensor([s.block_ids[p // BLOCK] * BLOCK + p % BLOCK
                          for s in spans for p in range(s.start, s.start + s.num_tokens)], device=dev)
    results = []
    for backend in (TorchAttentionBackend(), FlashInferBackend()):
        c = cache.clone()
        backend.bind(c)
        results.append(backend.make_impl(HEADS, KV_HEADS, 64)(q, k, v, c, backend.build_metadata(spans, slots)))
    torch.testing.assert_close(results[1].float(), results[0].float(), rtol=2e-2, atol=2e-2)
