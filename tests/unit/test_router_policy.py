"""The router's worker choice (tokenloom/router/policy.py) and its command line, without servers."""
from __future__ import annotations

import pytest

from tokenloom.config import ConfigError
from tokenloom.router.cli import add_router_args, settings_from_args
from tokenloom.router.policy import CHUNK_CHARS, CacheAware, LeastLoad, PrefixRecord, RoundRobin, prompt_text
from tokenloom.router.workers import HealthSettings, Worker, WorkerPool

SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4


def workers(*loads: int) -> list[Worker]:
    return [Worker(f"http://w{i}", inflight=load) for i, load in enumerate(loads)]


def test_round_robin_takes_the_workers_in_turn():
    ws, policy = workers(0, 0, 0), RoundRobin()
    assert [policy.choose(ws, None)[0].url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]


def test_least_load_takes_the_worker_with_fewest_open_requests():
    assert LeastLoad().choose(workers(3, 1, 2), None)[0].url == "http://w1"


def test_least_load_gives_idle_workers_their_turns():
    ws, policy = workers(0, 0, 0), LeastLoad()
    assert [policy.choose(ws, None)[0].url for _ in range(4)] == ["http://w0", "http://w1", "http://w2", "http://w0"]


def test_least_load_turns_go_round_among_the_least_loaded_only():
    ws, policy = workers(0, 2, 0), LeastLoad()
    assert [policy.choose(ws, None)[0].url for _ in range(3)] == ["http://w0", "http://w2", "http://w0"]


def test_cache_aware_gives_fresh_prompts_to_idle_workers_in_turn():
    ws, policy = workers(0, 0), CacheAware(max_tree_size=0)  # records stay empty: every worker ties
    prompts = [{"prompt": f"Prompt number {i}, unrelated to the others. " * 4} for i in range(3)]
    assert [policy.choose(ws, p) for p in prompts] == [(ws[0], "fresh"), (ws[1], "fresh"), (ws[0], "fresh")]


def test_cache_aware_sends_a_shared_prefix_back_to_the_worker_that_has_it():
    ws, policy = workers(0, 0), CacheAware()
    first, why = policy.choose(ws, {"prompt": SYSTEM + "What is 2 + 2?"})
    assert why == "fresh"
    other, _ = policy.choose(ws, {"prompt": "Something else entirely, with no prefix in common. " * 4})
    assert other is not first  # a new prefix goes to the worker with the smaller record
    again, why = policy.choose(ws, {"prompt": SYSTEM + "What colour is the sky?"})
    assert (again, why) == (first, "prefix")


def test_cache_aware_ignores_a_match_below_the_cache_threshold():
    ws, policy = workers(0, 0), CacheAware(cache_threshold=0.9)
    first, _ = policy.choose(ws, {"prompt": SYSTEM + "A"})
    second, why = policy.choose(ws, {"prompt": SYSTEM + "B" * len(SYSTEM)})  # half the prompt matches
    assert why == "fresh" and second is not first


def _second_choice(holder_load: int, other_load: int) -> str:
    """Why cache_aware routes a prompt whose prefix worker 0 holds, with these open-request counts."""
    policy, ws = CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5), workers(0, 0)
    assert policy.choose(ws, {"prompt": SYSTEM + "1"})[0] is ws[0]
    ws[0].inflight, ws[1].inflight = holder_load, other_load
    chosen, why = policy.choose(ws, {"prompt": SYSTEM + "2"})
    assert chosen is (ws[1] if why == "balance" else ws[0])
    return why


def test_cache_aware_yields_to_load_only_beyond_both_thresholds():
    assert _second_choice(5, 0) == "balance"  # 5 over the idlest (> 4) and more than 1.5 x as many
    assert _second_choice(10, 7) == "prefix"  # 3 over: within the absolute threshold
    assert _second_choice(16, 11) == "prefix"  # 5 over, but 16 < 1.5 x 11: within the relative one


def test_prompt_text_reads_completions_and_chat_messages_in_order():
    assert prompt_text({"prompt": "hello"}) == "hello"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    chat = prompt_text({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]})
    assert chat.index("S") < chat.index("U")
    assert prompt_text(None) == "" and prompt_text({"input": 1}) == ""


def test_the_prefix_record_is_bounded_least_recently_used_first_out():
    record = PrefixRecord(max_chunks=4)
    old, new = PrefixRecord.hashes("a" * CHUNK_CHARS * 3), PrefixRecord.hashes("b" * CHUNK_CHARS * 3)
    record.insert(old)
    record.insert(new)
    assert len(record) == 4 and record.matched(new) == 3 and record.matched(old) == 0


def test_a_worker_goes_out_after_the_failure_threshold_and_back_after_the_success_threshold():
    pool = WorkerPool(workers(0), HealthSettings(failure_threshold=2, success_threshold=2))
    w = pool.workers[0]
    pool.report(w, ok=False)
    assert w.healthy
    pool.report(w, ok=False)
    assert not w.healthy and pool.healthy() == []
    pool.report(w, ok=True)
    assert not w.healthy
    pool.report(w, ok=True)
    assert w.healthy


def _settings(*argv: str):
    import argparse
    return settings_from_args(add_router_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_router_flags_follow_sglang_names():
    s = _settings("--worker-urls", "http://a:1", "http://b:2/", "--policy", "round_robin", "--cache-threshold", "0.5",
                  "--balance-abs-threshold", "8", "--health-failure-threshold", "1", "--max-payload-size", "1024")
    assert [w.url for w in s.workers()] == ["http://a:1", "http://b:2"]
    assert (s.policy, s.cache_threshold, s.balance_abs_threshold, s.health.failure_threshold,
            s.max_payload_size) == ("round_robin", 0.5, 8, 1, 1024)
    pd = _settings("--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "http://d:2",
                   "--kv-secret", "0123456789abcdef")
    assert [(w.role, w.url) for w in pd.workers()] == [("prefill", "http://p:1"), ("decode", "http://d:1"),
                                                       ("decode", "http://d:2")]


@pytest.mark.parametrize("argv, message", [
    ((), "--worker-urls"),
    (("--pd", "--prefill", "http://p:1"), "--decode"),
    (("--worker-urls", "localhost:8000"), "http://"),
    (("--worker-urls", "http://a:1", "--prefill", "http://p:1"), "need --pd"),
    (("--worker-urls", "http://a:1", "--cache-threshold", "2"), "cache-threshold"),
])
def test_bad_router_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        _settings(*argv)
