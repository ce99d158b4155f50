"""The LoRA op of a mixed batch: each row adds the low-rank delta of its own adapter, or none.

- `lora_add(y, x, lora_a, lora_b, scaling, row_slots)`: for every row t whose slot s = row_slots[t] is not
  -1, y[t] += scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s]. The adapters live in a fixed pool of slots:
  lora_a is [slots, max_rank, in] and lora_b [slots, max_rank, out], zero past an adapter's own rank, so one
  shape serves every adapter and a rank below the maximum adds nothing for its padding; both float32, or both
  bfloat16 or float16 (`--lora-dtype`: half the bytes a step reads), widened to float32 for the arithmetic.
  y is float32 [rows, out] and may be a column slice of a fused projection's output (row stride >= out);
  x is float32 [rows, in]; scaling float32 [slots]; row_slots int32 [rows].

Rows are not sorted by adapter (a decode batch interleaves them), so the reference gathers each slot's
rows, does the shrink (x @ A.T, rank wide) and the expand (@ B) as two small matmuls, and scatters the
sum back: the segmented (Punica/S-LoRA) form, one pair of matmuls per adapter present in the batch.
The native op (csrc/lora.cpp, `tokenloom::lora_add`) serves CPU tensors when the kernels are loaded: it
groups the rows by slot itself and reads each A and B vector once for a block of rows; the reference is its
fallback and its test oracle.
"""
from __future__ import annotations

import torch

from tokenloom import kernels


def lora_add_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       scaling: torch.Tensor, row_slots: torch.Tensor) -> None:
    for slot in torch.unique(row_slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(row_slots == slot).flatten()
        shrunk = x.index_select(0, rows) @ lora_a[slot].to(x.dtype).T
        delta = (shrunk @ lora_b[slot].to(x.dtype)) * scaling[slot]
        y.index_add_(0, rows, delta)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, row_slots: torch.Tensor) -> None:
    """Add each row's adapter delta to y in place."""
    if native(y, x, lora_a, lora_b, scaling):
        torch.ops.tokenloom.lora_add(y, x, lora_a, lora_b, scaling, row_slots)
    else:
        lora_add_reference(y, x, lora_a, lora_b, scaling, row_slots)


SLOT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def native(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           scaling: torch.Tensor) -> bool:
    """Whether the native op serves these tensors: kernels loaded, all on the CPU, y, x and scaling float32 with
    unit column stride, the slots float32, bfloat16 or float16."""
    tensors = (y, x, lora_a, lora_b, scaling)
    return (all(t.is_cpu for t in tensors) and all(t.dtype == torch.float32 for t in (y, x, scaling))
            and lora_a.dtype in SLOT_DTYPES and lora_b.dtype == lora_a.dtype and y.stride(-1) == 1
            and x.stride(-1) == 1 and kernels.enabled())


def _register_fake() -> None:
    @torch.library.register_fake("tokenloom::lora_add")
    def _lora_add(y, x, lora_a, lora_b, scaling, row_slots):
        return None


if kernels.load():
    _register_fake()
