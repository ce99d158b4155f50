"""The EngineCore's stats as they cross to the API server with every step and heartbeat.

Gauges (running, waiting, KV usage) and cumulative counters (the frontend turns counter rises into
Prometheus increments, metrics.py). Speculative decoding and KV-connector fields are None when the
engine has no drafter or connector. `EngineCore.stats()` stays a plain dict for the offline `LLM`; the
EngineCore process converts it with `engine_stats` before sending, so an ill-typed value fails there.
"""
from __future__ import annotations

from collections.abc import Mapping

import msgspec


class EngineStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    generation_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    batched_tokens: int = 0
    spec_num_drafts: int | None = None
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    spec_num_accepted_tokens_per_pos: list[int] | None = None
    kv_transfer_leases: int | None = None
    kv_transfer_pulling: int | None = None
    kv_transfer_sent: int | None = None
    kv_transfer_expired: int | None = None
    kv_offload_blocks: int | None = None
    kv_offload_saved: int | None = None
    kv_offload_loaded: int | None = None
    # The expert load balancer (--enable-eplb): re-placements and expert copies moved so far; the latest
    # window's load max/mean per rank, measured and as the new placement plans it.
    eplb_rebalances: int | None = None
    eplb_experts_moved: int | None = None
    eplb_imbalance: float | None = None
    eplb_planned_imbalance: float | None = None


# The fields summed over data-parallel replicas when they are set (None stays None).
_OPTIONAL_COUNTS = ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens", "kv_transfer_leases",
                    "kv_transfer_pulling", "kv_transfer_sent", "kv_transfer_expired", "kv_offload_blocks",
                    "kv_offload_saved", "kv_offload_loaded", "eplb_rebalances", "eplb_experts_moved")
_OPTIONAL_WORST = ("eplb_imbalance", "eplb_planned_imbalance")  # the most imbalanced replica's
_COUNTS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "prefix_cache_queries",
           "prefix_cache_hits", "num_preemptions", "generation_tokens", "prompt_tokens", "steps", "batched_tokens")


def engine_stats(values: Mapping[str, object]) -> EngineStats:
    """`EngineCore.stats()` as the typed struct (keys it does not know are left out; a wrong type raises)."""
    return msgspec.convert(values, EngineStats)


def sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Several replicas' stats as one engine's: counts and counters summed, KV usage the mean."""
    total = EngineStats()
    if not stats:
        return total
    for name in _COUNTS:
        setattr(total, name, sum(getattr(s, name) for s in stats))
    for name in _OPTIONAL_COUNTS:
        values = [getattr(s, name) for s in stats if getattr(s, name) is not None]
        setattr(total, name, sum(values) if values else None)
    for name in _OPTIONAL_WORST:
        values = [getattr(s, name) for s in stats if getattr(s, name) is not None]
        setattr(total, name, max(values) if values else None)
    per_pos = [s.spec_num_accepted_tokens_per_pos for s in stats if s.spec_num_accepted_tokens_per_pos is not None]
    if per_pos:
        total.spec_num_accepted_tokens_per_pos = [sum(column) for column in zip(*per_pos)]
    total.kv_cache_usage = sum(s.kv_cache_usage for s in stats) / len(stats)
    return total
