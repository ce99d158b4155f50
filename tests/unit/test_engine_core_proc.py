"""EngineCore process plumbing (core_proc / core_client) with a fake core: no model needed."""
import asyncio
import contextlib
import os
import time

import pytest

from tokenloom.config import EngineConfig
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.stats import EngineStats
from tokenloom.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartupError

HERE = os.path.dirname(__file__)


@pytest.fixture(autouse=True)
def _fake_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _req(rid, prompt, max_tokens=3):
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt,
                             sampling_params=SamplingParams(max_tokens=max_tokens), arrival_time=time.time())


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): check its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def run(coro):
    return asyncio.run(coro)


def test_roundtrip_abort_utility_shutdown():
    async def main():
        got = []
        client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: got.extend(m.outputs),
                                  core_factory="fake_engine_core:make", heartbeat_interval=0.2)
        info = await client.start(startup_timeout=30)
        assert info.max_model_len == 128 and info.kv_cache.num_blocks == 64 and info.pooling is None
        await client.add_request(_req("a", [1, 2], max_tokens=3))
        await client.add_request(_req("b", [5], max_tokens=1000))
        deadline = time.time() + 10
        while not any(o.request_id == "a" and o.finish_reason for o in got) and time.time() < deadline:
            await asyncio.sleep(0.02)
        assert [t for o in got if o.request_id == "a" for t in o.new_token_ids] == [2, 3, 2]
        await client.abort_requests(["b"])
        await asyncio.sleep(0.3)
        stats = await client.call_utility("stats")
        assert isinstance(stats, EngineStats) and stats.num_running == 0
        assert client.last_stats.num_running == 0
        assert await client.call_utility("ping") == "pong"
        with pytest.raises(RuntimeError):
            await client.call_utility("nope")
        pid = client.engine_pid
        client.shutdown()
        assert not _alive(pid)
    run(main())


def test_engine_step_failure_and_crash_detected():
    for poison in (999999, 666666):
        async def main():
            dead = []
            client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: None, on_dead=dead.append,
                                      core_factory="fake_engine_core:make", heartbeat_interval=0.2)
            await client.start(startup_timeout=30)
            await client.add_request(_req("x", [poison]))
            t0 = time.time()
            while not dead and time.time() - t0 < 5:
                await asyncio.sleep(0.05)
            assert dead, "engine death not noticed"
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                await client.add_request(_req("y", [1]))
            client.shutdown()
        run(main())


def test_startup_failure_reported():
    async def main():
        client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: None,
                                  core_factory="fake_engine_core:does_not_exist")
        with pytest.raises(EngineStartupError):
            await client.start(startup_timeout=30)
    run(main())


def test_a_launched_engine_loads_before_start_which_adopts_that_process():
    """`tokenloom serve` launches the engine, then imports its HTTP stack while the engine loads."""
    client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: None, core_factory="fake_engine_core:make",
                              heartbeat_interval=0.2)
    client.launch()  # no event loop yet
    pid = client.engine_pid
    assert pid is not None and _alive(pid)

    async def main():
        info = await client.start(startup_timeout=30)
        assert info.kv_cache.num_blocks == 64
        assert client.engine_pid == pid and client.is_alive  # no second process
        assert await client.call_utility("ping") == "pong"
        client.shutdown()
    run(main())
    assert not _alive(pid)


def test_an_engine_launched_but_never_started_is_stopped_by_shutdown():
    """A start-up error of the server after the launch (a bad --lora-modules) leaves no engine behind."""
    client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: None, core_factory="fake_engine_core:make")
    client.launch()
    pid, sockets = client.engine_pid, client._tmpdir
    client.shutdown()
    assert not _alive(pid) and not os.path.exists(sockets)


def test_long_step_is_not_death_but_a_frozen_engine_is(monkeypatch):
    monkeypatch.setenv("FAKE_CORE_STEP_DELAY", "1.5")

    async def main():
        dead = []
        got = []
        client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: got.extend(m.outputs), on_dead=dead.append,
                                  core_factory="fake_engine_core:make", heartbeat_interval=0.1,
                                  heartbeat_timeout=0.8)
        await client.start(startup_timeout=30)
        await client.add_request(_req("slow", [1], max_tokens=2))
        t0 = time.time()
        while len(got) < 2 and time.time() - t0 < 10:
            await asyncio.sleep(0.05)
        assert len(got) == 2 and not dead, dead  # steps of 1.5 s > timeout 0.8 s, yet alive
        import signal
        os.kill(client.engine_pid, signal.SIGSTOP)  # frozen: no heartbeat at all
        try:
            t0 = time.time()
            while not dead and time.time() - t0 < 5:
                await asyncio.sleep(0.05)
            assert dead and "heartbeat" in dead[0]
        finally:
            with contextlib.suppress(ProcessLookupError):  # the client may already have killed it
                os.kill(client.engine_pid, signal.SIGCONT)
            client.shutdown()
    run(main())


def _status_mib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="platform: reads RSS from /proc")
def test_engine_hands_freed_heap_back_once_idle_for_a_heartbeat_interval():
    """A step leaves 64 MiB of freed holes in malloc's heap (as activations do); once its request is done and
    nothing has arrived for a heartbeat interval, the engine process no longer holds them (heap_trim.py)."""
    async def main():
        got = []
        client = EngineCoreClient(EngineConfig(), on_outputs=lambda m: got.extend(m.outputs),
                                  core_factory="fake_engine_core:make", heartbeat_interval=0.2)
        await client.start(startup_timeout=30)
        try:
            await client.add_request(_req("holes", [555555], max_tokens=1))
            deadline = time.time() + 10
            while not any(o.finish_reason for o in got) and time.time() < deadline:
                await asyncio.sleep(0.02)
            assert got, "the request did not finish"
            pid = client.engine_pid
            deadline = time.time() + 5  # 25 heartbeat intervals
            while True:
                peak, now = _status_mib(pid, "VmHWM"), _status_mib(pid, "VmRSS")
                if peak - now >= 48 or time.time() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert peak - now >= 48, f"peak {peak:.0f} MiB, now {now:.0f} MiB: the freed holes are still resident"
        finally:
            client.shutdown()
    run(main())
