"""A sparse mixture-of-experts block: a router picks top-k experts per token, their outputs are summed by
the router's weights, plus a gated shared expert in families that have one (Qwen2-MoE).

Routing, as the families define it (and transformers computes it, in float32):
- softmax over all experts, then the top k; with `renormalize` the k weights are divided by their sum.
  Mixtral always renormalizes (the same as a softmax over the top-k logits); Qwen-MoE does when its
  config's `norm_topk_prob` says so.
- the shared expert (a dense gated MLP every token passes through) is scaled by sigmoid(shared_gate(x)).

The router and the shared gate are small and replicated on every rank; the experts are `FusedMoE`. Under
tensor or expert parallelism the layer costs one all-reduce: the shared expert's partial sum joins the
experts' before it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.distributed.parallel_state import all_reduce
from tokenloom.model.layers.fused_moe import FusedMoE
from tokenloom.model.layers.linear import Linear, MergedColumnParallelLinear, RowParallelLinear
from tokenloom.model.layers.module import InferenceModule
from tokenloom.profiler import PROFILER


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]) of the k most probable experts of each token."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SharedExpert(InferenceModule):
    """The dense SwiGLU expert every token passes through, sharded like a dense MLP (gate/up column-parallel,
    down row-parallel), returning this rank's partial sum: the block adds it to the routed experts' partial
    sum before the one all-reduce of the layer."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, {"gate": intermediate_size,
                                                                     "up": intermediate_size})
        self.intermediate_size = self.gate_up_proj.offsets["up"][1]
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        with PROFILER.section("matmul"):
            return self.down_proj.method.apply(self.down_proj, F.silu(gate) * up, None)  # not reduced


class SparseMoeBlock(InferenceModule):
    """Checkpoint names under the block: `gate` (router), `experts.*`, `shared_expert.*`, `shared_expert_gate`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_expert_intermediate_size: int = 0):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        if self.shared_expert is None:
            return self.experts(x, weights, ids)
        # sigmoid(gate) scales every rank's partial sum alike, so one all-reduce combines both.
        out = self.experts(x, weights, ids, reduce_results=False)
        out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.experts.tp.size > 1:
            with PROFILER.section("all_reduce"):
                all_reduce(out)
        return out
