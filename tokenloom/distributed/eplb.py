"""Expert parallel load balancing (vLLM's `--enable-eplb`): where each expert of a mixture-of-experts layer
should live, given how many tokens were routed to it over a recent window of steps.

A layer has E logical experts and P = E + R physical slots, P/p on each of p ranks (R: the redundant copies,
`num_redundant_experts`). A token routed to an expert with several copies goes to one of them, tokens spread
evenly, so a rank's load is the sum over its slots of load[e] / copies[e]. The placement is DeepSeek's greedy
EPLB without expert groups:

1. replicate: R times, the expert with the most load per copy gets one more copy (at most one per rank);
2. pack: every copy, heaviest first, goes to the least loaded rank with a free slot and no copy of it yet;
3. stay put: the packed contents go to the ranks that already hold most of them, and an expert that stays
   on its rank keeps its slot, so only the experts that change rank cross the network; and a placement
   that would balance no better than the current one is not taken at all.

Pure functions of lists: the worker calls them on rank 0 with the load summed over the group and
broadcasts the result (tokenloom.worker.expert_balancer), so every rank applies the same placement.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def balanced_placement(load: Sequence[float], current: Sequence[int], num_ranks: int) -> list[int]:
    """The logical expert of each physical slot (rank after rank, len(current) slots) for `load` [E], moving
    as little as possible from `current`."""
    num_experts, per_rank = len(load), len(current) // num_ranks
    copies = replicate(load, len(current) - num_experts, num_ranks)
    placement = stay_put(pack(load, copies, num_ranks, per_rank), current, per_rank)
    if imbalance(rank_loads(load, placement, num_ranks)) < imbalance(rank_loads(load, current, num_ranks)):
        return placement
    return list(current)


def replicate(load: Sequence[float], redundant: int, num_ranks: int) -> list[int]:
    """How many copies each expert gets: one each, and the `redundant` extra ones to the highest load per copy."""
    copies = [1] * len(load)
    for _ in range(redundant):
        expert = max((e for e in range(len(load)) if copies[e] < num_ranks),
                     key=lambda e: (load[e] / copies[e], -e))
        copies[expert] += 1
    return copies


def pack(load: Sequence[float], copies: Sequence[int], num_ranks: int, per_rank: int) -> list[list[int]]:
    """Each rank's experts: the copies heaviest first, each to the least loaded rank that has room and, where
    one does, no copy of that expert yet."""
    items = sorted(((load[e] / copies[e], e) for e in range(len(load)) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for weight, expert in items:
        room = [r for r in range(num_ranks) if len(ranks[r]) < per_rank]
        fresh = [r for r in room if expert not in ranks[r]] or room
        rank = min(fresh, key=lambda r: (totals[r], r))
        ranks[rank].append(expert)
        totals[rank] += weight
    return ranks


def stay_put(packed: list[list[int]], current: Sequence[int], per_rank: int) -> list[int]:
    """`packed`'s rank contents laid out as slots: each given to the rank holding most of it now (greedy by
    overlap), an expert it already holds left in its slot."""
    held = [Counter(current[r * per_rank:(r + 1) * per_rank]) for r in range(len(packed))]
    overlaps = sorted(((sum((Counter(experts) & held[r]).values()), b, r) for b, experts in enumerate(packed)
                       for r in range(len(packed))), key=lambda item: (-item[0], item[1], item[2]))
    rank_of: dict[int, int] = {}
    for _, b, r in overlaps:
        if b not in rank_of and r not in rank_of.values():
            rank_of[b] = r
    slots: list[int] = [-1] * len(current)
    for b, rank in rank_of.items():
        left = Counter(packed[b])
        base = rank * per_rank
        for i in range(per_rank):
            if left[current[base + i]] > 0:
                slots[base + i] = current[base + i]
                left[current[base + i]] -= 1
        rest = iter(left.elements())
        for i in range(per_rank):
            if slots[base + i] < 0:
                slots[base + i] = next(rest)
    return slots


def rank_loads(load: Sequence[float], slots: Sequence[int], num_ranks: int) -> list[float]:
    """Each rank's share of `load` under `slots`, an expert's tokens spread evenly over its copies."""
    copies = Counter(slots)
    per_rank = len(slots) // num_ranks
    return [sum(load[e] / copies[e] for e in slots[r * per_rank:(r + 1) * per_rank]) for r in range(num_ranks)]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the ranks' loads: 1.0 is even, p is everything on one of p ranks (1.0 with no load)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
