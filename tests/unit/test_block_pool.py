"""Block pool and prefix cache: reference counts, eviction order, shared prefixes, forks, salts; and, on a tiny
engine, that serving from the prefix cache changes nothing in the output."""
from __future__ import annotations

import helpers
import pytest
from helpers import greedy_params, make_request, run_to_completion

from tokenloom.core.contract import sequence_key
from tokenloom.core.request import Request
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.scheduler.block_pool import BlockPool, hash_block
from tokenloom.scheduler.kv_cache_manager import KVCacheManager

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None, **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), cache_salt=salt)


def compute(kv: KVCacheManager, r: Request, cached: list[int] = ()) -> None:
    """What the scheduler and engine do for a request's whole prompt in one step."""
    n = r.num_tokens - len(cached) * kv.block_size
    assert kv.allocate(r, n, list(cached))
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)


def refs(pool: BlockPool, ids) -> list[int]:
    return [pool.blocks[b].ref_cnt for b in ids]


# ---- BlockPool ------------------------------------------------------------------------------------
def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = BlockPool(8)
    ids = pool.allocate(5)
    assert len(set(ids)) == 5 and refs(pool, ids) == [1] * 5
    assert pool.num_used == 5 and pool.num_free == 3


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_freed_blocks_are_evicted_least_recently_freed_first_and_tail_blocks_first():
    pool = BlockPool(8)
    a = pool.allocate(3)  # 0, 1, 2
    b = pool.allocate(3)  # 3, 4, 5
    pool.release(b)  # freed first: evicted first, tail (5) before head (3)
    pool.release(a)
    assert pool.allocate(8) == [6, 7] + b[::-1] + a[::-1]


def test_evicted_block_loses_its_hash_and_others_keep_theirs():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    hashes = [hash_block(None, [i], None) for i in range(3)]
    for bid, h in zip(ids, hashes):
        pool.register(bid, h)
    pool.release(ids)
    assert [pool.lookup(h).block_id for h in hashes] == ids  # free, but still cached
    assert pool.allocate(1) == [ids[2]]
    assert pool.lookup(hashes[2]) is None
    assert pool.lookup(hashes[0]).block_id == ids[0] and pool.lookup(hashes[1]).block_id == ids[1]


def test_touch_revives_a_cached_free_block_out_of_the_free_list():
    pool = BlockPool(2)
    (bid,) = pool.allocate(1)
    pool.register(bid, b"h")
    pool.release([bid])
    pool.touch([pool.lookup(b"h").block_id])
    assert pool.blocks[bid].ref_cnt == 1 and bid not in pool.free
    assert pool.allocate(1) != [bid]


def test_shared_block_returns_to_the_free_list_only_with_its_last_reference():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.touch(ids)
    pool.release(ids)
    assert refs(pool, ids) == [1, 1] and pool.num_used == 2
    pool.release(ids)
    assert pool.num_used == 0


def test_releasing_more_often_than_taken_is_an_error():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.release(ids)
    with pytest.raises(RuntimeError):
        pool.release(ids)


def test_reset_cache_is_refused_while_blocks_are_in_use():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.register(ids[0], b"h")
    assert pool.reset_cache() is False and pool.lookup(b"h") is not None
    pool.release(ids)
    assert pool.reset_cache() is True and pool.lookup(b"h") is None


def test_caching_disabled_never_registers_or_finds_blocks():
    pool = BlockPool(2, enable_caching=False)
    ids = pool.allocate(1)
    pool.register(ids[0], b"h")
    assert pool.lookup(b"h") is None


# ---- KVCacheManager: prefixes, salts, forks -----------------------------------------------------------
PREFIX = list(range(100, 108))  # two full blocks of 4


def test_requests_sharing_a_prefix_share_its_full_blocks_with_reference_counts():
    kv = KVCacheManager(16, BS)
    a = req("a", PREFIX + [1, 2, 3])
    compute(kv, a)
    b = req("b", PREFIX + [7, 8, 9, 10, 11])
    hits = kv.find_cached_prefix(b)
    assert hits == a.block_ids[:2]  # a's third block is partial: never shared
    compute(kv, b, hits)
    assert refs(kv.pool, a.block_ids[:2]) == [2, 2]
    assert refs(kv.pool, [a.block_ids[2]] + b.block_ids[2:]) == [1, 1, 1]
    kv.free(a)
    assert refs(kv.pool, b.block_ids) == [1, 1, 1, 1]
    kv.free(b)
    assert kv.pool.num_used == 0
    assert kv.find_cached_prefix(req("c", PREFIX + [5])) == hits  # still cached after both finished


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(16, BS)
    compute(kv, req("a", PREFIX + [1]))
    assert len(kv.find_cached_prefix(req("b", PREFIX))) == 1  # 8 tokens: block 2 holds the last one


def test_different_cache_salts_never_share_blocks():
    kv = KVCacheManager(16, BS)
    compute(kv, req("a", PREFIX + [1], salt="alice"))
    assert kv.find_cached_prefix(req("b", PREFIX + [1], salt="bob")) == []
    assert kv.find_cached_prefix(req("c", PREFIX + [1], salt=None)) == []
    assert len(kv.find_cached_prefix(req("d", PREFIX + [1], salt="alice"))) == 2
    compute(kv, req("e", PREFIX + [1], salt=None))
    assert kv.find_cached_prefix(req("f", PREFIX + [1], salt="bob")) == []


def test_prompt_logprobs_requests_bypass_the_prefix_cache():
    kv = KVCacheManager(16, BS)
    compute(kv, req("a", PREFIX + [1]))
    assert kv.find_cached_prefix(req("b", PREFIX + [1], prompt_logprobs=0)) == []


def test_evicting_for_new_work_takes_a_finished_requests_tail_and_keeps_its_prefix():
    kv = KVCacheManager(5, BS)
    a = req("a", PREFIX + [1, 2, 3, 4])  # three full cached blocks
    compute(kv, a)
    head, tail = a.block_ids[:2], a.block_ids[2]
    kv.free(a)
    assert kv.allocate(req("y", [8] * 12), 12)  # two never-used blocks, then a's tail
    assert kv.pool.blocks[tail].ref_cnt == 1
    assert kv.find_cached_prefix(req("b", PREFIX + [1, 2, 3, 4, 5])) == head


def test_allocation_counts_cached_free_blocks_it_revives():
    """Hitting cached blocks that sit in the free list uses them up; the new blocks must fit in the rest."""
    kv = KVCacheManager(3, BS)
    a = req("a", PREFIX + [1])
    compute(kv, a)
    kv.free(a)  # 3 free blocks, two of them cached
    b = req("b", PREFIX + [1, 2, 3, 4, 5])  # 2 cached blocks + 2 new ones: only 1 other block is free
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert not kv.allocate(b, b.num_tokens - 8, hits)
    assert kv.pool.num_used == 0 and b.block_ids == []
    assert kv.allocate(req("c", PREFIX + [1, 2]), 2, hits)  # 2 cached + 1 new fits


def test_fork_shares_full_blocks_and_copies_the_partial_last_block():
    kv = KVCacheManager(16, BS)
    parent = req("p", list(range(10)), n=3, seed=1)
    compute(kv, parent)
    child = parent.fork(1)
    src, dst = kv.fork(parent, child)
    assert src == parent.block_ids[2] and child.block_ids == parent.block_ids[:2] + [dst]
    assert refs(kv.pool, parent.block_ids) == [2, 2, 1] and refs(kv.pool, [dst]) == [1]
    kv.free(child)
    kv.free(parent)
    assert kv.pool.num_used == 0


def test_fork_at_a_block_boundary_shares_every_block_without_copying():
    kv = KVCacheManager(16, BS)
    parent = req("p", PREFIX, n=2)
    compute(kv, parent)
    child = parent.fork(1)
    assert kv.fork(parent, child) is None
    assert child.block_ids == parent.block_ids and refs(kv.pool, parent.block_ids) == [2, 2]


# ---- on a tiny engine ------------------------------------------------------------------------------------
def test_n_samples_fork_the_prompt_blocks_instead_of_recomputing_the_prefill(make_core):
    core = make_core(block_size=BS)
    scheduled = []
    real = core.scheduler.schedule
    core.scheduler.schedule = lambda: (lambda out: (scheduled.append(out.num_tokens), out)[1])(real())
    prompt = helpers.random_prompts(1, [10], 512, seed=21)[0]
    core.add_request(make_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6)))
    core.step()
    seqs = [core.scheduler.requests[sequence_key("r", i)] for i in range(3)]
    shared = seqs[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in seqs)
    assert refs(core.kv_manager.pool, shared) == [3, 3]
    assert len({s.block_ids[2] for s in seqs}) == 3  # the partial block is copied per sequence
    out = run_to_completion(core)
    assert scheduled == [10, 3, 3, 3, 3, 3]  # the prompt is computed once; then one decode per sequence
    assert sorted(out) == [("r", 0), ("r", 1), ("r", 2)] and all(len(t) == 5 for t in out.values())
    assert core.stats()["kv_blocks_used"] == 0


def test_output_served_from_the_prefix_cache_equals_uncached_output(make_core):
    system = helpers.random_prompts(1, [21], 512, seed=22)[0]
    prompts = [system + tail for tail in helpers.random_prompts(5, [1, 3, 6, 9, 14], 512, seed=23)]
    uncached = helpers.generate_tokens(make_core(block_size=BS, enable_prefix_caching=False), prompts,
                                       greedy_params(12))
    core = make_core(block_size=BS, enable_prefix_caching=True)
    first = helpers.generate_tokens(core, prompts[:1], greedy_params(12), prefix="warm")
    cached_tokens = {}
    for i, p in enumerate(prompts):
        core.add_request(make_request(f"c{i}", p, greedy_params(12)))
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            cached_tokens[o.request_id] = o.num_cached_tokens
    assert first[0] == uncached[0]
    assert [out[f"c{i}"] for i in range(5)] == uncached
    assert all(cached_tokens[f"c{i}"] >= 20 for i in range(5))  # 5 full blocks of the shared 21 tokens
    assert core.stats()["prefix_cache_hits"] > 0 and core.stats()["kv_blocks_used"] == 0


def test_cache_salt_isolates_requests_in_the_engine(make_core):
    core = make_core(block_size=BS)
    prompt = helpers.random_prompts(1, [17], 512, seed=24)[0]
    results = {}
    for rid, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", None)]:
        core.add_request(make_request(rid, prompt, greedy_params(4), cache_salt=salt))
        while core.has_unfinished_requests():
            for o in core.step():
                results.setdefault(rid, (o.num_cached_tokens, []))[1].extend(o.new_token_ids)
    assert {rid: cached for rid, (cached, _) in results.items()} == {"a": 0, "b": 0, "c": 16, "d": 0}
    assert len({tuple(tokens) for _, tokens in results.values()}) == 1


def test_n_samples_fork_with_no_free_block_recompute_instead_of_failing(make_core):
    """When the prompt's partial last block cannot be copied for every sequence (the pool is full), the
    sequences left without a block are preempted and recomputed; every sequence still gets its own tokens."""
    prompts = helpers.random_prompts(2, [10, 10], 512, seed=25)
    sampled = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)

    def run(**engine_args):
        core = make_core(block_size=BS, **engine_args)
        core.add_request(make_request("a", prompts[0], greedy_params(8)))
        core.add_request(make_request("b", prompts[1], sampled))
        return core, run_to_completion(core)

    _, roomy = run()
    core, tight = run(num_blocks=6)  # a and b's prompts take 3 blocks each: nothing left to fork into
    assert core.stats()["num_preemptions"] > 0
    assert tight == roomy and sorted(tight) == [("a", 0), ("b", 0), ("b", 1), ("b", 2)]
    assert core.stats()["kv_blocks_used"] == 0
