"""LoRA on a linear layer: the slot buffers of the adapters it serves, and the delta it adds to each row.

A linear layer with LoRA holds one `LoRATarget` per checkpoint projection it computes (a fused qkv layer
three, gate_up two, o and down one), each writing into its own column slice of the layer's output, and a
reference to the engine's one `LoRABatch`: the slot of every row of the step being computed (-1 for a base
model row) and the per-slot scaling. The runner sets the batch before each forward, so the layers take no
extra argument and a model family needs no change to serve adapters.

Tensor parallel: a column-parallel target (q, k, v, gate, up) holds A whole and its rank's rows of B; a
row-parallel one (o, down) its rank's columns of A and B whole, its delta added to the partial sum before
the all-reduce (the sum of the ranks' x_r @ A_r.T is x @ A.T, so the result is exact).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.kernels.lora_ops import lora_add
from tokenloom.lora.adapter import LoRAWeights


class LoRABatch:
    """The step's rows: `row_slots` int32 [rows] (None: no row uses an adapter) and `scaling` float32 [slots]."""

    def __init__(self, num_slots: int, device: torch.device):
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.row_slots: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return self.row_slots is not None


@dataclass(frozen=True)
class Narrow:
    """The slice of a full tensor one rank holds: `size` along `dim` from `start`."""
    dim: int
    start: int
    size: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        return t.narrow(self.dim, self.start, self.size)


class LoRATarget:
    """One projection's slots: a [slots, max_rank, in], b [slots, max_rank, out], zero-padded past each adapter's
    rank, in the slots' dtype (--lora-dtype: an adapter's float32 pairs are rounded to it as they are loaded);
    `column` is where its output starts in the layer's (fused) output."""

    def __init__(self, num_slots: int, max_rank: int, fan_in: int, fan_out: int, column: int,
                 a_shard: Narrow | None, b_shard: Narrow | None, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        self.a = torch.zeros(num_slots, max_rank, fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, max_rank, fan_out, dtype=dtype, device=device)
        self.column = column
        self.a_shard = a_shard  # along A's input columns (row-parallel targets)
        self.b_shard = b_shard  # along B's output rows (column-parallel targets)

    def load(self, slot: int, pair: LoRAWeights | None) -> None:
        """Put an adapter's pair (full, unsharded) into `slot`; None clears it (the adapter skips this target)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        if pair is None:
            return
        a = self.a_shard.of(pair.a) if self.a_shard is not None else pair.a
        b = self.b_shard.of(pair.b) if self.b_shard is not None else pair.b
        rank = a.shape[0]
        self.a[slot, :rank].copy_(a)
        self.b[slot, :rank].copy_(b.T)

    @property
    def fan_out(self) -> int:
        return self.b.shape[2]


class LoRALayer:
    """A linear layer's LoRA: its targets by checkpoint name, and the engine's batch."""

    def __init__(self, batch: LoRABatch, targets: dict[str, LoRATarget]):
        self.batch = batch
        self.targets = targets

    def add(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """y += each row's adapter delta, for the rows of a step that uses adapters."""
        row_slots, scaling = self.batch.row_slots, self.batch.scaling
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        x32 = x2 if x2.dtype == torch.float32 else x2.float()
        exact = y2.dtype == torch.float32
        for target in self.targets.values():
            out = y2[:, target.column:target.column + target.fan_out]
            if exact:
                lora_add(out, x32, target.a, target.b, scaling, row_slots)
            else:  # reduced-precision activations: the delta in float32, added once
                delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
                lora_add(delta, x32, target.a, target.b, scaling, row_slots)
                out.add_(delta.to(out.dtype))
