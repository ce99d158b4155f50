"""The native paged-attention ops and backend against their plain-torch references: decode read through the
block table (GQA, several blocks, a partly filled last block, contexts over several partitions, a sliding
window, float32 and bfloat16 caches), the KV cache write, and the backend on a mixed step."""
from __future__ import annotations

import pytest
import torch

from tokenloom.kernels.attention_ops import paged_attention_decode_reference, write_kv_cache_reference
from tokenloom.model.layers.attention_backend import ScheduledSpan, TorchAttentionBackend
from tokenloom.model.layers.attention_native import NativeAttention, NativeAttentionBackend

pytestmark = pytest.mark.kernels

BLOCK = 16


def _decode_case(lens: list[int], heads: int = 8, kv_heads: int = 2, dim: int = 64, dtype=torch.float32,
                 seed: int = 0):
    """Random q and a cache whose blocks are handed out shuffled, so no sequence's blocks are contiguous."""
    g = torch.Generator().manual_seed(seed)
    width = max((n + BLOCK - 1) // BLOCK for n in lens) + 1  # one spare column: tables wider than needed
    num_blocks = len(lens) * width + 3
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()
    q = torch.randn(len(lens), heads, dim, generator=g)
    return q, cache, tables, torch.tensor(lens, dtype=torch.int32)


def _native_decode(q, cache, tables, lens, window: int = 0) -> torch.Tensor:
    return torch.ops.tokenloom.paged_attention_decode(q, cache, tables, lens, q.shape[-1] ** -0.5, window)


def _reference_decode(q, cache, tables, lens, window: int = 0) -> torch.Tensor:
    return paged_attention_decode_reference(q, cache, tables, lens, q.shape[-1] ** -0.5, window)


@pytest.mark.parametrize("lens", [[1], [16], [17], [5, 33, 128, 129, 300]], ids=str)
def test_decode_over_shuffled_blocks_matches_the_reference(lens):
    q, cache, tables, lens = _decode_case(lens)
    torch.testing.assert_close(_native_decode(q, cache, tables, lens), _reference_decode(q, cache, tables, lens),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (9, 3, 64), (6, 1, 40), (2, 2, 20)])
def test_decode_with_grouped_and_plain_heads_and_odd_head_dims(heads, kv_heads, dim):
    q, cache, tables, lens = _decode_case([3, 70, 257], heads, kv_heads, dim, seed=1)
    torch.testing.assert_close(_native_decode(q, cache, tables, lens), _reference_decode(q, cache, tables, lens),
                               rtol=1e-5, atol=1e-5)


def test_decode_reads_a_bfloat16_cache_in_float32():
    q, cache, tables, lens = _decode_case([9, 140, 600], dtype=torch.bfloat16, seed=2)
    got = _native_decode(q, cache, tables, lens)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference_decode(q, cache, tables, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 128, 200, 4096])
def test_decode_with_a_sliding_window_attends_only_the_last_window_positions(window):
    q, cache, tables, lens = _decode_case([3, 100, 129, 300, 513], seed=3)
    torch.testing.assert_close(_native_decode(q, cache, tables, lens, window),
                               _reference_decode(q, cache, tables, lens, window), rtol=1e-5, atol=1e-5)


def test_a_sequence_decodes_bit_identically_alone_and_in_a_batch():
    """Partitions depend on the context alone, so batch composition cannot change a sequence's result."""
    q, cache, tables, lens = _decode_case([40, 700, 3, 260], seed=4)
    batch = _native_decode(q, cache, tables, lens)
    alone = _native_decode(q[1:2], cache, tables[1:2], lens[1:2])
    assert torch.equal(batch[1:2], alone)


def test_a_sequence_decodes_bit_identically_whether_its_kv_heads_share_a_task_or_not():
    """Alone, a one-partition sequence gets a task per KV head; in a batch of 12 it shares one task with its
    other heads; at 3 partitions, one thread takes all heads per task and two threads one head per task."""
    q, cache, tables, lens = _decode_case([100] + [300] * 11, heads=9, kv_heads=3, seed=9)
    batch = _native_decode(q, cache, tables, lens)
    assert torch.equal(batch[:1], _native_decode(q[:1], cache, tables[:1], lens[:1]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native_decode(q[1:2], cache, tables[1:2], lens[1:2])
        torch.set_num_threads(2)
        two = _native_decode(q[1:2], cache, tables[1:2], lens[1:2])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, batch[1:2])


def test_a_context_longer_than_its_block_table_is_refused():
    q, cache, tables, lens = _decode_case([20])
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        _native_decode(q, cache, tables[:, :1], lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_from_strided_views_matches_index_copy(dtype):
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 8 * 16 + 2 * 2 * 16, generator=g)  # K and V as views into a fused projection
    k = qkv[:, 128:160].view(6, 2, 16)
    v = qkv[:, 160:].view(6, 2, 16)
    slots = torch.tensor([0, 17, 18, 5, 63, 40])
    got = torch.zeros(2, 4, BLOCK, 2, 16, dtype=dtype)
    want = got.clone()
    torch.ops.tokenloom.write_kv_cache(k, v, got, slots)
    write_kv_cache_reference(k, v, want, slots)
    assert torch.equal(got, want)


def test_the_ops_fake_implementations_agree_with_the_kernels():
    q, cache, tables, lens = _decode_case([5, 40], seed=6)
    torch.library.opcheck(torch.ops.tokenloom.paged_attention_decode.default, (q, cache, tables, lens, 0.125, 0),
                          test_utils=("test_schema", "test_faketensor"))
    k = torch.randn(3, 2, 64)
    torch.library.opcheck(torch.ops.tokenloom.write_kv_cache.default, (k, k.clone(), cache, torch.tensor([1, 2, 3])),
                          test_utils=("test_schema", "test_faketensor"))


def _mixed_step(backend, spans, slot_mapping, q, k, v, cache, window=None):
    backend.bind(cache)
    meta = backend.build_metadata(spans, slot_mapping)
    impl = NativeAttention(q.shape[1], k.shape[1], q.shape[2], sliding_window=window)
    return impl(q, k, v, cache, meta)


def test_native_backend_matches_the_torch_backend_on_a_mixed_step():
    """Two decodes, a prefill chunk over cached blocks and a fresh prefill, in one flat batch."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim = 6, 2, 32
    cache = torch.randn(2, 24, BLOCK, kv_heads, dim, generator=g)
    spans = [ScheduledSpan(0, 20, 1, [3, 4]), ScheduledSpan(1, 150, 1, list(range(5, 15))),
             ScheduledSpan(2, 40, 9, [15, 16, 17, 18]), ScheduledSpan(11, 0, 12, [19])]
    slots = [s.block_ids[p // BLOCK] * BLOCK + p % BLOCK for s in spans for p in range(s.start, s.start + s.num_tokens)]
    slot_mapping = torch.tensor(slots)
    t = len(slots)
    q, k, v = (torch.randn(t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    native_cache, torch_cache = cache.clone(), cache.clone()
    got = _mixed_step(NativeAttentionBackend(), spans, slot_mapping, q, k, v, native_cache)
    want = _mixed_step(TorchAttentionBackend(), spans, slot_mapping, q, k, v, torch_cache)
    assert torch.equal(native_cache, torch_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_prefill_with_a_sliding_window_masks_positions_before_the_window():
    g = torch.Generator().manual_seed(8)
    heads, kv_heads, dim, window, n = 4, 2, 16, 5, 12
    cache = torch.zeros(2, 2, BLOCK, kv_heads, dim)
    q, k, v = (torch.randn(n, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    got = _mixed_step(NativeAttentionBackend(), [ScheduledSpan(0, 0, n, [0])], torch.arange(n), q, k, v, cache, window)
    keys, values = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * dim ** -0.5
    rows, cols = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    scores = scores.masked_fill(~((cols <= rows) & (cols > rows - window)), float("-inf"))
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(n, -1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
