"""Linear layers by how tensor parallelism shards them, each loading its own slice of a checkpoint tensor.

- `Linear`: replicated (every rank holds the whole weight); the base of the others.
- `ColumnParallelLinear`: the output dimension split across ranks; no communication.
- `MergedColumnParallelLinear`: several checkpoint tensors (gate, up) stacked along the output
  dimension, each split across ranks, so one matmul computes them all.
- `QKVParallelLinear`: q, k and v split by heads; KV heads are replicated when there are fewer
  of them than ranks.
- `RowParallelLinear`: the input dimension split; partial sums are all-reduced, then the bias added.

Sharding happens in `load` (before any dtype cast or packing); the math is the layer's
`LinearMethod`. At size 1 every layer holds the whole tensor and no collective runs. A layer serving LoRA
adapters (`lora`, set by tokenloom/model/lora_slots.py) adds each row's adapter delta to its output, before a
row-parallel layer's all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from tokenloom.distributed.parallel_state import all_reduce, tp_group
from tokenloom.lora.layer import LoRALayer
from tokenloom.model.layers.linear_method import UNQUANTIZED, LinearMethod, mixed_linear  # noqa: F401
from tokenloom.model.layers.module import InferenceModule
from tokenloom.profiler import PROFILER


class Linear(InferenceModule):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 method: LinearMethod = UNQUANTIZED):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.method = method
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.lora: LoRALayer | None = None

    def load(self, name: str, tensor: torch.Tensor, shard: str | None = None) -> None:
        _copy(self._param(name).data, tensor, name)

    def _param(self, name: str) -> torch.Tensor:
        return self.weight if name == "weight" else self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not PROFILER.enabled:  # the common case skips the context manager (~120 calls a decode step)
            out = self.method.apply(self, x, self.bias)
        else:
            with PROFILER.section("matmul"):
                out = self.method.apply(self, x, self.bias)
        self._add_lora(out, x)
        return out

    def _add_lora(self, out: torch.Tensor, x: torch.Tensor) -> None:
        if self.lora is None or not self.lora.batch.active:
            return
        if not PROFILER.enabled:
            self.lora.add(out, x)
            return
        with PROFILER.section("lora"):
            self.lora.add(out, x)


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = tp_group()
        super().__init__(in_features, out_features // self.tp.size, bias)

    def load(self, name, tensor, shard=None):
        part = tensor.shape[0] // self.tp.size
        _copy(self._param(name).data, tensor.narrow(0, self.tp.rank * part, part), name)


class MergedColumnParallelLinear(Linear):
    """Output blocks named by checkpoint shard (e.g. gate, up); `offsets` are this rank's (start, size)."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        self.tp = tp_group()
        local = {name: size // self.tp.size for name, size in shard_sizes.items()}
        super().__init__(in_features, sum(local.values()), bias)
        self.offsets = _offsets(local)

    def _shard_rows(self, shard: str, tensor: torch.Tensor) -> torch.Tensor:
        size = self.offsets[shard][1]
        return tensor.narrow(0, self.tp.rank * size, size)

    def load(self, name, tensor, shard=None):
        start, size = self.offsets[shard]
        _copy(self._param(name).data.narrow(0, start, size), self._shard_rows(shard, tensor), f"{shard}.{name}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections; rank r holds query heads [r*H/p, (r+1)*H/p) and the KV heads they read."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_group()
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        self.head_dim = head_dim
        q, kv = num_heads * head_dim, self.num_kv_heads * head_dim * tp.size // self.kv_replicas
        super().__init__(hidden_size, {"q": q, "k": kv * self.kv_replicas, "v": kv * self.kv_replicas}, bias)

    def _shard_rows(self, shard, tensor):
        size = self.offsets[shard][1]
        index = self.tp.rank if shard == "q" else self.tp.rank // self.kv_replicas
        return tensor.narrow(0, index * size, size)


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = tp_group()
        super().__init__(in_features // self.tp.size, out_features, bias)

    def load(self, name, tensor, shard=None):
        if name == "bias":
            _copy(self.bias.data, tensor, name)
            return
        part = tensor.shape[1] // self.tp.size
        _copy(self.weight.data, tensor.narrow(1, self.tp.rank * part, part), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        with PROFILER.section("matmul"):
            out = self.method.apply(self, x, None)
        self._add_lora(out, x)  # on each rank's partial sum: the all-reduce sums the deltas' shares too
        with PROFILER.section("all_reduce"):
            all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)


def _offsets(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    offsets, start = {}, 0
    for name, size in sizes.items():
        offsets[name] = (start, size)
        start += size
    return offsets


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)
