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
from typing import Callable, Protocol

import msgspec
import zmq

from tokenloom.config import EngineConfig
from tokenloom.core.engine_info import EngineInfo, KVCacheInfo
from tokenloom.core.messages import EngineCoreOutput, EngineCoreRequest
from tokenloom.core.process import set_parent_death_signal
from tokenloom.core.stats import EngineStats, engine_stats
from tokenloom.engine import ipc
from tokenloom.heap_trim import release_free_heap
from tokenloom.worker.worker_info import WorkerInfo

logger = logging.getLogger("tokenloom.engine")

# EngineCore methods the frontend may call through UtilityCall.
UTILITY_METHODS = ("stats", "reset_prefix_cache", "ping", "add_lora", "remove_lora")


class CoreLike(Protocol):
    """What the loop needs of its core: `EngineCore`, or a stand-in in tests (tests/unit/fake_engine_core.py)."""

    info: WorkerInfo
    last_step_tokens: int

    def add_request(self, req: EngineCoreRequest) -> None: ...
    def abort_requests(self, request_ids: list[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> list[EngineCoreOutput]: ...
    def stats(self) -> dict: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


def engine_info(core: CoreLike) -> EngineInfo:
    """What the frontend learns about the built engine (resolved max_model_len, KV cache, pooling...)."""
    w = core.info
    kv = KVCacheInfo(num_blocks=w.num_blocks, block_size=w.block_size, dtype=w.kv_cache_dtype,
                     full_length_requests=w.full_length_requests)
    return EngineInfo(model_path=w.model_path, architecture=w.architecture, vocab_size=w.vocab_size,
                      max_position_embeddings=w.max_position_embeddings, max_model_len=w.max_model_len,
                      eos_token_ids=list(w.eos_token_ids), device=w.device, dtype=w.dtype,
                      tensor_parallel_size=w.tensor_parallel_size, kv_cache=kv,
                      warmup_decode_seconds=w.warmup_decode_seconds, pooling=w.pooling)


class EngineCoreProc:
    """Owns an EngineCore and the two sockets; `run()` is the busy loop."""

    def __init__(self, core: CoreLike, input_addr: str, output_addr: str, parent_pid: int,
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

    def _stats(self) -> EngineStats | None:
        try:
            return engine_stats(self.core.stats())
        except Exception:  # noqa: BLE001 - stats must never kill the loop
            logger.exception("EngineCore.stats() failed")
            return None

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
            result: ipc.UtilityValue
            if msg.method == "ping":
                result = "pong"
            elif msg.method == "stats":
                result = engine_stats(self.core.stats())
            elif msg.method in UTILITY_METHODS and hasattr(self.core, msg.method):
                result = bool(getattr(self.core, msg.method)(*msg.args))
            else:
                raise ValueError(f"unknown engine utility method {msg.method!r}")
            self.send(ipc.UtilityResult(call_id=msg.call_id, result=result))
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


def _import_object(path: str) -> object:
    """``module:name`` -> that object (the core factory and config type are named on the command line)."""
    module, _, name = path.partition(":")
    mod = __import__(module, fromlist=[name])
    return getattr(mod, name)


def default_core_factory(config: EngineConfig) -> CoreLike:
    from tokenloom.engine.core import EngineCore  # lazy: a stand-in core (--core-factory) never loads torch

    return EngineCore(config)


def decode_config(data: bytes, config_type: str) -> EngineConfig:
    return msgspec.json.decode(data, type=_import_object(config_type))


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
        factory: Callable[[EngineConfig], CoreLike] = _import_object(args.core_factory)  # type: ignore[assignment]
        core = factory(config)
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
