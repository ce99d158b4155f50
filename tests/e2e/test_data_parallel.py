"""Data parallel (`tokenloom serve --data-parallel-size 2`): two EngineCore replicas behind one server.

Correctness reference: the plain engine (the offline LLM, one engine, all prompts batched) on the same
weights; greedy outputs through the two replicas must be token-identical to it. The tests then check
where requests go (both replicas get work, idle replicas take turns, a pinned `data_parallel_rank` goes
where asked, a repeated prefix goes back to the replica that holds it) by reading each replica's
prefix-cache counters on /metrics (labelled engine="0" / engine="1"), and that killing one replica fails
only its requests.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from server_harness import ServerProcess, metric_values, stream_in_thread

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Water boils at", "In 1492, Columbus",
           "List three primary colors:", "1, 1, 2, 3, 5, 8, 13,", "The opposite of hot is", "SELECT name FROM users"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server():
    # No step timeout: on a loaded machine a slow step must not pass for a hung one (the test kills a replica).
    srv = ServerProcess("--data-parallel-size", "2", "--restart-engine", "--num-blocks", "128",
                        "--engine-step-timeout", "0", startup_timeout=600)
    try:
        yield srv
    finally:
        srv.terminate()


def _queries(srv) -> tuple[float, float]:
    """Prompt tokens each replica has looked up in its prefix cache (one per prompt token it was given)."""
    m = metric_values(srv.get("/metrics").text)
    return (m['tokenloom:prefix_cache_queries_total{engine="0"}'],
            m['tokenloom:prefix_cache_queries_total{engine="1"}'])


def _complete(srv, prompt: str, **extra) -> httpx.Response:
    return srv.post("/v1/completions", json={"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                                             "ignore_eos": True, "return_token_ids": True, **extra})


def test_outputs_equal_one_engine_and_both_replicas_get_work(server, make_llm):
    from tokenloom.core.sampling_params import SamplingParams

    before = _queries(server)
    results: dict[int, httpx.Response] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _complete(server, PROMPTS[i])))
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    got = [results[i].json()["choices"][0]["token_ids"] for i in range(len(PROMPTS))]

    llm = make_llm(num_blocks=128)
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == [list(w) for w in want]
    after = _queries(server)
    assert after[0] > before[0] and after[1] > before[1], (before, after)


def test_a_pinned_request_runs_on_the_replica_it_names(server):
    for rank in (1, 0):
        before = _queries(server)
        r = _complete(server, f"Pinned to replica {rank}: the weather today is", data_parallel_rank=rank)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        after = _queries(server)
        assert after[rank] - before[rank] == prompt_tokens
        assert after[1 - rank] == before[1 - rank]


def test_a_rank_out_of_range_is_a_400_naming_the_field(server):
    r = _complete(server, "Hi", data_parallel_rank=2)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "data_parallel_rank"


def _wait_both_idle(srv, timeout: float = 60.0) -> None:
    """Until both replicas report nothing running or waiting and no KV block in use: their load scores
    are then equal (0), and the next request without a known prefix goes to the replica whose turn it is."""
    deadline = time.time() + timeout
    while True:
        m = metric_values(srv.get("/metrics").text)
        busy = {k: v for k, v in m.items() if v and k.split("{")[0] in (
            "tokenloom:num_requests_running", "tokenloom:num_requests_waiting", "tokenloom:kv_cache_used_blocks")}
        if not busy:
            return
        assert time.time() < deadline, busy
        time.sleep(0.2)


def _replica_that_ran(srv, request) -> int:
    """Which replica looked the prompt up in its prefix cache while `request()` ran."""
    before = _queries(srv)
    request()
    after = _queries(srv)
    ran = [rank for rank in (0, 1) if after[rank] != before[rank]]
    assert len(ran) == 1, (before, after)
    return ran[0]


def test_idle_replicas_take_turns_with_sequential_requests(server):
    ranks = []
    for i in range(3):
        _wait_both_idle(server)
        ranks.append(_replica_that_ran(server, lambda i=i: _complete(server, f"Request {i} of three: hello")))
    assert ranks[1] == 1 - ranks[0] and ranks[2] == ranks[0], ranks


def test_a_repeated_prefix_goes_back_to_the_replica_that_holds_it(server):
    """Idle replicas take turns, so without prefix affinity the second request would go to the other
    replica: on a hit it goes where the first one ran, and the next unrelated request takes the turn."""
    shared = "You are a careful assistant. Answer in one short sentence, and never use lists. " * 3
    _wait_both_idle(server)
    holder = _replica_that_ran(server, lambda: _complete(server, shared + "Question: what is 2 + 2?"))
    _wait_both_idle(server)
    got: dict[str, httpx.Response] = {}
    again = _replica_that_ran(server, lambda: got.setdefault(
        "r", _complete(server, shared + "Question: what colour is the sky?")))
    assert again == holder
    assert got["r"].json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    _wait_both_idle(server)
    assert _replica_that_ran(server, lambda: _complete(server, "Unrelated: name a fruit.")) == 1 - holder


def _wait_health(srv, status: str, timeout: float) -> dict:
    deadline, seen = time.time() + timeout, []
    while time.time() < deadline:
        body = srv.get("/health", timeout=5).json()
        if body["status"] == status:
            return body
        seen.append(body)
        time.sleep(0.1)
    raise AssertionError(f"/health never said {status!r}: {seen[-3:]}\n{srv.log_text()}")


def test_a_killed_replica_fails_only_its_requests_and_restarts(server):
    health = server.get("/health").json()
    assert health["status"] == "ok" and [e["alive"] for e in health["engines"]] == [True, True]
    body = {"prompt": "A long story about a lighthouse keeper:", "max_tokens": 1500, "ignore_eos": True}
    t0, victim = stream_in_thread(server.url, {**body, "data_parallel_rank": 0})
    t1, survivor = stream_in_thread(server.url, {**body, "max_tokens": 60, "data_parallel_rank": 1})
    deadline = time.time() + 60
    while not (victim.get("events") and survivor.get("events")) and time.time() < deadline:
        time.sleep(0.05)
    os.kill(health["engines"][0]["pid"], signal.SIGKILL)
    down = _wait_health(server, "degraded", 10)
    assert [e["alive"] for e in down["engines"]] == [False, True]
    t0.join(30)
    t1.join(120)
    assert victim["events"][-2]["error"]["code"] == "engine_dead"
    assert survivor["events"][-1] == "[DONE]" and "error" not in survivor["events"][-2]
    assert survivor["events"][-2]["choices"][0]["finish_reason"] == "length"
    # While replica 0 is down (or restarting) the server keeps answering on replica 1.
    assert _complete(server, "Still serving?").status_code == 200
    _wait_health(server, "ok", 120)
    m = metric_values(server.get("/metrics").text)
    assert m['tokenloom:engine_restarts_total{engine="0"}'] == 1
    assert m['tokenloom:engine_restarts_total{engine="1"}'] == 0
    assert _complete(server, "Back again", data_parallel_rank=0).status_code == 200
