"""The native LoRA op (csrc/lora.cpp) against the torch reference in tokenloom/kernels/lora_ops.py."""
from __future__ import annotations

import pytest
import torch

from tokenloom.kernels.lora_ops import lora_add, lora_add_reference

pytestmark = pytest.mark.kernels


def _case(rows: int, dim_in: int, dim_out: int, slots: int, rank: int, seed: int, base_every: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim_in, generator=g)
    a = torch.randn(slots, rank, dim_in, generator=g) / dim_in ** 0.5
    b = torch.randn(slots, rank, dim_out, generator=g)
    scaling = torch.rand(slots, generator=g) * 2
    row_slots = torch.randint(0, slots, (rows,), generator=g, dtype=torch.int32)
    row_slots[::base_every] = -1
    y = torch.randn(rows, dim_out, generator=g)
    return y, x, a, b, scaling, row_slots


def _both(y, x, a, b, scaling, row_slots) -> tuple[torch.Tensor, torch.Tensor]:
    native, reference = y.clone(), y.clone()
    torch.ops.tokenloom.lora_add(native, x, a, b, scaling, row_slots)
    lora_add_reference(reference, x, a, b, scaling, row_slots)
    return native, reference


@pytest.mark.parametrize("rows,dim_in,dim_out,slots,rank,seed", [
    (1, 576, 192, 1, 1, 0), (5, 33, 71, 3, 7, 1), (32, 576, 1536, 4, 16, 2), (9, 100, 257, 2, 64, 3),
    (17, 40, 8, 5, 33, 4)], ids=str)
def test_random_shapes_and_ranks_match_the_reference(rows, dim_in, dim_out, slots, rank, seed):
    native, reference = _both(*_case(rows, dim_in, dim_out, slots, rank, seed))
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,dim_in,dim_out,slots,rank,seed", [(32, 576, 1536, 4, 16, 13), (5, 33, 71, 3, 7, 14)],
                         ids=str)
def test_sixteen_bit_slots_give_the_references_sums_of_the_same_weights(dtype, rows, dim_in, dim_out, slots, rank,
                                                                        seed):
    """--lora-dtype bfloat16 / float16: the kernel widens each weight to float32 and sums in float32."""
    y, x, a, b, scaling, row_slots = _case(rows, dim_in, dim_out, slots, rank, seed)
    native, reference = _both(y, x, a.to(dtype), b.to(dtype), scaling, row_slots)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


def test_rows_without_an_adapter_are_left_bit_for_bit():
    y, x, a, b, scaling, row_slots = _case(12, 64, 96, 2, 8, seed=5)
    native, _ = _both(y, x, a, b, scaling, row_slots)
    base = row_slots == -1
    assert torch.equal(native[base], y[base])


def test_a_batch_of_base_rows_only_changes_nothing():
    y, x, a, b, scaling, _ = _case(6, 64, 96, 2, 8, seed=6)
    native, _ = _both(y, x, a, b, scaling, torch.full((6,), -1, dtype=torch.int32))
    assert torch.equal(native, y)


def test_writes_only_its_column_slice_of_a_fused_output():
    y, x, a, b, scaling, row_slots = _case(7, 48, 40, 3, 4, seed=7)
    fused = torch.randn(7, 100)
    native, reference = fused.clone(), fused.clone()
    torch.ops.tokenloom.lora_add(native[:, 30:70], x, a, b, scaling, row_slots)
    lora_add_reference(reference[:, 30:70], x, a, b, scaling, row_slots)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(native[:, :30], fused[:, :30]) and torch.equal(native[:, 70:], fused[:, 70:])


def test_reads_x_from_a_row_strided_view():
    """The down projection's input can be a slice of a wider buffer."""
    y, x, a, b, scaling, row_slots = _case(5, 32, 48, 2, 4, seed=8)
    wide = torch.randn(5, 80)
    wide[:, 10:42] = x
    native, reference = _both(y, wide[:, 10:42], a, b, scaling, row_slots)
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)


def test_one_thread_and_two_threads_give_the_same_sums():
    case = _case(32, 576, 1536, 4, 16, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _both(*case)
        torch.set_num_threads(2)
        two, _ = _both(*case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_lora_add_takes_the_native_op_for_float32_and_the_reference_for_bfloat16():
    y, x, a, b, scaling, row_slots = _case(4, 32, 16, 2, 4, seed=10)
    expected = y.clone()
    lora_add_reference(expected, x, a, b, scaling, row_slots)
    lora_add(y, x, a, b, scaling, row_slots)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y16 = torch.zeros(4, 16, dtype=torch.bfloat16)
    lora_add(y16, x.bfloat16(), a.bfloat16(), b.bfloat16(), scaling.bfloat16(), row_slots)
    assert torch.count_nonzero(y16) > 0


def test_a_slot_out_of_range_is_refused():
    y, x, a, b, scaling, _ = _case(2, 16, 16, 2, 4, seed=11)
    with pytest.raises(RuntimeError, match="names slot 2 of 2"):
        torch.ops.tokenloom.lora_add(y, x, a, b, scaling, torch.tensor([0, 2], dtype=torch.int32))


def test_schema_and_fake():
    y, x, a, b, scaling, row_slots = _case(3, 16, 24, 2, 4, seed=12)
    torch.library.opcheck(torch.ops.tokenloom.lora_add.default, (y, x, a, b, scaling, row_slots),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_row_gets_the_same_bits_alone_and_in_a_large_batch(dtype):
    """Up to 8 adapter rows take the rank-split schedule (two threads each summing half the ranks), more rows
    the block schedule: both sum the ranks in the same two halves, so batching never changes a row."""
    y, x, a, b, scaling, row_slots = _case(32, 576, 320, 4, 16, seed=15)
    a, b = a.to(dtype), b.to(dtype)
    batched = y.clone()
    torch.ops.tokenloom.lora_add(batched, x, a, b, scaling, row_slots)
    for row in (0, 1, 7, 31):
        alone = y[row:row + 1].clone()
        torch.ops.tokenloom.lora_add(alone, x[row:row + 1], a, b, scaling, row_slots[row:row + 1])
        assert torch.equal(alone[0], batched[row])


@pytest.mark.parametrize("rank", [1, 7, 8, 16, 33], ids=str)
def test_few_rows_match_the_reference_at_every_rank(rank):
    """The rank-split schedule (a decode step at low concurrency), odd ranks and outputs not a multiple of
    the vector width included."""
    native, reference = _both(*_case(3, 100, 200, 2, rank, seed=16 + rank, base_every=4))
    torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
