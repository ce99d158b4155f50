"""Under the load balancer, which physical slot serves each (token, expert) pair, and the load each rank saw.

The placement (physical slot -> logical expert, rank after rank; tokenloom.distributed.eplb) becomes three
small tables on the device: each expert's copy count, its copies' slots, and each slot's index on this rank
(-1 elsewhere). A token t routed to expert e goes to copy t mod copies[e], which spreads a hot expert's
tokens evenly over its copies; every rank routes every token the same way, so each pair is computed once.

The count is the router's top-k ids of the pairs computed here, summed per logical expert with one
index_add per layer (a [E] int64 tensor, no host sync, fixed shapes for CUDA graphs). The tables are
updated in place when the placement changes, so a captured graph keeps reading the live ones.
"""
from __future__ import annotations

from collections import Counter

import torch


class ExpertReplicas:
    """One MoE layer's placement on one rank: `slots` (all ranks') and the routing tables built from it."""

    def __init__(self, slots: list[int], num_experts: int, rank: int, num_ranks: int):
        self.num_experts, self.rank, self.num_ranks = num_experts, rank, num_ranks
        self.per_rank = len(slots) // num_ranks
        self.slots = list(slots)
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # copies, replica slots, local
        self._load: torch.Tensor | None = None

    def local_experts(self) -> list[int]:
        """The logical expert of each of this rank's slots, in the order of its stacked weights."""
        return self.slots[self.rank * self.per_rank:(self.rank + 1) * self.per_rank]

    def _host_tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        copies = Counter(self.slots)
        replica_slots = torch.zeros(self.num_experts, self.num_ranks, dtype=torch.long)
        seen = Counter()
        for slot, expert in enumerate(self.slots):
            replica_slots[expert, seen[expert]] = slot
            seen[expert] += 1
        local = torch.full((len(self.slots),), -1, dtype=torch.long)
        local[self.rank * self.per_rank:(self.rank + 1) * self.per_rank] = torch.arange(self.per_rank)
        return torch.tensor([copies[e] for e in range(self.num_experts)], dtype=torch.long), replica_slots, local

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._tables is None or self._tables[0].device != device:
            self._tables = tuple(t.to(device) for t in self._host_tables())
        return self._tables

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids -> this rank's local slot of each pair, -1 where another rank computes it; the
        pairs kept here are added to the step's load."""
        copies, replica_slots, local_of_slot = self.tables(topk_ids.device)
        flat = topk_ids.reshape(-1)
        token = torch.arange(flat.numel(), device=flat.device) // topk_ids.shape[1]
        local = local_of_slot[replica_slots[flat, token % copies[flat]]]
        self.step_load(topk_ids.device).index_add_(0, flat, (local >= 0).long())
        return local.view_as(topk_ids)

    def step_load(self, device: torch.device) -> torch.Tensor:
        """[E] pairs computed here since the last `take_load`, per logical expert."""
        if self._load is None or self._load.device != device:
            self._load = torch.zeros(self.num_experts, dtype=torch.long, device=device)
        return self._load

    def take_load(self, device: torch.device) -> torch.Tensor:
        """The step's load, and a fresh count for the next step."""
        load = self.step_load(device).clone()
        self._load.zero_()
        return load

    def update(self, slots: list[int]) -> None:
        """Serve `slots` from now on (the weights already moved); the device tables change in place."""
        self.slots = list(slots)
        if self._tables is not None:
            for live, new in zip(self._tables, self._host_tables()):
                live.copy_(new)
