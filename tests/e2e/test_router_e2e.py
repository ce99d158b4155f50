"""`tokenloom router` in front of two real `tokenloom serve` processes (embedded model).

What is checked against what: a response through the router against the same request sent to the
worker directly (streamed, event by event); prefix-cache hits that the workers themselves report on
their /metrics under round_robin and under cache_aware for the same shared-prefix load; health
checks against a worker that is really frozen (SIGSTOP) and then resumed; retries against a port
where nothing listens (before the start) and a worker killed mid-stream (after it: no retry).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from helpers import free_port
from router_harness import RouterProcess
from server_harness import ServerProcess, metric_values


@pytest.fixture(scope="module")
def workers():
    started: list[ServerProcess] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            # A long heartbeat timeout: the health-check test freezes a server, and its engine must not
            # take the frozen frontend's silence for its own death.
            started.append(ServerProcess("--num-blocks", "128", "--max-num-seqs", "8",
                                         "--engine-heartbeat-timeout", "300", "--engine-step-timeout", "0",
                                         startup_timeout=600))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]  # both load their weights at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield sorted(started, key=lambda s: s.url)
    finally:
        for srv in started:
            srv.kill()


def _sample(metrics: dict[str, float], name: str, **labels: str) -> float:
    """The value of the sample of `name` with these labels (in whatever order /metrics prints them)."""
    for key, value in metrics.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    raise KeyError(f"{name} {labels} not in {sorted(metrics)}")


def _events(client_url: str, body: dict) -> list:
    with httpx.stream("POST", client_url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _content(events: list[str]) -> list:
    """What a stream says, without the per-response id and timestamp."""
    out = []
    for e in events:
        if e == "[DONE]":
            out.append(e)
            continue
        data = json.loads(e)
        out.append([(c["index"], c["text"], c.get("finish_reason")) for c in data["choices"]])
    return out


def test_a_stream_through_the_router_equals_the_stream_from_the_worker(workers):
    a, b = workers
    body = {"prompt": "Write a list of fruits:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with RouterProcess("--worker-urls", a.url, b.url, "--policy", "round_robin") as router:
        through = [_events(router.url, body) for _ in range(2)]  # one on each worker
        direct = _events(a.url, body)
        assert _content(through[0]) == _content(through[1]) == _content(direct)
        assert len(direct) > 8  # token by token, not one block
        m = router.metrics()
        assert _sample(m, "tokenloom_router_requests_total", worker=a.url, status="200") == 1
        assert _sample(m, "tokenloom_router_requests_total", worker=b.url, status="200") == 1


def _prefix_hits(srvs) -> float:
    return sum(metric_values(s.get("/metrics").text)["tokenloom:prefix_cache_hits_total"] for s in srvs)


def _shared_prefix_load(router_url: str) -> None:
    """Two system prompts of ~3 KV blocks, each asked twice in a row (P1 P1 P2 P2), one token each."""
    prefixes = [f"System prompt {k}: you are an expert on {topic}; answer briefly and precisely. " * 3
                for k, topic in ((1, "astronomy"), (2, "cooking"))]
    for i in range(4):
        r = httpx.post(router_url + "/v1/completions", timeout=120,
                       json={"prompt": prefixes[i // 2] + f"Question {i}: one fact?", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_cache_aware_gets_more_prefix_hits_than_round_robin(workers):
    hits = {}
    for policy in ("round_robin", "cache_aware"):
        for srv in workers:
            assert srv.post("/reset_prefix_cache").status_code == 200
        before = _prefix_hits(workers)
        with RouterProcess("--worker-urls", *[w.url for w in workers], "--policy", policy) as router:
            _shared_prefix_load(router.url)
        hits[policy] = _prefix_hits(workers) - before
    # round_robin sends the second request of each pair to the other worker (a miss), cache_aware to
    # the worker that ran the first (a hit on the prefix's full blocks).
    assert hits["round_robin"] == 0 and hits["cache_aware"] >= 2 * 32, hits


# A live worker answers /health in milliseconds and a frozen one never does: a 5 s check timeout keeps a
# loaded machine from taking the live one out, and two failed checks take the frozen one out within
# 2 x (interval + timeout) = 11 s, well inside the wait below.
HEALTH_CHECK_TIMEOUT = 5.0
HEALTH_CHECK_INTERVAL = 0.5
HEALTH_WAIT = 30.0


@pytest.mark.slow  # health checks' failure and success thresholds waited out, ~12 s (make soak-ci)
def test_a_frozen_worker_is_taken_out_and_brought_back_by_health_checks(workers):
    a, b = workers
    with RouterProcess("--worker-urls", a.url, b.url, "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL),
                       "--health-check-timeout-secs", str(HEALTH_CHECK_TIMEOUT), "--health-failure-threshold", "2",
                       "--health-success-threshold", "2") as router:
        os.kill(b.pid, signal.SIGSTOP)
        try:
            deadline = time.time() + HEALTH_WAIT
            while router.workers()[b.url] and time.time() < deadline:
                time.sleep(0.1)
            assert router.workers() == {a.url: True, b.url: False}
            # Requests now go to the live worker, none waits on the frozen one.
            for _ in range(2):
                r = httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30)
                assert r.status_code == 200
        finally:
            os.kill(b.pid, signal.SIGCONT)
        deadline = time.time() + HEALTH_WAIT
        while not router.workers()[b.url] and time.time() < deadline:
            time.sleep(0.1)
        assert router.workers() == {a.url: True, b.url: True}
        assert _sample(router.metrics(), "tokenloom_router_requests_total", worker=a.url, status="200") == 2


def test_a_request_that_did_not_start_is_retried_on_another_worker(workers):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with RouterProcess("--worker-urls", dead, workers[0].url, "--policy", "round_robin") as router:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert _sample(router.metrics(), "tokenloom_router_retries_total", worker=dead) == 1


def test_a_body_over_the_limit_is_refused_before_any_worker_sees_it(workers):
    with RouterProcess("--worker-urls", workers[0].url, "--max-payload-size", "1000") as router:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x" * 2000, "max_tokens": 2}, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
        assert not any(k.startswith("tokenloom_router_requests_total") and workers[0].url in k
                       for k in router.metrics())


def test_a_stream_cut_by_its_worker_is_not_retried(workers):
    """Runs last: it kills the second worker."""
    a, b = sorted(workers, key=lambda s: s.url)
    with RouterProcess("--worker-urls", b.url, a.url, "--policy", "round_robin") as router:
        got: dict = {"events": 0}

        def run() -> None:
            try:
                with httpx.stream("POST", router.url + "/v1/completions", timeout=60, json={
                        "prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
                    for line in r.iter_lines():
                        got["events"] += line.startswith("data: ")
                got["ended"] = "cleanly"
            except httpx.HTTPError as e:
                got["ended"] = type(e).__name__

        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.time() + 60
        while got["events"] < 3 and time.time() < deadline:
            time.sleep(0.05)
        b.kill()
        t.join(30)
        assert not t.is_alive() and got["ended"] != "cleanly" and got["events"] >= 3, got
        m = router.metrics()
        assert not any(k.startswith("tokenloom_router_retries_total") for k in m), m
        assert not any(a.url in k for k in m if k.startswith("tokenloom_router_requests_total"))
