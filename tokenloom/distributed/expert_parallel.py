"""Expert parallelism: which experts of a mixture-of-experts layer this rank holds.

With `--enable-expert-parallel` the experts are shared out whole over the tensor-parallel group
(the EP group is the TP group: tokenloom's data parallelism runs separate engines, so there is no
DP x TP product to span). Attention and the dense layers stay tensor parallel. Without it, every
rank holds every expert and tensor parallelism splits each expert's intermediate dimension.

Dispatch and combine: after attention's all-reduce every rank of the group holds the same hidden
states for every token, so dispatch needs no communication: each rank routes all tokens and keeps
the (token, expert) pairs whose expert it holds. Combine is one all-reduce of the [tokens, hidden]
partial sums, the same collective and size as a dense MLP's under tensor parallelism, and works on
gloo and NCCL. An all-to-all dispatch only pays off when ranks hold different tokens (attention
data parallel, which tokenloom does not have): it sends each token only to the ranks owning its
experts instead of reducing a full [tokens, hidden] tensor.

Placement (vLLM's `--expert-placement-strategy`): `linear` gives rank r the experts
[r*E/p, (r+1)*E/p); `round_robin` gives it every expert e with e % p == r, which spreads
neighbouring experts (often co-activated in trained models) over ranks. That is the start; with
`--enable-eplb` the load balancer (tokenloom.distributed.eplb) re-places them as the load shifts, over
E + R physical slots: R redundant copies, R/p on each rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEMENTS = ("linear", "round_robin")


@dataclass(frozen=True)
class ExpertPlacement:
    """Which of `num_experts` experts rank `rank` of `size` holds."""

    num_experts: int
    rank: int = 0
    size: int = 1
    strategy: str = "linear"

    def local_experts(self) -> list[int]:
        """The global ids this rank holds, in the order of its stacked weights."""
        per_rank = self.num_experts // self.size
        if self.strategy == "round_robin":
            return list(range(self.rank, self.num_experts, self.size))
        return list(range(self.rank * per_rank, (self.rank + 1) * per_rank))

    def physical_experts(self, redundant: int) -> list[int]:
        """The expert in each of the E + `redundant` physical slots, rank after rank, as the load balancer
        starts: each rank's experts of the strategy, then its redundant/size spare slots, filled with copies of
        the next ranks' experts (so every slot holds a usable expert and no rank holds one twice)."""
        spare = redundant // self.size
        slots = []
        for rank in range(self.size):
            others = [e for step in range(1, self.size)
                      for e in ExpertPlacement(self.num_experts, (rank + step) % self.size, self.size,
                                               self.strategy).local_experts()]
            own = ExpertPlacement(self.num_experts, rank, self.size, self.strategy).local_experts()
            slots += own + others[:spare]
        return slots

    def expert_map(self) -> torch.Tensor:
        """[num_experts] int64: the local index of each global expert, -1 where another rank holds it."""
        table = torch.full((self.num_experts,), -1, dtype=torch.long)
        local = self.local_experts()
        table[torch.tensor(local, dtype=torch.long)] = torch.arange(len(local))
        return table


@dataclass(frozen=True)
class ExpertParallelSettings:
    enabled: bool = False
    strategy: str = "linear"
    load_balancing: bool = False  # --enable-eplb: the experts move between ranks as their load shifts
    redundant_experts: int = 0  # physical slots beyond one per expert, over all ranks


_SETTINGS = ExpertParallelSettings()


def init_expert_parallel(enabled: bool, strategy: str | None = None, load_balancing: bool = False,
                         redundant_experts: int = 0) -> None:
    """Set once by the worker, after it joined the tensor-parallel group and before it builds the model."""
    global _SETTINGS
    _SETTINGS = ExpertParallelSettings(enabled, strategy or "linear", enabled and load_balancing,
                                       redundant_experts if enabled and load_balancing else 0)


def expert_parallel_settings() -> ExpertParallelSettings:
    return _SETTINGS
