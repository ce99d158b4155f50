"""The LoRA op of a mixed batch: each row adds the low-rank delta of its own adapter, or none.

- `lora_add(y, x, lora_a, lora_b, scaling, row_slots)`: for every row t whose slot s = row_slots[t] is not
  -1, y[t] += scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s]. The adapters live in a fixed pool of slots:
  lora_a is float32 [slots, max_rank, in] and lora_b float32 [slots, max_rank, out], zero past an adapter's
  own rank, so one shape serves every adapter and a rank below the maximum adds nothing for its padding.
  y is float32 [rows, out] and may be a column slice of a fused projection's output (row stride >= out);
  x is float32 [rows, in]; scaling float32 [slots]; row_slots int32 [rows].

Rows are not sorted by adapter (a decode batch interleaves them), so the reference gathers each slot's
rows, does the shrink (x @ A.T, rank wide) and the expand (@ B) as two small matmuls, and scatters the
sum back: the segmented (Punica/S-LoRA) form, one pair of matmuls per adapter present in the batch.
The native op (csrc/lora.cpp, `tokenloom::lora_add`) serves float32 CPU tensors when the kernels are loaded:
it needs no gather, each row reads its own slot's A and B; the reference is its fallback and its test oracle.
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
        shrunk = x.index_select(0, rows) @ lora_a[slot].T
        delta = (shrunk @ lora_b[slot]) * scaling[slot]
        y.index_add_(0, rows, delta)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scaling: torch.Tensor, row_slots: torch.Tensor) -> None:
    """Add each row's adapter delta to y in place."""
    if native(y, x, lora_a, lora_b, scaling):
        torch.ops.tokenloom.lora_add(y, x, lora_a, lora_b, scaling, row_slots)
    else:
        lora_add_reference(y, x, lora_a, lora_b, scaling, row_slots)


def native(*tensors: torch.Tensor) -> bool:
    """Whether the native op serves these tensors: kernels loaded, all float32 on the CPU, unit column stride."""
    return (all(t.dtype == torch.float32 and t.is_cpu for t in tensors) and tensors[0].stride(-1) == 1
            and tensors[1].stride(-1) == 1 and kernels.enabled())


def _register_fake() -> None:
    @torch.library.register_fake("tokenloom::lora_add")
    def _lora_add(y, x, lora_a, lora_b, scaling, row_slots):
        return None


if kernels.load():
    _register_fake()
