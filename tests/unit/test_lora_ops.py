"""The mixed-batch LoRA op against a per-row loop of plain matmuls."""
import torch

from tokenloom.kernels.lora_ops import lora_add


def _per_row(y, x, a, b, scaling, row_slots):
    out = y.clone()
    for t, s in enumerate(row_slots.tolist()):
        if s >= 0:
            out[t] += scaling[s] * (x[t] @ a[s].T) @ b[s]
    return out


def test_each_row_adds_its_own_adapter_and_base_rows_are_unchanged():
    torch.manual_seed(0)
    rows, dim_in, dim_out, slots, rank = 7, 24, 40, 3, 4
    x = torch.randn(rows, dim_in)
    a, b = torch.randn(slots, rank, dim_in), torch.randn(slots, rank, dim_out)
    scaling = torch.tensor([0.5, 2.0, 1.0])
    row_slots = torch.tensor([2, -1, 0, 2, -1, 1, 0], dtype=torch.int32)
    y = torch.randn(rows, dim_out)
    expected = _per_row(y, x, a, b, scaling, row_slots)
    lora_add(y, x, a, b, scaling, row_slots)
    torch.testing.assert_close(y, expected)
    assert torch.equal(y[1], expected[1]) and torch.equal(y[4], expected[4])


def test_writes_into_a_column_slice_of_a_fused_output():
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    a, b = torch.randn(1, 2, 8), torch.randn(1, 2, 5)
    fused = torch.zeros(3, 12)
    lora_add(fused[:, 4:9], x, a, b, torch.tensor([1.0]), torch.tensor([0, 0, -1], dtype=torch.int32))
    assert torch.count_nonzero(fused[:, :4]) == 0 and torch.count_nonzero(fused[:, 9:]) == 0
    torch.testing.assert_close(fused[:2, 4:9], x[:2] @ a[0].T @ b[0])
    assert torch.count_nonzero(fused[2]) == 0
