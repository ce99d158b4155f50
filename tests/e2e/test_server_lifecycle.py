"""Server process lifecycle: graceful SIGTERM, shutdown timeout, no orphans, engine death."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from server_harness import ServerProcess, pid_alive, stream_in_thread


def _wait_gone(pids, timeout=10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(pid_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _wait_first_chunk(out: dict, timeout=60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not out.get("events") and "exception" not in out:
        time.sleep(0.05)
    assert out.get("events"), out


def test_sigterm_drains_then_errors_and_exits_zero():
    srv = ServerProcess(env={"TOKENLOOM_SHUTDOWN_TIMEOUT": "10"})  # options also come from the environment
    try:
        engines = srv.engine_pids()
        assert len(engines) == 1
        t_long, long = stream_in_thread(srv.url, {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True})
        _wait_first_chunk(long)
        t_short, short = stream_in_thread(srv.url, {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        _wait_first_chunk(short)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.HTTPError):  # no new connections while draining
            httpx.get(srv.url + "/health", timeout=2)
        t_short.join(30)
        t_long.join(30)
        # the short request finished normally within the shutdown timeout
        assert short["events"][-1] == "[DONE]", short
        assert any(c.get("choices") and c["choices"][0]["finish_reason"] == "length"
                   for c in short["events"][:-1]), short
        # the long one was ended with an error chunk, then [DONE]
        assert long["events"][-1] == "[DONE]"
        assert "error" in long["events"][-2] and long["events"][-2]["error"]["code"] == "shutting_down"
        assert srv.proc.wait(30) == 0
        assert _wait_gone(engines), "engine process left behind"
    finally:
        srv.kill()


def test_sigkill_of_api_process_leaves_no_engine():
    srv = ServerProcess()
    engines = srv.engine_pids()
    assert engines
    os.kill(srv.pid, signal.SIGKILL)
    srv.proc.wait()
    assert _wait_gone(engines, 10), "engine outlived the killed API process"


def test_engine_death_without_restart_exits_nonzero():
    """Without --restart-engine a dead engine makes the server exit with code 1 (for a supervisor)."""
    srv = ServerProcess()
    try:
        (engine,) = srv.engine_pids()
        t, out = stream_in_thread(srv.url, {"prompt": "A long story:", "max_tokens": 1500, "ignore_eos": True})
        _wait_first_chunk(out)
        os.kill(engine, signal.SIGKILL)
        t0 = time.time()
        statuses = []
        while time.time() - t0 < 5 and srv.proc.poll() is None:  # until the server is gone
            try:
                statuses.append(srv.get("/health", timeout=2).status_code)
                r = srv.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5)
                statuses.append((r.status_code, r.json()["error"]["code"]))
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        t.join(15)
        assert not t.is_alive(), "stream hangs after the engine died"
        assert out["events"][-1] == "[DONE]"
        err = out["events"][-2]["error"]
        assert err["code"] == "engine_dead" and err["type"] == "server_error"
        assert 503 in statuses and (503, "engine_dead") in statuses, statuses  # /health and new requests
        assert statuses[-1] in (503, (503, "engine_dead")), statuses  # (the first may race the detection)
        assert srv.proc.wait(15) == 1
    finally:
        srv.kill()
