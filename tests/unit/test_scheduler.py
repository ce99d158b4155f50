"""Scheduler behaviour, observed on a real EngineCore over a tiny random Llama (a step costs milliseconds):
the token budget and its splitting, priorities, aborts, preemption by recompute, and block accounting."""
from __future__ import annotations

import random

import helpers
import pytest
from helpers import greedy_params, make_request, run_to_completion

VOCAB = 512


class Recorder:
    """Wraps a scheduler's schedule() to record, per step, [(request_id, index, num_new_tokens)]."""

    def __init__(self, core):
        self.steps: list[list[tuple[str, int, int]]] = []
        real = core.scheduler.schedule

        def schedule():
            out = real()
            if out:
                seqs = core.scheduler.requests
                self.steps.append([(seqs[key].request_id, seqs[key].index, n)
                                   for key, n in out.num_scheduled_tokens.items()])
            return out

        core.scheduler.schedule = schedule

    def tokens_for(self, rid: str) -> list[int]:
        """How many tokens the request got in each step it was scheduled."""
        return [n for step in self.steps for r, _, n in step if r == rid]


def prompts_of(lengths, seed=0):
    return helpers.random_prompts(len(lengths), lengths, VOCAB, seed=seed)


@pytest.fixture(scope="module")
def reference(make_core):
    """Greedy outputs of each prompt run alone, with plenty of blocks and the default budget."""
    cache = {}

    def get(prompt: list[int], max_tokens: int = 16) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in cache:
            core = make_core("llama", enable_prefix_caching=False)
            cache[key] = helpers.generate_tokens(core, [prompt], greedy_params(max_tokens))[0]
        return cache[key]

    return get


# ---- token budget ----------------------------------------------------------------------------
def test_prefill_is_chunked_to_the_step_token_budget(make_core):
    core = make_core(max_num_batched_tokens=16, long_prefill_token_threshold=512)
    rec = Recorder(core)
    core.add_request(make_request("a", prompts_of([50])[0], greedy_params(3)))
    run_to_completion(core)
    assert rec.tokens_for("a") == [16, 16, 16, 2, 1, 1]


def test_every_step_stays_within_the_budget_with_many_requests(make_core):
    core = make_core(max_num_batched_tokens=24, long_prefill_token_threshold=10)
    rec = Recorder(core)
    for i, p in enumerate(prompts_of([7, 40, 3, 25, 60, 12])):
        core.add_request(make_request(f"r{i}", p, greedy_params(8)))
    run_to_completion(core)
    assert all(sum(n for _, _, n in step) <= 24 for step in rec.steps)
    assert all(n <= 10 for step in rec.steps for _, _, n in step)
    assert any(sum(n for _, _, n in step) == 24 for step in rec.steps)  # the budget is actually used up


def test_long_prefill_threshold_keeps_running_decodes_going(make_core):
    """A long prompt arriving while another request decodes is prefilled in chunks of at most
    long_prefill_token_threshold, and the decode is scheduled in every one of those steps."""
    core = make_core(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    rec = Recorder(core)
    short, long_ = prompts_of([4, 100], seed=3)
    core.add_request(make_request("short", short, greedy_params(30)))
    core.step()
    core.step()
    core.add_request(make_request("long", long_, greedy_params(2)))
    run_to_completion(core)
    long_steps = [i for i, step in enumerate(rec.steps) if any(r == "long" for r, _, _ in step)]
    assert rec.tokens_for("long") == [8] * 12 + [4, 1]
    for i in long_steps[:13]:
        assert ("short", 0, 1) in rec.steps[i]


def test_running_requests_are_scheduled_before_waiting_ones(make_core):
    """With a budget that cannot fit everyone, a decoding request keeps its token and the waiting prompt
    gets what is left."""
    core = make_core(max_num_batched_tokens=10, long_prefill_token_threshold=512)
    rec = Recorder(core)
    a, b = prompts_of([5, 30], seed=4)
    core.add_request(make_request("a", a, greedy_params(10)))
    core.step()
    core.add_request(make_request("b", b, greedy_params(2)))
    core.step()
    assert rec.steps[-1] == [("a", 0, 1), ("b", 0, 9)]


def test_max_num_seqs_caps_concurrent_requests(make_core):
    core = make_core(max_num_seqs=3)
    rec = Recorder(core)
    for i, p in enumerate(prompts_of([5, 9, 2, 7, 4, 6], seed=5)):
        core.add_request(make_request(f"r{i}", p, greedy_params(4)))
    run_to_completion(core)
    assert max(len(step) for step in rec.steps) == 3


# ---- priority ----------------------------------------------------------------------------------
def test_lower_priority_value_runs_first_then_arrival_order(make_core):
    core = make_core(max_num_seqs=1)
    rec = Recorder(core)
    prompts = prompts_of([4, 4, 4, 4, 4], seed=6)
    priorities = {"p3": 3, "p1a": 1, "p2": 2, "p0": 0, "p1b": 1}
    for t, ((rid, prio), prompt) in enumerate(zip(priorities.items(), prompts)):
        core.add_request(make_request(rid, prompt, greedy_params(2), priority=prio, arrival_time=1000.0 + t))
    run_to_completion(core)
    order = list(dict.fromkeys(r for step in rec.steps for r, _, _ in step))
    assert order == ["p0", "p1a", "p1b", "p2", "p3"]


def test_a_later_request_with_a_lower_priority_value_is_served_before_an_earlier_one(make_core):
    """The same order rule holds for requests queued behind a running one."""
    core = make_core(max_num_seqs=1)
    rec = Recorder(core)
    prompts = prompts_of([3, 3, 3], seed=7)
    core.add_request(make_request("first", prompts[0], greedy_params(3), priority=5, arrival_time=1.0))
    core.step()  # "first" is running now; a later arrival with a better priority takes its slot
    core.add_request(make_request("late_low", prompts[1], greedy_params(2), priority=9, arrival_time=2.0))
    core.add_request(make_request("late_high", prompts[2], greedy_params(2), priority=-1, arrival_time=3.0))
    run_to_completion(core)
    order = list(dict.fromkeys(r for step in rec.steps for r, _, _ in step))
    assert order == ["first", "late_high", "late_low"]


def test_a_waiting_request_of_strictly_higher_priority_preempts_the_lowest_running_one(make_core, reference):
    core = make_core(max_num_seqs=2)
    rec = Recorder(core)
    low, mid, urgent = prompts_of([6, 7, 5], seed=8)
    core.add_request(make_request("low", low, greedy_params(12), priority=5))
    core.add_request(make_request("mid", mid, greedy_params(12), priority=3))
    core.step()
    core.step()
    core.add_request(make_request("urgent", urgent, greedy_params(12), priority=0))
    core.step()
    assert sorted(r for r, _, _ in rec.steps[-1]) == ["mid", "urgent"]  # "low" gave up its slot
    assert core.stats()["num_preemptions"] == 1
    out = run_to_completion(core)
    assert out[("low", 0)] == reference(low, 12)[2:]  # recomputed, same tokens as alone
    assert out[("urgent", 0)] == reference(urgent, 12)[1:]


def test_a_request_of_higher_priority_preempts_when_kv_blocks_run_out(make_core, reference):
    core = make_core(num_blocks=8, block_size=4, max_num_seqs=8)
    low, urgent = prompts_of([20, 10], seed=9)
    core.add_request(make_request("low", low, greedy_params(8), priority=5))
    core.step()  # "low" holds 6 of the 8 blocks
    core.add_request(make_request("urgent", urgent, greedy_params(8), priority=0))
    core.step()
    assert core.scheduler.requests["low"].status.value == "preempted"
    assert core.stats()["num_preemptions"] == 1
    out = run_to_completion(core)
    assert out[("urgent", 0)] == reference(urgent, 8)[1:]
    assert out[("low", 0)] == reference(low, 8)[1:]


def test_equal_priorities_never_preempt_each_other(make_core):
    core = make_core(max_num_seqs=1)
    rec = Recorder(core)
    a, b = prompts_of([4, 4], seed=10)
    core.add_request(make_request("a", a, greedy_params(6), priority=1))
    core.step()
    core.add_request(make_request("b", b, greedy_params(6), priority=1))
    run_to_completion(core)
    assert core.stats()["num_preemptions"] == 0
    assert [r for step in rec.steps for r, _, _ in step] == ["a"] * 6 + ["b"] * 6


# ---- abort -------------------------------------------------------------------------------------
def _blocks(core) -> int:
    return core.stats()["kv_blocks_used"]


def test_abort_running_request_frees_its_blocks_at_once(make_core):
    core = make_core(block_size=4)
    a, b = prompts_of([20, 13], seed=8)
    core.add_request(make_request("a", a, greedy_params(50)))
    core.add_request(make_request("b", b, greedy_params(50)))
    for _ in range(3):
        core.step()
    held_by_b = len(core.scheduler.requests["b"].block_ids)
    before = _blocks(core)
    core.abort_requests(["a"])
    assert _blocks(core) == held_by_b < before  # before any further step
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs if o.finished] == [("a", "abort")]
    core.abort_requests(["b"])
    assert _blocks(core) == 0
    run_to_completion(core)
    assert not core.has_unfinished_requests()


def test_abort_during_chunked_prefill_frees_its_blocks_at_once(make_core):
    core = make_core(block_size=4, max_num_batched_tokens=8)
    core.add_request(make_request("a", prompts_of([40], seed=9)[0], greedy_params(5)))
    core.step()
    core.step()
    assert _blocks(core) == 4  # 16 prompt tokens computed so far
    core.abort_requests(["a"])
    assert _blocks(core) == 0
    outs = run_to_completion(core)
    assert outs == {("a", 0): []}


def test_abort_waiting_request_removes_it_and_leaves_others_untouched(make_core, reference):
    core = make_core(max_num_seqs=1, block_size=4)
    a, b, c = prompts_of([6, 9, 5], seed=10)
    for rid, p in zip("abc", (a, b, c)):
        core.add_request(make_request(rid, p, greedy_params(16)))
    first = core.step()
    used = _blocks(core)
    assert [r.request_id for r in core.scheduler.waiting] == ["b", "c"]
    core.abort_requests(["b"])
    assert _blocks(core) == used
    assert [r.request_id for r in core.scheduler.waiting] == ["c"]
    out = run_to_completion(core)
    assert [o.request_id for o in first] == ["a"]
    assert first[0].new_token_ids + out[("a", 0)] == reference(a) and out[("c", 0)] == reference(c)
    assert out[("b", 0)] == []
    assert _blocks(core) == 0


def test_abort_of_unknown_request_is_a_no_op(make_core):
    core = make_core()
    core.abort_requests(["nope"])
    assert not core.has_unfinished_requests()


# ---- preemption ---------------------------------------------------------------------------------
def test_preemption_by_recompute_when_blocks_run_out_keeps_outputs_unchanged(make_core, reference):
    """12 blocks of 4 tokens cannot hold four requests growing to 8-14 + 16 tokens each: the scheduler
    must preempt (and recompute) instead of failing, and the greedy outputs stay those of each prompt alone."""
    prompts = prompts_of([8, 14, 10, 12], seed=11)
    core = make_core(num_blocks=12, block_size=4, enable_prefix_caching=False)
    got = helpers.generate_tokens(core, prompts, greedy_params(16))
    assert core.stats()["num_preemptions"] > 0
    assert got == [reference(p) for p in prompts]
    assert _blocks(core) == 0


def test_preemption_with_prefix_caching_keeps_outputs_unchanged(make_core, reference):
    prompts = prompts_of([8, 14, 10, 12], seed=11)
    core = make_core(num_blocks=12, block_size=4, enable_prefix_caching=True)
    got = helpers.generate_tokens(core, prompts, greedy_params(16))
    assert core.stats()["num_preemptions"] > 0
    assert got == [reference(p) for p in prompts]
    assert _blocks(core) == 0


def test_preemption_victim_is_the_lowest_priority_running_request(make_core, reference):
    prompts = prompts_of([8, 8, 8], seed=12)
    core = make_core(num_blocks=9, block_size=4, enable_prefix_caching=False)
    preempted = []
    real = core.scheduler._preempt
    core.scheduler._preempt = lambda r: (preempted.append(r.request_id), real(r))
    for rid, prio, p in zip(["hi", "lo", "mid"], [0, 7, 3], prompts):
        core.add_request(make_request(rid, p, greedy_params(12), priority=prio))
    out = run_to_completion(core)
    assert preempted and preempted[0] == "lo"
    assert [out[(rid, 0)] for rid in ("hi", "lo", "mid")] == [reference(p, 12) for p in prompts]


def test_preemption_victim_among_equal_priorities_is_the_latest_arrival(make_core):
    """Requests of one batch can share an arrival timestamp; arrival order still decides."""
    prompts = prompts_of([8, 8, 8], seed=13)
    core = make_core(num_blocks=9, block_size=4, enable_prefix_caching=False)
    preempted = []
    real = core.scheduler._preempt
    core.scheduler._preempt = lambda r: (preempted.append(r.request_id), real(r))
    for rid, p in zip(["first", "second", "third"], prompts):
        core.add_request(make_request(rid, p, greedy_params(12), arrival_time=1234.5))
    run_to_completion(core)
    assert preempted and preempted[0] == "third"


def test_preempted_request_with_prompt_logprobs_reports_each_position_once(make_core):
    """A request preempted in the middle of its chunked prefill recomputes the prompt; its prompt logprobs
    must still have exactly one entry per prompt token."""
    prompts = prompts_of([30, 30], seed=14)
    core = make_core(num_blocks=10, block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                     enable_prefix_caching=False)
    params = greedy_params(8, prompt_logprobs=1)
    for i, p in enumerate(prompts):
        core.add_request(make_request(f"r{i}", p, params))
    prompt_logprobs = {}
    while core.has_unfinished_requests():
        for o in core.step():
            if o.prompt_logprobs is not None:
                prompt_logprobs[o.request_id] = o.prompt_logprobs
    assert core.stats()["num_preemptions"] > 0
    assert {rid: len(v) for rid, v in prompt_logprobs.items()} == {"r0": 30, "r1": 30}


# ---- accounting ---------------------------------------------------------------------------------
def _assert_pool_idle(core):
    pool = core.kv_manager.pool
    assert core.stats()["kv_blocks_used"] == 0
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(pool.free) == list(range(pool.num_blocks))
    assert all(pool.blocks[b.block_id] is b and b.block_hash == h for h, b in pool.cached.items())
    assert not core.scheduler.running and not core.scheduler.waiting and not core.scheduler.requests


@pytest.mark.parametrize("prefix_caching, num_blocks", [(True, 40), (False, 40), (True, 17)])
def test_idle_engine_holds_zero_blocks_after_random_workloads_with_aborts(make_core, prefix_caching, num_blocks):
    """Random prompts (some sharing a prefix), n, sampling, priorities, salts and aborts at random steps; a
    small pool adds preemptions. After each round the engine is idle and every block is back in the pool."""
    rng = random.Random(1234 + prefix_caching + num_blocks)
    core = make_core(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=12,
                     max_num_seqs=6, enable_prefix_caching=prefix_caching)
    shared = helpers.random_prompts(1, [12], VOCAB, seed=99)[0]
    from tokenloom.core.sampling_params import SamplingParams
    for round_ in range(6):
        live = []
        for i in range(rng.randint(3, 10)):
            rid = f"{round_}-{i}"
            length = rng.randint(1, 40)
            prompt = (shared[: rng.randint(0, 12)] + [rng.randrange(3, VOCAB) for _ in range(length)])
            prompt = prompt[: core.max_model_len - 1]
            n = rng.choice([1, 1, 1, 2, 3])
            params = SamplingParams(temperature=rng.choice([0.0, 1.0]), n=n, max_tokens=rng.randint(1, 20),
                                    ignore_eos=rng.random() < 0.5, seed=rng.randint(0, 100))
            core.add_request(make_request(rid, prompt, params, priority=rng.randint(0, 2),
                                          cache_salt=rng.choice([None, "s"])))
            live.append(rid)
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
            if live and rng.random() < 0.15:
                core.abort_requests([live.pop(rng.randrange(len(live)))])
            assert core.stats()["kv_blocks_used"] <= core.kv_manager.pool.num_blocks
            assert steps < 2000
        _assert_pool_idle(core)
    if num_blocks < 20:
        assert core.stats()["num_preemptions"] > 0


# ---- prefix-cache awareness --------------------------------------------------------------------

def _waiting_scheduler(block_size=4, window=8):
    from tokenloom.config import SchedulerConfig
    from tokenloom.core.request import Request
    from tokenloom.core.sampling_params import SamplingParams
    from tokenloom.scheduler.kv_cache_manager import KVCacheManager
    from tokenloom.scheduler.scheduler import Scheduler
    kv = KVCacheManager(64, block_size, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), kv, 256,
                      prefix_reorder_window=window)

    def request(rid, tokens, priority=0, arrival=0.0):
        return Request(rid, tokens, SamplingParams(max_tokens=1), arrival_time=arrival, priority=priority)
    return sched, kv, request


def _warm_prefix(sched, kv, request, prefix):
    """Compute a request holding `prefix` and finish it, so its full blocks stay cached."""
    warm = request("warm", prefix + [9])
    sched.add_request(warm)
    out = sched.schedule()
    warm.num_computed_tokens += out.num_scheduled_tokens[warm.key]
    kv.cache_computed_blocks(warm)
    sched.finish(warm, "stop")


def test_a_waiting_request_with_a_cached_prefix_is_admitted_first_among_equal_priorities():
    sched, kv, request = _waiting_scheduler()
    prefix = list(range(100, 116))
    _warm_prefix(sched, kv, request, prefix)
    sched.add_request(request("cold", list(range(300, 320)), arrival=1.0))
    sched.add_request(request("hot", prefix + [7, 8, 9], arrival=2.0))
    assert list(sched.schedule().num_scheduled_tokens) == ["hot"]


def test_cached_prefix_preference_never_jumps_a_better_priority():
    sched, kv, request = _waiting_scheduler()
    prefix = list(range(100, 116))
    _warm_prefix(sched, kv, request, prefix)
    sched.add_request(request("urgent", list(range(300, 320)), priority=-1, arrival=1.0))
    sched.add_request(request("hot", prefix + [7, 8, 9], arrival=2.0))
    assert list(sched.schedule().num_scheduled_tokens) == ["urgent"]


def test_cached_prefix_preference_is_bounded_to_a_window_so_nobody_starves():
    sched, kv, request = _waiting_scheduler(window=2)
    prefix = list(range(100, 116))
    _warm_prefix(sched, kv, request, prefix)
    for i in range(3):
        sched.add_request(request(f"cold{i}", list(range(300 + 20 * i, 320 + 20 * i)), arrival=1.0 + i))
    sched.add_request(request("hot", prefix + [7, 8, 9], arrival=9.0))
    assert list(sched.schedule().num_scheduled_tokens) == ["cold0"]
