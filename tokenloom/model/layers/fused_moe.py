"""The experts of one mixture-of-experts layer as two stacked weights, and their grouped computation.

`FusedMoE` holds this rank's experts as `w13` [experts, 2 x intermediate, hidden] (gate rows, then up
rows) and `w2` [experts, hidden, intermediate], loaded per expert (HF checkpoints) or stacked (GGUF's
`ffn_{gate,up,down}_exps`). How it is sharded over the tensor-parallel group:

- expert parallel off: every rank holds every expert and a 1/p slice of each expert's intermediate
  dimension (gate/up rows, down columns), as `MergedColumnParallelLinear` + `RowParallelLinear` do
  for a dense MLP;
- expert parallel on: each rank holds whole experts (tokenloom.distributed.expert_parallel);
- with the load balancer too (`--enable-eplb`): each rank holds (E + R)/p physical slots, some of them
  copies of busy experts, routed by `ExpertReplicas`; `place` moves the weights to a new placement
  between steps.

Either way the rank's output is a partial sum over the group, combined by one all-reduce.

The math (`UnquantizedMoEMethod.apply`) is grouped: the (token, expert) pairs the router chose are
sorted by expert, gathered once, and each active expert runs one GEMM over all its tokens
(gate_up, SiLU-and-multiply, down); the weighted rows are scattered back with one index_add. There
is no loop over tokens, and experts no token chose cost nothing.
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.distributed.expert_moves import exchange_experts, plan_moves
from tokenloom.distributed.expert_parallel import ExpertPlacement, expert_parallel_settings
from tokenloom.distributed.parallel_state import all_reduce, tp_group
from tokenloom.model.layers.expert_replicas import ExpertReplicas
from tokenloom.model.layers.linear_method import mixed_linear
from tokenloom.model.layers.module import InferenceModule
from tokenloom.model.layers.onednn_layout import pack_weight
from tokenloom.profiler import PROFILER

# A checkpoint tensor of the experts, after the model mapped its family's names (Mixtral's w1/w3/w2)
# to these: `{expert}.gate_proj.weight` (one expert) or `gate_proj.weight` (all experts stacked).
_EXPERT_TENSOR = re.compile(r"(?:(?P<expert>\d+)\.)?(?P<proj>gate_proj|up_proj|down_proj|gate_up_proj)(?:\.weight)?")


class UnquantizedMoEMethod:
    """Dense expert weights in the model dtype or a reduced matmul dtype (cast once, like the linear methods)."""

    def cast(self, layer: "FusedMoE", dtype: torch.dtype) -> None:
        layer.w13 = nn.Parameter(layer.w13.data.to(dtype), requires_grad=False)
        layer.w2 = nn.Parameter(layer.w2.data.to(dtype), requires_grad=False)

    def pack(self, layer: "FusedMoE") -> bool:
        """Each expert's two weights in oneDNN's layout (measured here 1.15-1.7x per expert GEMM at 1-16 rows);
        the stacked originals are dropped, so the experts' memory does not double."""
        if layer.packed is not None:
            return False
        w13 = [pack_weight(w) for w in layer.w13.data]
        w2 = [pack_weight(w) for w in layer.w2.data]
        if not all(w.is_mkldnn for w in w13 + w2):
            return False
        layer.packed = (w13, w2)
        layer.w13 = nn.Parameter(layer.w13.data.new_empty(0), requires_grad=False)
        layer.w2 = nn.Parameter(layer.w2.data.new_empty(0), requires_grad=False)
        return True

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.packed or (layer.w13, layer.w2)
        return grouped_experts(x, w13, w2, topk_weights, topk_ids, layer.expert_map)


UNQUANTIZED_MOE = UnquantizedMoEMethod()


def grouped_experts(x: torch.Tensor, w13: Sequence[torch.Tensor], w2: Sequence[torch.Tensor],
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token t, over the experts held here.

    x [T, H]; w13 [E, 2I, H] and w2 [E, H, I] (stacked, or a list of E prepacked weights each); topk_weights
    (float32) and topk_ids [T, k]; expert_map [global experts] -> local index or -1 (experts another rank
    holds, skipped). Returns [T, H] in x's dtype.
    """
    top_k = topk_ids.shape[1]
    local = topk_ids.reshape(-1) if expert_map is None else expert_map[topk_ids.reshape(-1)]
    counts = torch.bincount(local[local >= 0], minlength=len(w13)).tolist()  # pairs per local expert
    order = torch.argsort(local, stable=True)  # pairs grouped by expert; those held elsewhere (-1) first
    order = order[len(order) - sum(counts):]
    tokens = order // top_k
    rows = x[tokens]
    out = torch.empty_like(rows)
    intermediate = w2[0].shape[-1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        segment = slice(start, start + count)
        gate, up = mixed_linear(rows[segment], w13[expert]).split(intermediate, dim=-1)
        out[segment] = mixed_linear(F.silu(gate) * up, w2[expert])
        start += count
    out.mul_(topk_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype))
    return torch.zeros_like(x).index_add_(0, tokens, out)


class FusedMoE(InferenceModule):
    """This rank's experts of one layer; forward(x, topk_weights, topk_ids) gives their output, reduced over the
    group."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 method: UnquantizedMoEMethod = UNQUANTIZED_MOE):
        super().__init__()
        self.tp = tp_group()
        settings = expert_parallel_settings()
        self.num_experts = num_experts
        if settings.enabled:
            self.placement = ExpertPlacement(num_experts, self.tp.rank, self.tp.size, settings.strategy)
            self.intermediate_size = intermediate_size
            self.intermediate_start = 0
        else:
            self.placement = ExpertPlacement(num_experts)
            self.intermediate_size = intermediate_size // self.tp.size
            self.intermediate_start = self.tp.rank * self.intermediate_size
        self.replicas: ExpertReplicas | None = None
        held = self.placement.local_experts()
        if settings.enabled and settings.load_balancing:
            self.replicas = ExpertReplicas(self.placement.physical_experts(settings.redundant_experts), num_experts,
                                           self.tp.rank, self.tp.size)
            held = self.replicas.local_experts()
        self.local_slots = _slots_of(held)
        local = len(held)
        self.w13 = nn.Parameter(torch.empty(local, 2 * self.intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, self.intermediate_size), requires_grad=False)
        self.method = method
        self.packed: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # set by method.pack
        self._expert_map: torch.Tensor | None = None  # built on the device of the first forward

    @property
    def expert_map(self) -> torch.Tensor | None:
        """Global expert id -> local index or -1; None when this rank holds every expert (no lookup) or the load
        balancer's replicas already routed the ids to local slots."""
        if self.replicas is not None or len(self.local_slots) == self.num_experts:
            return None
        if self._expert_map is None or self._expert_map.device != self.w13.device:
            with torch.device(self.w13.device):  # not a buffer: the loader builds the model on the meta device
                self._expert_map = self.placement.expert_map().to(self.w13.device)
        return self._expert_map

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Place one checkpoint tensor named relative to the experts module: `3.gate_proj.weight` (expert 3),
        `gate_proj.weight` (all experts stacked, as GGUF stores them), or `gate_up_proj` (stacked gate and up)."""
        m = _EXPERT_TENSOR.fullmatch(name)
        if m is None:
            raise ValueError(f"unknown expert tensor {name!r}")
        proj = m["proj"]
        if m["expert"] is not None:
            self._load_expert(int(m["expert"]), proj, tensor)
            return
        if tensor.shape[0] != self.num_experts:
            raise ValueError(f"stacked expert tensor {name!r} has {tensor.shape[0]} experts, the model "
                             f"{self.num_experts}")
        for expert in self.local_slots:
            self._load_expert(expert, proj, tensor[expert])

    def _load_expert(self, expert: int, proj: str, tensor: torch.Tensor) -> None:
        if expert >= self.num_experts:
            raise ValueError(f"expert {expert} out of range (the model has {self.num_experts})")
        for index in self.local_slots.get(expert, ()):  # none: another rank holds it
            self._load_slot(index, expert, proj, tensor)

    def _load_slot(self, index: int, expert: int, proj: str, tensor: torch.Tensor) -> None:
        size, start = self.intermediate_size, self.intermediate_start
        if proj == "gate_up_proj":
            half = tensor.shape[0] // 2
            self._load_expert(expert, "gate_proj", tensor[:half])
            self._load_expert(expert, "up_proj", tensor[half:])
        elif proj == "down_proj":
            _copy(self.w2.data[index], tensor.narrow(1, start, size), f"expert {expert} {proj}")
        else:
            rows = self.w13.data[index].narrow(0, 0 if proj == "gate_proj" else size, size)
            _copy(rows, tensor.narrow(0, start, size), f"expert {expert} {proj}")

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                reduce_results: bool = True) -> torch.Tensor:
        """This rank's partial sum, all-reduced over the group unless the caller adds more to it first."""
        with PROFILER.section("matmul"):
            if self.replicas is not None:
                topk_ids = self.replicas.route(topk_ids)
            out = self.method.apply(self, x, topk_weights, topk_ids)
        if reduce_results and self.tp.size > 1:
            with PROFILER.section("all_reduce"):
                all_reduce(out)
        return out

    # ---- the load balancer's moves, between steps -----------------------------------------------------------
    def read_slot(self, index: int) -> list[torch.Tensor]:
        """Local slot `index`'s [w13, w2], dense (a prepacked weight is unpacked: the same values)."""
        if self.packed is not None:
            return [self.packed[0][index].to_dense(), self.packed[1][index].to_dense()]
        return [self.w13.data[index], self.w2.data[index]]

    def write_slot(self, index: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        if self.packed is not None:
            self.packed[0][index], self.packed[1][index] = pack_weight(w13), pack_weight(w2)
        else:
            self.w13.data[index].copy_(w13)
            self.w2.data[index].copy_(w2)

    def place(self, slots: list[int]) -> int:
        """Serve the load balancer's placement `slots` (physical slot -> expert, all ranks; every rank calls this
        with the same one); returns how many expert copies changed rank."""
        replicas = self.replicas
        moves = plan_moves(replicas.slots, slots, self.tp.size)
        for index, (w13, w2) in exchange_experts(moves, replicas.per_rank, self.tp.rank, self.read_slot).items():
            self.write_slot(index, w13, w2)
        replicas.update(slots)
        self.local_slots = _slots_of(replicas.local_experts())
        return sum(move.source // replicas.per_rank != move.slot // replicas.per_rank for move in moves)


def _slots_of(held: list[int]) -> dict[int, list[int]]:
    """Expert -> the local slots that hold it, from the expert of each local slot."""
    slots: dict[int, list[int]] = {}
    for index, expert in enumerate(held):
        slots.setdefault(expert, []).append(index)
    return slots


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch for {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)
