"""Moving expert weights between ranks when the load balancer re-places a layer (tokenloom.distributed.eplb).

Every rank derives the same list of moves from the old and new placements, so no rank has to be told what
to send or receive: a slot whose expert changes takes it from a slot of its own rank when it can (a copy in
memory), else from a rank that holds it (point-to-point over the tensor-parallel group: gloo on CPU, NCCL on
CUDA). All of a layer's sends and receives go out as one batch, so two ranks swapping experts cannot wait on
each other. Nothing is written until every transfer has arrived, so a slot read for a send is still the old
expert.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ExpertMove:
    slot: int  # the physical slot that takes the expert
    expert: int
    source: int  # a physical slot that holds it now


def plan_moves(current: Sequence[int], target: Sequence[int], num_ranks: int) -> list[ExpertMove]:
    """The moves from `current` to `target` (physical slot -> logical expert, rank after rank): the source is a
    slot on the receiving rank where there is one, else the holders take turns."""
    per_rank = len(current) // num_ranks
    holders: dict[int, list[int]] = defaultdict(list)
    for slot, expert in enumerate(current):
        holders[expert].append(slot)
    moves = []
    for slot, expert in enumerate(target):
        if current[slot] == expert:
            continue
        own = [s for s in holders[expert] if s // per_rank == slot // per_rank]
        source = own[0] if own else holders[expert][slot % len(holders[expert])]
        moves.append(ExpertMove(slot, expert, source))
    return moves


def exchange_experts(moves: Sequence[ExpertMove], per_rank: int, rank: int,
                     read: Callable[[int], list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """This rank's part of `moves`; returns the weights of each of its slots that changed (local index ->
    tensors, as `read(local index)` gives them for a slot it holds now)."""
    arrived: dict[int, list[torch.Tensor]] = {}
    ops: list[dist.P2POp] = []
    template: list[torch.Tensor] | None = None
    for index, move in enumerate(moves):
        sender, receiver = move.source // per_rank, move.slot // per_rank
        if receiver == rank and sender == rank:
            arrived[move.slot % per_rank] = [t.clone() for t in read(move.source % per_rank)]
        elif sender == rank:
            tensors = [t.contiguous() for t in read(move.source % per_rank)]
            ops += [dist.P2POp(dist.isend, t, receiver, tag=index * len(tensors) + k) for k, t in enumerate(tensors)]
        elif receiver == rank:
            template = template or read(0)
            buffers = [torch.empty_like(t) for t in template]
            arrived[move.slot % per_rank] = buffers
            ops += [dist.P2POp(dist.irecv, b, sender, tag=index * len(buffers) + k) for k, b in enumerate(buffers)]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return arrived
