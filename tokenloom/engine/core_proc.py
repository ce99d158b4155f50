"""The EngineCore in its own process: a busy loop between two ZMQ sockets.

Started by `core_client.EngineCoreClient` as ``python -m tokenloom.engine.core_proc``
with the engine config (msgspec JSON) on stdin. The loop:

1. drain the input socket (add / abort / utility calls / shutdown),
2. run one `EngineCore.step()` while there is work, and push its outputs with the
   engine stats on the output socket,
3. send a heartbeat at least every `heartbeat_interval` seconds: from the loop when
   idle, and from a small thread (own socket) while one step runs long, so a slow
   step is not mistaken for a dead engine; that heartbeat says how long the step has run,
4. once it has been idle for a whole heartbeat interval after running requests, hand the heap's free pages
   back to the kernel (heap_trim.py: activations freed into the heap stay resident otherwise, 55 MiB after a
   3,900-token prompt); not at once, so back-to-back requests (a benchmark at concurrency 1) pay neither the
   trim nor faulting the pages in again,
5. exit as soon as the parent process is gone (PR_SET_PDEATHSIG plus a parent-pid
   check every iteration), so an engine is never orphaned.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import msgspec
import zmq

from tokenloom.core.messages import EngineCoreOutput
from tokenloom.core.process import set_parent_death_signal
from tokenloom.engine import ipc
from tokenloom.heap_trim import release_free_heap

logger = logging.getLogger("tokenloom.engine")

# EngineCore methods the frontend may call through UtilityCall.
UTILITY_METHODS = ("stats", "reset_prefix_cache", "ping")


def _jsonable(value: Any) -> Any:
    """Stats values as plain msgpack-able data (numbers, strings, lists, dicts)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def engine_info(core: Any) -> dict[str, Any]:
    """What the frontend learns about the built engine (resolved max_model_len, KV blocks...)."""
    info = msgspec.structs.asdict(core.info)
    info.pop("summary")
    return {**info, "full_length_requests": core.info.full_length_requests}


class EngineCoreProc:
    """Owns an EngineCore and the two sockets; `run()` is the busy loop."""

    def __init__(self, core: Any, input_addr: str, output_addr: str, parent_pid: int,
                 heartbeat_interval: float = 1.0, ctx: zmq.Context | None = None) -> None:
        self.core = core
        self.parent_pid = parent_pid
        self.heartbeat_interval = heartbeat_interval
        self.ctx = ctx or zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.setsockopt(zmq.LINGER, 0)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.LINGER, 1000)
        self.output.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self._output_addr = output_addr
        self._last_sent = 0.0
        self._step_started = 0.0  # monotonic start of the running step, 0 when none
        self._stop = False
        self._heap_to_trim = False  # steps ran since the last trim (heap_trim.py)
        self._closed = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat_thread, name="engine-heartbeat", daemon=True)
        self._hb_thread.start()

    # -------------------------------------------------------------- sending

    def send(self, msg: msgspec.Struct) -> None:
        self.output.send(ipc.encode(msg), copy=False)
        self._last_sent = time.monotonic()

    def _heartbeat_thread(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._output_addr)
        try:
            while not self._closed.wait(self.heartbeat_interval):
                started = self._step_started
                if started and time.monotonic() - started >= self.heartbeat_interval:
                    sock.send(ipc.encode(ipc.Heartbeat(timestamp=time.time(),
                                                       step_elapsed=time.monotonic() - started)))
        finally:
            sock.close()

    def _stats(self) -> dict[str, Any]:
        try:
            return _jsonable(self.core.stats())
        except Exception:  # noqa: BLE001 - stats must never kill the loop
            logger.exception("EngineCore.stats() failed")
            return {}

    # -------------------------------------------------------------- input

    def _handle(self, msg: ipc.EngineInput) -> None:
        if isinstance(msg, ipc.AddRequest):
            req = msg.request
            try:
                self.core.add_request(req)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                logger.warning("rejected request %s: %s", req.request_id, e)
                self.send(ipc.StepOutputs(outputs=[EngineCoreOutput(
                    request_id=req.request_id, new_token_ids=[], finish_reason="error",
                    error=f"{type(e).__name__}: {e}", arrival_time=req.arrival_time,
                    finished_time=time.time())], timestamp=time.time()))
        elif isinstance(msg, ipc.AbortRequests):
            self.core.abort_requests(list(msg.request_ids))
        elif isinstance(msg, ipc.UtilityCall):
            self._call(msg)
        elif isinstance(msg, ipc.Shutdown):
            self._stop = True

    def _call(self, msg: ipc.UtilityCall) -> None:
        try:
            if msg.method == "ping":
                result: Any = "pong"
            elif msg.method in UTILITY_METHODS and hasattr(self.core, msg.method):
                result = getattr(self.core, msg.method)(*msg.args)
            else:
                raise ValueError(f"unknown engine utility method {msg.method!r}")
            self.send(ipc.UtilityResult(call_id=msg.call_id, result=_jsonable(result)))
        except Exception as e:  # noqa: BLE001
            self.send(ipc.UtilityResult(call_id=msg.call_id, error=f"{type(e).__name__}: {e}"))

    def _drain_input(self, timeout_ms: int) -> bool:
        """Handle what has arrived, waiting up to `timeout_ms` for the first message; False when none came."""
        if not self.poller.poll(timeout_ms):
            return False
        while True:
            try:
                data = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                msg = ipc.decode_input(data.buffer)
            except msgspec.DecodeError as e:
                logger.error("dropping undecodable engine input: %s", e)
                continue
            self._handle(msg)
            if self._stop:
                return True

    # -------------------------------------------------------------- loop

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def run(self) -> None:
        while not self._stop:
            if not self.parent_alive():
                logger.warning("parent process %d is gone; engine exiting", self.parent_pid)
                return
            self.core.check_health()  # a worker that died while idle fails the engine now
            busy = self.core.has_unfinished_requests()
            received = self._drain_input(0 if busy else int(self.heartbeat_interval * 1000))
            if not busy and not received and self._heap_to_trim:  # a whole interval with nothing to do
                release_free_heap()
                self._heap_to_trim = False
            if self._stop:
                return
            if self.core.has_unfinished_requests():
                self._step_started = time.monotonic()
                try:
                    outputs = self.core.step()
                finally:
                    self._step_started = 0.0
                stats = self._stats()
                step_tokens = self.core.last_step_tokens
                if outputs or step_tokens:
                    self.send(ipc.StepOutputs(outputs=list(outputs), timestamp=time.time(), stats=stats,
                                              num_step_tokens=step_tokens))
                self._heap_to_trim = True
            if time.monotonic() - self._last_sent >= self.heartbeat_interval:
                self.send(ipc.Heartbeat(timestamp=time.time(), stats=self._stats()))

    def close(self) -> None:
        self._closed.set()
        self._hb_thread.join(2 * self.heartbeat_interval + 1)
        for sock in (self.input, self.output):
            try:
                sock.close()
            except Exception:  # noqa: BLE001
                pass
        self.ctx.term()


def _import_factory(path: str) -> Callable[[Any], Any]:
    module, _, name = path.partition(":")
    mod = __import__(module, fromlist=[name])
    return getattr(mod, name)


def default_core_factory(config: Any) -> Any:
    from tokenloom.engine.core import EngineCore

    return EngineCore(config)


def decode_config(data: bytes, config_type: str) -> Any:
    cls = _import_factory(config_type)
    return msgspec.json.decode(data, type=cls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="tokenloom EngineCore process (started by the server)")
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--core-factory", default="tokenloom.engine.core_proc:default_core_factory")
    p.add_argument("--config-type", default="tokenloom.config:EngineConfig")
    args = p.parse_args(argv)

    set_parent_death_signal()
    if os.getppid() != args.parent_pid:  # the parent died before prctl took effect
        return 1
    # Ctrl-C in a terminal reaches the whole process group: the API server decides
    # when the engine stops (after draining), so the engine ignores SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    logging.basicConfig(level=os.environ.get("TOKENLOOM_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s [engine] %(message)s")

    config = decode_config(sys.stdin.buffer.read(), args.config_type)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(args.output)
    try:
        core = _import_factory(args.core_factory)(config)
    except BaseException as e:  # noqa: BLE001 - report any start-up failure to the frontend
        if os.environ.get("TOKENLOOM_DEBUG") == "1":  # otherwise the frontend reports it in one line
            logger.error("engine start-up failed:\n%s", traceback.format_exc())
        out.send(ipc.encode(ipc.StartupFailed(error=f"{type(e).__name__}: {e}")))
        out.close()
        ctx.term()
        return 1
    out.close()

    proc = EngineCoreProc(core, args.input, args.output, args.parent_pid,
                          heartbeat_interval=args.heartbeat_interval, ctx=ctx)
    proc.send(ipc.Ready(pid=os.getpid(), info=engine_info(core)))
    code = 0
    try:
        proc.run()
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001
        tb = traceback.format_exc()
        logger.error("engine step loop failed:\n%s", tb)
        try:
            proc.send(ipc.EngineFailed(error=f"{type(e).__name__}: {e}"))
        except Exception:  # noqa: BLE001
            pass
        code = 1
    finally:
        core.shutdown()
        proc.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
