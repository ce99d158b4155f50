"""How the data-parallel front end picks a replica (tokenloom/engine/dp_client.py), without engines:
the load score, the prefix map and the router's order of preference (pinned, prefix, least loaded)."""
from __future__ import annotations

import pytest
from helpers import greedy_params, make_request

from tokenloom.config import ConfigError, ParallelConfig
from tokenloom.core.stats import EngineStats
from tokenloom.engine.dp_client import (
    AFFINITY_ABS_SLACK,
    KV_USAGE_WEIGHT,
    WAITING_WEIGHT,
    PrefixMap,
    ReplicaRouter,
    load_score,
)

BLOCK = 4
SHARED = list(range(100, 116))  # four full blocks


def request(rid: str, tokens: list[int], salt: str | None = None):
    return make_request(rid, tokens, greedy_params(4), cache_salt=salt)


def test_the_load_score_weighs_in_flight_waiting_and_kv_usage():
    assert load_score(3, EngineStats()) == 3
    busy = EngineStats(num_waiting=2, kv_cache_usage=0.5)
    assert load_score(3, busy) == 3 + 2 * WAITING_WEIGHT + 0.5 * KV_USAGE_WEIGHT


def test_the_prefix_map_matches_whole_blocks_in_order_and_keeps_salts_apart():
    m = PrefixMap(BLOCK)
    hashes = m.hashes(SHARED + [1, 2], None)
    assert len(hashes) == 4  # the partial block is not hashed
    m.record(hashes, rank=1)
    assert m.match(m.hashes(SHARED[:8] + [9, 9, 9, 9], None), {0, 1}) == (1, 2)
    assert m.match(m.hashes(SHARED, "tenant-b"), {0, 1}) == (None, 0)
    assert m.match(hashes, {0}) == (None, 0)  # the holder is not serving
    m.forget(1)
    assert m.match(hashes, {0, 1}) == (None, 0)


def test_the_prefix_map_is_bounded_least_recently_used_first_out():
    m = PrefixMap(BLOCK, max_entries=4)
    old, new = m.hashes(SHARED, None), m.hashes([7] * 16, None)
    m.record(old, 0)
    m.record(new, 1)
    assert m.match(new, {0, 1}) == (1, 4) and m.match(old, {0, 1}) == (None, 0)


def test_a_pinned_request_goes_where_it_says_whatever_the_load():
    router = ReplicaRouter(2, BLOCK)
    assert router.choose(request("a", SHARED), {0: 0.0, 1: 50.0}, pinned=1) == 1
    assert router.decisions["pinned"] == 1


def test_a_prefix_goes_back_to_its_replica_and_new_prompts_to_the_least_loaded():
    router = ReplicaRouter(2, BLOCK)
    assert router.choose(request("a", SHARED + [1]), {0: 1.0, 1: 0.0}, pinned=None) == 1  # least loaded
    assert router.choose(request("b", SHARED + [2]), {0: 0.0, 1: 2.0}, pinned=None) == 1  # holds the prefix
    assert router.choose(request("c", [5] * 16), {0: 0.0, 1: 2.0}, pinned=None) == 0
    assert router.decisions == {"pinned": 0, "prefix": 1, "load": 2}


def distinct(rid: str, token: int):
    """A request whose prompt shares no block with another `distinct` one."""
    return request(rid, [token] * 16)


def test_idle_replicas_take_their_turns():
    router = ReplicaRouter(3, BLOCK)
    idle = {0: 0.0, 1: 0.0, 2: 0.0}
    assert [router.choose(distinct(f"r{i}", i), idle, pinned=None) for i in range(4)] == [0, 1, 2, 0]


def test_turns_go_round_among_the_least_loaded_only():
    router = ReplicaRouter(3, BLOCK)
    scores = {0: 0.0, 1: 1.0, 2: 0.0}
    assert [router.choose(distinct(f"r{i}", i), scores, pinned=None) for i in range(3)] == [0, 2, 0]


def test_a_prefix_hit_or_a_pinned_request_does_not_take_a_turn():
    router = ReplicaRouter(2, BLOCK)
    idle = {0: 0.0, 1: 0.0}
    assert router.choose(request("a", SHARED + [1]), idle, pinned=None) == 0
    assert router.choose(request("b", SHARED + [2]), idle, pinned=None) == 0  # back to its prefix
    assert router.choose(distinct("c", 7), idle, pinned=0) == 0
    assert router.choose(distinct("d", 8), idle, pinned=None) == 1  # replica 1's turn, not taken before


@pytest.mark.parametrize("holder_score, least_score, goes_to_holder", [
    (AFFINITY_ABS_SLACK, 0.0, True),  # not more than the absolute slack above the least loaded
    (AFFINITY_ABS_SLACK + 1, 0.0, False),  # beyond both slacks
    (AFFINITY_ABS_SLACK + 11, 10.0, True),  # beyond the absolute slack, but not twice as busy
])
def test_prefix_affinity_yields_to_load_beyond_both_slacks(holder_score, least_score, goes_to_holder):
    router = ReplicaRouter(2, BLOCK)
    router.choose(request("a", SHARED), {0: 0.0, 1: 0.0}, pinned=None)  # replica 0 now holds it
    chosen = router.choose(request("b", SHARED), {0: holder_score, 1: least_score}, pinned=None)
    assert chosen == (0 if goes_to_holder else 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"data_parallel_size": 0}, "data_parallel_size must be >= 1"),
    ({"data_parallel_size": 2, "nnodes": 2}, "runs its replicas on one node"),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2, "master_port": 29500}, "--master-port"),
])
def test_data_parallel_configs_that_cannot_work_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**kwargs)


def test_the_offline_llm_refuses_data_parallel_with_a_clear_error():
    from tokenloom import LLM
    with pytest.raises(ConfigError, match="tokenloom serve --data-parallel-size"):
        LLM(data_parallel_size=2)
