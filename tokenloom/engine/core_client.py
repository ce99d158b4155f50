"""Frontend side of the EngineCore process: spawn it, talk to it over ZMQ, watch it.

`EngineCoreClient` (asyncio):

* `launch()` binds two IPC sockets in a private temp dir and spawns
  ``python -m tokenloom.engine.core_proc`` (the engine config goes as msgspec JSON on its
  stdin); `await start()` launches it if that has not happened yet and waits for the
  engine's `Ready` message (or its start-up failure / exit). The server launches first and
  imports its HTTP stack while the engine process imports torch and loads the weights;
* `await add_request(req)`, `await abort_requests(ids)`, `await call_utility(name)`;
* an output task decodes every message and hands `StepOutputs` to `on_outputs`;
* the engine is declared dead (once, `on_dead(reason)` called) when its process exits,
  it reports a failed step, no message came for `heartbeat_timeout` seconds (a frozen
  process), or one step has run for `step_timeout` seconds (a hung step: the engine's
  heartbeat thread still reports how long); a dead engine that still runs is killed;
* `shutdown()` asks it to stop, then terminates / kills it, and removes the temp dir.

The engine process is spawned from the calling thread (the main thread in the server)
and ties its life to ours with PR_SET_PDEATHSIG, so it never outlives the frontend.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from tokenloom.config import EngineConfig
from tokenloom.core.engine_info import EngineInfo
from tokenloom.core.messages import EngineCoreRequest
from tokenloom.core.stats import EngineStats
from tokenloom.engine import ipc
from tokenloom.engine.socket_dir import make_socket_dir
from tokenloom.engine.zmq_reader import SocketReader

logger = logging.getLogger("tokenloom.engine")


class EngineDeadError(RuntimeError):
    """The EngineCore process died or stopped answering; requests cannot be served."""


class EngineStartupError(RuntimeError):
    """The EngineCore process failed to start (bad model, out of memory...)."""


def _config_type_path(config: EngineConfig) -> str:
    cls = type(config)
    return f"{cls.__module__}:{cls.__qualname__}"


class EngineCoreClient:
    def __init__(self, config: EngineConfig, *, on_outputs: Callable[[ipc.StepOutputs], None],
                 on_dead: Callable[[str], None] | None = None,
                 heartbeat_interval: float = 1.0, heartbeat_timeout: float = 30.0,
                 core_factory: str | None = None, step_timeout: float | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.config = config
        self.on_outputs = on_outputs
        self.on_dead = on_dead
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout if step_timeout and step_timeout > 0 else None
        self._step_started_at = 0.0  # monotonic start of the engine's current long step (0: none)
        self.core_factory = core_factory
        self.env = env  # the engine process's environment (None: ours)
        self.proc: subprocess.Popen | None = None
        self.info: EngineInfo | None = None  # set once the engine answered Ready
        self.engine_pid: int | None = None
        self.dead_reason: str | None = None
        self.last_stats = EngineStats()  # the latest the engine sent (with a step or heartbeat)
        self.step_elapsed = 0.0  # how long the engine's current step has run (from its heartbeat)
        self._ctx: zmq.asyncio.Context | None = None
        self._in: zmq.asyncio.Socket | None = None
        self._out: zmq.Socket | None = None  # plain: read through self._reader, no Future per message
        self._reader: SocketReader | None = None
        self._tmpdir: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []
        self._last_seen = time.monotonic()
        self._calls: dict[int, asyncio.Future[ipc.UtilityValue]] = {}
        self._next_call = 0
        self._closing = False

    # -------------------------------------------------------------- state

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.proc is not None and self.proc.poll() is None

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not self._closing:
            logger.error("EngineCore is dead: %s", reason)
            proc = self.proc
            if proc is not None and proc.poll() is None:  # hung or frozen: it will never recover
                try:
                    proc.kill()
                except OSError:
                    pass
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        self._calls.clear()
        if self.on_dead is not None:
            try:
                self.on_dead(reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_dead callback failed")

    # -------------------------------------------------------------- start-up

    def launch(self) -> None:
        """Spawn the engine process now, without waiting for it (no event loop needed): it loads while the
        caller does its own set-up. `start` waits for it."""
        if self.proc is not None:
            return
        self._tmpdir = make_socket_dir()
        input_addr = f"ipc://{self._tmpdir}/input.sock"
        output_addr = f"ipc://{self._tmpdir}/output.sock"
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(input_addr)
        self._out = zmq.Socket(self._ctx, zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(output_addr)

        cmd = [sys.executable, "-m", "tokenloom.engine.core_proc", "--input", input_addr,
               "--output", output_addr, "--parent-pid", str(os.getpid()),
               "--heartbeat-interval", str(self.heartbeat_interval),
               "--config-type", _config_type_path(self.config)]
        if self.core_factory:
            cmd += ["--core-factory", self.core_factory]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=self.env)
        self.engine_pid = self.proc.pid
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(self.config))
        self.proc.stdin.close()

    async def start(self, startup_timeout: float | None = None) -> EngineInfo:
        """Launch the engine process (unless `launch` did) and wait until it is ready."""
        self._loop = asyncio.get_running_loop()
        self.launch()
        self._reader = SocketReader(self._out, self._loop)
        threading.Thread(target=self._watch_process, name="engine-watch", daemon=True).start()

        try:
            ready = await asyncio.wait_for(self._wait_ready(), timeout=startup_timeout)
        except asyncio.TimeoutError:
            self.shutdown()
            raise EngineStartupError(f"engine did not start within {startup_timeout:.0f} s") from None
        except BaseException:
            self.shutdown()
            raise
        self.info = ready.info
        self._last_seen = time.monotonic()
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._heartbeat_watch(), name="engine-heartbeat")]
        return self.info

    async def _wait_ready(self) -> ipc.Ready:
        assert self._reader is not None
        while True:
            if self.dead_reason is not None:
                raise EngineStartupError(f"engine process failed to start: {self.dead_reason}")
            for data in await self._reader.receive(timeout=0.2):
                msg = ipc.decode_output(data)
                if isinstance(msg, ipc.Ready):
                    return msg
                if isinstance(msg, ipc.StartupFailed):
                    raise EngineStartupError(msg.error)

    def _watch_process(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._mark_dead, f"engine process exited with code {code}")
            except RuntimeError:  # loop closed meanwhile
                pass

    # -------------------------------------------------------------- running

    async def _output_loop(self) -> None:
        assert self._reader is not None
        while self.dead_reason is None:
            try:
                batch = await self._reader.receive()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._last_seen = time.monotonic()
            for data in batch:
                try:
                    msg = ipc.decode_output(data)
                except msgspec.DecodeError as e:
                    logger.error("undecodable engine output: %s", e)
                    continue
                try:
                    self._dispatch(msg)
                except Exception:  # noqa: BLE001 - a frontend bug must not stop the output loop
                    logger.exception("failed to handle engine output")

    def _dispatch(self, msg: ipc.EngineOutput) -> None:
        if isinstance(msg, ipc.StepOutputs):
            self.step_elapsed = 0.0
            self._step_started_at = 0.0
            if msg.stats is not None:
                self.last_stats = msg.stats
            self.on_outputs(msg)
        elif isinstance(msg, ipc.Heartbeat):
            self.step_elapsed = msg.step_elapsed
            self._step_started_at = time.monotonic() - msg.step_elapsed if msg.step_elapsed else 0.0
            if msg.stats is not None:
                self.last_stats = msg.stats
        elif isinstance(msg, ipc.UtilityResult):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    fut.set_exception(RuntimeError(msg.error))
                else:
                    fut.set_result(msg.result)
        elif isinstance(msg, ipc.EngineFailed):
            self._mark_dead(f"engine step failed: {msg.error}")

    async def _heartbeat_watch(self) -> None:
        period = min(0.5, self.heartbeat_timeout / 4, (self.step_timeout or 2.0) / 4)
        while self.dead_reason is None:
            await asyncio.sleep(period)
            now = time.monotonic()
            if self.proc is not None and self.proc.poll() is not None:
                self._mark_dead(f"engine process exited with code {self.proc.returncode}")
            elif now - self._last_seen > self.heartbeat_timeout:
                self._mark_dead(f"no heartbeat from the engine for {self.heartbeat_timeout:.0f} s")
            elif self.step_timeout and self._step_started_at and now - self._step_started_at > self.step_timeout:
                self._mark_dead(f"an engine step has run for {now - self._step_started_at:.0f} s "
                                f"(step timeout {self.step_timeout:g} s): the engine is hung")

    async def _send(self, msg: msgspec.Struct) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        assert self._in is not None
        await self._in.send(ipc.encode(msg))

    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send(ipc.AddRequest(request=request))

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            await self._send(ipc.AbortRequests(request_ids=list(request_ids)))

    async def call_utility(self, method: str, *args: ipc.UtilityArg, timeout: float = 10.0) -> ipc.UtilityValue:
        assert self._loop is not None
        self._next_call += 1
        call_id = self._next_call
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            await self._send(ipc.UtilityCall(call_id=call_id, method=method, args=list(args)))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    # -------------------------------------------------------------- shutdown

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (politely, then by force) and free the sockets. Idempotent."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                if self._in is not None and self.dead_reason is None:
                    zmq.Socket.shadow(self._in.underlying).send(ipc.encode(ipc.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                proc.wait(timeout if self.dead_reason is None else 0.1)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.dead_reason is None:
            self.dead_reason = "engine shut down"
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        for sock in (self._in, self._out):
            if sock is not None:
                sock.close(linger=0)
        self._in = self._out = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
