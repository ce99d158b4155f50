"""The native prefill paged-attention op against its plain-torch reference (the SDPA path it replaced): fresh
and continued chunks of several sizes read through shuffled blocks, sliding windows, GQA and odd head dims,
float32 and bfloat16 caches, several chunks in one call, and a sequence's output independent of the other
chunks in the call and of the thread count."""
from __future__ import annotations

import pytest
import torch

from tokenloom.kernels.prefill_attention_ops import paged_attention_prefill_reference
from tokenloom.model.layers.attention_backend import ScheduledSpan
from tokenloom.model.layers.attention_native import NativeAttentionBackend

pytestmark = pytest.mark.kernels

BLOCK = 16


def _prefill_case(chunks: list[tuple[int, int]], heads: int = 9, kv_heads: int = 3, dim: int = 64,
                  dtype=torch.float32, seed: int = 0):
    """`chunks`: (rows, context length) each. Random q (with two decode-like rows before the chunks, left
    alone by the op) and a cache whose blocks are handed out shuffled, so no chunk's blocks are contiguous."""
    g = torch.Generator().manual_seed(seed)
    width = max((ctx + BLOCK - 1) // BLOCK for _, ctx in chunks) + 1  # one spare column: wider than needed
    num_blocks = len(chunks) * width + 3
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(chunks) * width].view(len(chunks), width).int()
    starts = [2]
    for rows, _ in chunks:
        starts.append(starts[-1] + rows)
    q = torch.randn(starts[-1], heads, dim, generator=g)
    return (q, cache, tables, torch.tensor(starts, dtype=torch.int32),
            torch.tensor([ctx for _, ctx in chunks], dtype=torch.int32))


def _native(q, cache, tables, starts, lens, window: int = 0) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), 7.0)
    torch.ops.tokenloom.paged_attention_prefill(q, cache, tables, starts, lens, q.shape[-1] ** -0.5, window, out)
    return out


def _reference(q, cache, tables, starts, lens, window: int = 0) -> torch.Tensor:
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), 7.0)
    paged_attention_prefill_reference(q, cache, tables, starts, lens, q.shape[-1] ** -0.5, window, out)
    return out


@pytest.mark.parametrize("rows", [2, 16, 17, 64, 225, 512], ids=lambda n: f"{n}rows")
def test_a_fresh_chunk_matches_the_reference(rows):
    case = _prefill_case([(rows, rows)])
    torch.testing.assert_close(_native(*case), _reference(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,context", [(2, 35), (16, 240), (64, 100), (225, 450), (300, 812)], ids=str)
def test_a_chunk_continuing_a_cached_sequence_matches_the_reference(rows, context):
    case = _prefill_case([(rows, context)], seed=1)
    torch.testing.assert_close(_native(*case), _reference(*case), rtol=1e-5, atol=1e-5)


def test_rows_outside_the_chunks_are_left_alone():
    out = _native(*_prefill_case([(20, 50)], seed=2))
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (9, 3, 64), (6, 1, 40), (2, 2, 20), (16, 2, 128)])
def test_grouped_and_plain_heads_and_odd_head_dims(heads, kv_heads, dim):
    case = _prefill_case([(37, 37), (50, 130)], heads, kv_heads, dim, seed=3)
    torch.testing.assert_close(_native(*case), _reference(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks", [[(64, 64)], [(100, 500), (17, 17)]], ids=str)
def test_a_bfloat16_cache_is_read_in_float32(chunks):
    case = _prefill_case(chunks, dtype=torch.bfloat16, seed=4)
    got = _native(*case)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(*case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 32, 50, 200, 4096])
def test_a_sliding_window_attends_only_the_last_window_positions(window):
    case = _prefill_case([(130, 300), (3, 9), (64, 64)], heads=8, kv_heads=2, seed=5)
    torch.testing.assert_close(_native(*case, window=window), _reference(*case, window=window), rtol=1e-5,
                               atol=1e-5)


def test_a_chunk_attends_bit_identically_alone_and_beside_other_chunks():
    """Key tiles sit on absolute positions and each row's arithmetic is its own, so the other chunks of a call
    (and where a row falls in its task's tile) cannot change a sequence's result."""
    q, cache, tables, starts, lens = _prefill_case([(40, 90), (225, 225), (5, 300)], seed=6)
    batch = _native(q, cache, tables, starts, lens)
    alone = _native(q[starts[1]:starts[2]], cache, tables[1:2], torch.tensor([0, 225], dtype=torch.int32),
                    lens[1:2])
    assert torch.equal(batch[starts[1]:starts[2]], alone)


def test_the_output_does_not_depend_on_the_thread_count():
    case = _prefill_case([(100, 100), (70, 333)], seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _native(*case)
        torch.set_num_threads(max(2, threads))
        many = _native(*case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_a_context_longer_than_its_block_table_is_refused():
    q, cache, tables, starts, lens = _prefill_case([(20, 20)])
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        _native(q, cache, tables[:, :1], starts, lens)


def test_a_context_shorter_than_its_chunk_is_refused():
    q, cache, tables, starts, lens = _prefill_case([(20, 20)])
    with pytest.raises(RuntimeError, match="shorter than its chunk"):
        _native(q, cache, tables, starts, lens - 1)


def test_the_op_fake_implementation_agrees_with_the_kernel():
    q, cache, tables, starts, lens = _prefill_case([(5, 40), (9, 9)], seed=8)
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2])
    torch.library.opcheck(torch.ops.tokenloom.paged_attention_prefill.default,
                          (q, cache, tables, starts, lens, 0.125, 0, out),
                          test_utils=("test_schema", "test_faketensor"))


def test_the_backend_describes_all_chunks_of_a_step_for_one_call():
    spans = [ScheduledSpan(0, 40, 1, [1, 2, 3]), ScheduledSpan(1, 0, 30, [4, 5]), ScheduledSpan(31, 16, 8, [6, 7])]
    meta = NativeAttentionBackend().build_metadata(spans, torch.arange(39))
    assert meta.num_prefills == 2
    assert meta.prefill_query_starts.tolist() == [1, 31, 39]
    assert meta.prefill_context_lens.tolist() == [30, 24]
    assert meta.prefill_block_tables.tolist() == [[4, 5], [6, 7]]


def test_the_backend_refuses_prefill_chunks_that_do_not_follow_one_another():
    spans = [ScheduledSpan(0, 0, 30, [4, 5]), ScheduledSpan(31, 16, 8, [6, 7])]
    with pytest.raises(ValueError, match="follow one another"):
        NativeAttentionBackend().build_metadata(spans, torch.arange(38))
