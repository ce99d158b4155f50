"""A worker process killed mid-stream is an engine fault: the stream ends with an error, /health flips,
and the engine (with --restart-engine) comes back with a new worker. The `mp` executor at size 1
puts the single rank in a process of its own, so one core is enough to prove it."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_harness import ServerProcess, _children, stream_in_thread

pytestmark = pytest.mark.tp

# The heartbeat and step timeouts of the server under test, and the bound on finding the dead worker: the
# executor sees its process end at the next step (milliseconds), a timeout only after 120 s; 30 s is a
# wide margin for a loaded machine and far from either.
SILENCE_TIMEOUTS = 120
FOUND_WITHIN = 30


@pytest.fixture(scope="module")
def server():
    # Timeouts far longer than the test's bound: a death found by one of them would come too late to pass.
    srv = ServerProcess("--distributed-executor-backend", "mp", "--restart-engine", "--engine-heartbeat-timeout",
                        str(SILENCE_TIMEOUTS), "--engine-step-timeout", str(SILENCE_TIMEOUTS))
    try:
        yield srv
    finally:
        srv.terminate()


def _workers(srv) -> list[int]:
    return [w for engine in srv.engine_pids() for w in _children(engine)]


def _wait_health(srv, status: int, timeout: float) -> httpx.Response:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = httpx.get(srv.url + "/health", timeout=5)
        if r.status_code == status:
            return r
        time.sleep(0.05)
    raise AssertionError(f"/health never returned {status}")


def test_a_killed_worker_ends_the_stream_with_an_error_and_the_engine_restarts(server):
    workers = _workers(server)
    assert len(workers) == 1
    t, out = stream_in_thread(server.url, {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True})
    deadline = time.time() + 60
    while not out.get("events") and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    os.kill(workers[0], signal.SIGKILL)
    r = _wait_health(server, 503, FOUND_WITHIN)
    assert r.json()["status"] in ("engine_restarting", "engine_dead")
    assert time.time() - t0 < FOUND_WITHIN  # found at the next step, not at a heartbeat or step timeout
    t.join(15)
    assert not t.is_alive()
    assert out["events"][-1] == "[DONE]" and out["events"][-2]["error"]["code"] == "engine_dead"
    _wait_health(server, 200, 120)
    new = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert new.status_code == 200 and new.json()["usage"]["completion_tokens"] == 3
    assert len(_workers(server)) == 1 and not set(workers) & set(_workers(server))
