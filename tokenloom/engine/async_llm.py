"""AsyncLLM: the API process's side of the engine (asyncio).

It owns the tokenizer, the InputProcessor (text/ids -> EngineCoreRequest, validation),
the OutputProcessor (detokenize, stop strings, n>1 aggregation) and the client of the
EngineCore process. `generate()` is an async iterator of cumulative `RequestOutput`s;
leaving it early (client disconnect, cancellation) aborts the request in the engine at
once. When the engine dies every open `generate()` raises `EngineDeadError`, then
`on_engine_dead(reason)` (set by the server) decides: `restart()` a fresh engine process
or stop the server. `generate(timeout=...)` ends a request that waited or ran too long
with `RequestTimeoutError` (aborted in the engine, counted with finish reason "timeout").
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from tokenloom.core.sampling_params import SamplingParams
from tokenloom.engine import ipc
from tokenloom.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartupError
from tokenloom.engine.dp_client import DPEngineClient
from tokenloom.engine.load_estimator import PROMPT_TOKEN_WEIGHT, LoadEstimator
from tokenloom.metrics import ServerMetrics
from tokenloom.model.pooling_config import PoolingConfig
from tokenloom.outputs import RequestOutput

logger = logging.getLogger("tokenloom.requests")

__all__ = ["AsyncLLM", "DuplicateRequestIdError", "EngineDeadError", "EngineStartupError", "RequestFailedError",
           "RequestTimeoutError",
           "LOG_LEVELS"]

# Request logging levels: off, lifecycle (received/finished), stages (+queue, first token,
# timings), full (+prompt and output text).
LOG_LEVELS = ("off", "lifecycle", "stages", "full")

# generation_config.json keys that become server-side sampling defaults.
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class Reservation:
    """Engine work admitted for one HTTP request but not yet handed to the engine; each `generate()`
    given it takes its share over once it is registered, and `release()` drops whatever is left."""

    def __init__(self, owner: "AsyncLLM", seqs: int, work: float) -> None:
        self.owner, self.seqs, self.work = owner, seqs, work
        owner.reserved_seqs += seqs
        owner.reserved_work += work

    def take(self, seqs: int, work: float) -> None:
        seqs, work = min(seqs, self.seqs), min(work, self.work)
        self.seqs -= seqs
        self.work -= work
        self.owner.reserved_seqs -= seqs
        self.owner.reserved_work -= work
        if self.owner.reserved_seqs == 0:  # no float residue may make an idle engine look busy to admission
            self.owner.reserved_work = 0.0
        if self.seqs == 0 and self.work > 0:  # all taken over: the estimate's excess goes too
            self.take(0, self.work)

    def release(self) -> None:
        self.take(self.seqs, self.work)


# Restarts allowed within RESTART_WINDOW_S: an engine that dies again and again right after
# (re)starting (a bad device, a model that crashes on load) must end the server, not loop.
MAX_RESTARTS_IN_WINDOW = 3
RESTART_WINDOW_S = 120.0


class RequestFailedError(RuntimeError):
    """The engine failed this one request (the others go on)."""


class DuplicateRequestIdError(ValueError):
    """A request id that an open request already uses."""


class RequestTimeoutError(RuntimeError):
    """The request waited or ran longer than its timeout; it was aborted in the engine."""


@dataclass
class _Tracked:
    """Per-request state in the frontend: the stream its consumer waits on, and timings."""

    request_id: str
    arrival: float
    num_prompt_tokens: int
    latest: RequestOutput | None = None
    error: BaseException | None = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token: float | None = None
    last_token: dict[int, float] = field(default_factory=dict)
    engine_times: dict[str, float] = field(default_factory=dict)
    finished: bool = False
    num_seqs: int = 1  # sequences it runs in the engine (n / best_of)
    max_tokens: int = 0  # per sequence (for the queued-work estimate)
    generated: int = 0  # tokens generated so far, all sequences together
    params: Any = None  # the SamplingParams (for the tracing span)

    @property
    def remaining_work(self) -> float:
        """Decode-equivalent tokens this request still needs from the engine (see LoadEstimator)."""
        prompt = 0 if self.first_token is not None else self.num_prompt_tokens * PROMPT_TOKEN_WEIGHT
        return prompt + max(0, self.num_seqs * self.max_tokens - self.generated)

    def put(self, out: RequestOutput) -> None:
        self.latest = out
        self.event.set()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.event.set()

    async def get(self) -> RequestOutput:
        await self.event.wait()
        self.event.clear()
        if self.error is not None:
            raise self.error
        out, self.latest = self.latest, None
        assert out is not None
        return out


def load_generation_defaults(model_path: str | None) -> dict[str, Any]:
    """Sampling defaults from the model folder's generation_config.json (empty for GGUF files)."""
    if not model_path or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    out = {k: data[k] for k in _GENERATION_DEFAULT_KEYS if data.get(k) is not None}
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    if data.get("max_new_tokens") is not None:
        out["max_tokens"] = data["max_new_tokens"]
    return out


class AsyncLLM:
    def __init__(self, config: Any, *, served_model_name: str | None = None,
                 heartbeat_timeout: float = 30.0, core_factory: str | None = None,
                 log_requests: str = "off", tokenizer: Any = None, step_timeout: float | None = None) -> None:
        if log_requests not in LOG_LEVELS:
            raise ValueError(f"log_requests must be one of {', '.join(LOG_LEVELS)}")
        self.config = config
        self.log_requests = log_requests
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.input_processor: Any = None
        self.output_processor: Any = None
        self.metrics: ServerMetrics | None = None
        self.generation_defaults: dict[str, Any] = {}
        self.model_path: str | None = None
        self.info: dict[str, Any] = {}
        self._client_args = dict(heartbeat_timeout=heartbeat_timeout, core_factory=core_factory,
                                 step_timeout=step_timeout)
        self.client = self._new_client()
        self._requests: dict[str, _Tracked] = {}
        self._bg: set[asyncio.Task] = set()
        self._started = False
        self._stopping = False
        # Called once per engine death, after every open request failed (the server restarts
        # the engine or exits); None: the server keeps answering 503.
        self.on_engine_dead: Any = None
        # Data parallel: called as (rank, reason) when one replica died while others serve (its requests
        # have failed); the server restarts it (--restart-engine) or serves on without it.
        self.on_replica_dead: Any = None
        self.restarting = False
        self.num_restarts = 0
        self._restart_times: list[float] = []
        self.mean_latency = 1.0  # moving average of finished requests' e2e seconds (for Retry-After)
        self.load = LoadEstimator()
        self.reserved_seqs = 0  # admitted by the server, not yet registered here (see Reservation)
        self.reserved_work = 0.0
        self.tracer: Any = None  # an OpenTelemetry tracer when --otlp-traces-endpoint is set (tracing.py)

    @property
    def data_parallel_size(self) -> int:
        return int(getattr(getattr(self.config, "parallel", None), "data_parallel_size", 1) or 1)

    def _new_client(self) -> EngineCoreClient | DPEngineClient:
        holder: list[Any] = []
        if self.data_parallel_size > 1:
            client: Any = DPEngineClient(self.config, self.data_parallel_size, on_outputs=self._on_outputs,
                                         on_dead=lambda reason: self._on_dead(holder[0], reason),
                                         on_replica_dead=self._on_replica_dead,
                                         **self._client_args)
            holder.append(client)
            return client
        client = EngineCoreClient(self.config, on_outputs=self._on_outputs,
                                  on_dead=lambda reason: self._on_dead(holder[0], reason),
                                  **self._client_args)
        holder.append(client)
        return client

    # ------------------------------------------------------------------ start / stop

    async def start(self, startup_timeout: float | None = None) -> "AsyncLLM":
        from tokenloom.engine.input_processor import InputProcessor
        from tokenloom.engine.output_processor import OutputProcessor
        from tokenloom.model.model_path import resolve_model_path
        from tokenloom.tokenizer import Tokenizer

        self.model_path = resolve_model_path(self.config.model.model)
        tok_task = None
        if self.tokenizer is None:  # load it while the engine loads the weights
            tok_task = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_model_path, self.model_path))
        try:
            self.info = await self.client.start(startup_timeout=startup_timeout)
        except BaseException:
            if tok_task is not None:
                tok_task.cancel()
            raise
        if tok_task is not None:
            self.tokenizer = await tok_task
        self.load.calibrate(float(self.info.get("warmup_decode_seconds") or 0.0))
        vocab_size = int(self.info.get("vocab_size") or self.tokenizer.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, self.config, self.max_model_len, vocab_size,
                                              list(self.info.get("eos_token_ids") or []))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.generation_defaults = load_generation_defaults(self.model_path)
        if self.served_model_name is None:
            self.served_model_name = self.config.model.served_model_name or self.config.model.model
        cache_info = {
            "block_size": self.info.get("block_size"),
            "num_gpu_blocks": self.info.get("num_blocks"),
            "enable_prefix_caching": self.config.cache.enable_prefix_caching,
            "cache_dtype": self.info.get("kv_cache_dtype", self.info.get("dtype", self.config.model.dtype)),
        }
        self.metrics = ServerMetrics(self.served_model_name, cache_info, max_model_len=self.max_model_len,
                                     engines=self.data_parallel_size)
        self._started = True
        return self

    def shutdown(self) -> None:
        self._stopping = True
        self.fail_all(EngineDeadError("the server is shutting down"))
        self.client.shutdown()

    async def restart(self, startup_timeout: float | None = None) -> None:
        """Replace a dead engine process by a fresh one (same config); raises EngineStartupError, also when
        the engine already needed MAX_RESTARTS_IN_WINDOW restarts within RESTART_WINDOW_S (each
        attempt counts, a start-up that dies included)."""
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW_S]
        if len(self._restart_times) >= MAX_RESTARTS_IN_WINDOW:
            raise EngineStartupError(f"the engine was restarted {len(self._restart_times)} times within "
                                     f"{RESTART_WINDOW_S:g} s and died again; not restarting it")
        self._restart_times.append(now)
        self.restarting = True
        try:
            self.client.shutdown()  # kills what is left of the old one, frees its sockets
            self.fail_all(EngineDeadError("the engine died"))
            self.client = self._new_client()
            self.info = await self.client.start(startup_timeout=startup_timeout)
            self.load = LoadEstimator()
            self.load.calibrate(float(self.info.get("warmup_decode_seconds") or 0.0))
            self.num_restarts += 1
            if self.metrics is not None:
                for rank in range(self.data_parallel_size):
                    self.metrics.engine_restarts_of(rank).inc()
                self.metrics.reset_engine_counters()
            logger.warning("engine restarted (%d restart(s) so far)", self.num_restarts)
        finally:
            self.restarting = False

    async def restart_replica(self, rank: int, startup_timeout: float | None = None) -> None:
        """Data parallel: replace dead replica `rank` by a fresh process while the others serve; the same
        restart budget as `restart()` (MAX_RESTARTS_IN_WINDOW within RESTART_WINDOW_S, all replicas
        together) applies."""
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_WINDOW_S]
        if len(self._restart_times) >= MAX_RESTARTS_IN_WINDOW:
            raise EngineStartupError(f"engine replicas were restarted {len(self._restart_times)} times within "
                                     f"{RESTART_WINDOW_S:g} s and one died again; not restarting replica {rank}")
        self._restart_times.append(now)
        await self.client.restart_replica(rank, startup_timeout=startup_timeout)
        self.num_restarts += 1
        if self.metrics is not None:
            self.metrics.engine_restarts_of(rank).inc()
            self.metrics.reset_engine_counters(rank)
        logger.warning("engine replica %d restarted (%d restart(s) so far)", rank, self.num_restarts)

    def replica_health(self) -> list[dict[str, Any]] | None:
        """Data parallel: per replica, alive or why not (None with a single engine)."""
        if not isinstance(self.client, DPEngineClient):
            return None
        out = []
        for rank, r in enumerate(self.client.replicas):
            serving = self.client.is_serving(rank)
            reason = None if serving else ("restarting" if r.is_alive else r.dead_reason)
            out.append({"engine": rank, "alive": serving, "pid": r.engine_pid,
                        **({} if reason is None else {"reason": reason})})
        return out

    def update_engine_metrics(self) -> None:
        """Refresh the per-engine gauges (engine state and health) before /metrics renders.

        The engine's stats (running, waiting, KV usage, prefix-cache and speculation counters) come with
        every step and are kept as they come (`client.last_stats`); they reach the Prometheus families only
        here, when someone reads them: applied on every step they took a tenth of the API process's time
        at concurrency 1 (py-spy), for values only a scrape reads."""
        if self.metrics is None:
            return
        if isinstance(self.client, DPEngineClient):
            for rank, replica in enumerate(self.client.replicas):
                self.metrics.observe_engine_stats(replica.last_stats, rank)
                serving = self.client.is_serving(rank) and not self.restarting
                self.metrics.engine_healthy_of(rank).set(1 if serving else 0)
        else:
            self.metrics.observe_engine_stats(self.engine_stats)
            self.metrics.engine_healthy.set(1 if self.is_healthy else 0)

    # ------------------------------------------------------------------ health / state

    @property
    def max_model_len(self) -> int:
        return int(self.info.get("max_model_len") or self.config.model.max_model_len)

    @property
    def pooling(self) -> PoolingConfig | None:
        """Set when the engine embeds (serves /v1/embeddings, not generation); see tokenloom/model/pooling_config.py."""
        p = self.info.get("pooling")
        if not p:
            return None
        m = p.get("matryoshka", False)
        return PoolingConfig(p["method"], p["normalize"], p["dimensions"], tuple(m) if isinstance(m, list) else m)

    @property
    def is_healthy(self) -> bool:
        return self._started and not self.restarting and self.client.is_alive

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    async def check_health(self) -> None:
        if not self._started:
            raise EngineDeadError("the engine is not started")
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "the engine process is not running")

    @property
    def engine_stats(self) -> dict[str, Any]:
        return dict(self.client.last_stats)

    async def get_stats(self) -> dict[str, Any]:
        """Fresh stats straight from the engine (a round trip)."""
        return await self.client.call_utility("stats")

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    @property
    def num_inflight_seqs(self) -> int:
        return sum(t.num_seqs for t in self._requests.values())

    def inflight_requests(self) -> list[dict[str, Any]]:
        """The open requests, oldest first, for the web page: id, state, token counts, age."""
        now = time.time()
        return [{"id": t.request_id, "age": now - t.arrival, "prompt_tokens": t.num_prompt_tokens,
                 "output_tokens": t.generated, "seqs": t.num_seqs,
                 "state": "decoding" if t.first_token is not None else
                          ("prefill" if "first_scheduled_time" in t.engine_times else "queued")}
                for t in sorted(self._requests.values(), key=lambda t: t.arrival)]

    @property
    def queued_work(self) -> float:
        """Decode-equivalent tokens the engine still owes the open requests, plus the reserved ones'."""
        return sum(t.remaining_work for t in self._requests.values()) + self.reserved_work

    def reserve(self, seqs: int, work: float) -> Reservation:
        return Reservation(self, seqs, work)

    # ------------------------------------------------------------------ requests

    def default_sampling_params(self) -> dict[str, Any]:
        return dict(self.generation_defaults)

    def process_inputs(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                       data_parallel_rank: int | None = None):
        """Tokenize and validate (raises RequestValidationError / SamplingParamsError)."""
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.data_parallel_size:
            from tokenloom.engine.input_processor import RequestValidationError
            raise RequestValidationError(f"data_parallel_rank {data_parallel_rank} is out of range: this server "
                                         f"runs {self.data_parallel_size} engine replica(s) "
                                         f"(0..{self.data_parallel_size - 1})", param="data_parallel_rank")
        req = self.input_processor.process(request_id, prompt, params, priority=priority,
                                           arrival_time=arrival_time, cache_salt=cache_salt)
        req.data_parallel_rank = data_parallel_rank
        return req

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, engine_request: Any = None, prompt_text: str | None = None,
                       timeout: float | None = None, reservation: Reservation | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative RequestOutputs of one request; the last one has finished=True.

        `engine_request` may be passed when the caller already ran `process_inputs` (to
        report validation errors before it starts streaming). `timeout` (seconds from now,
        queueing included) ends the request with RequestTimeoutError when it runs out.
        `reservation` (from `reserve()` at admission) hands its share of work over to this request.
        """
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "the engine is not running")
        if request_id in self._requests:
            raise DuplicateRequestIdError(f"request id {request_id!r} is already in use")
        arrival = time.time()
        req = engine_request or self.process_inputs(request_id, prompt, params, priority, arrival)
        if prompt_text is None and isinstance(prompt, str):
            prompt_text = prompt
        seqs = max(params.n, params.best_of or params.n)
        tracked = _Tracked(request_id, arrival, len(req.prompt_token_ids), num_seqs=seqs,
                           max_tokens=int(req.sampling_params.max_tokens or params.max_tokens or 0))
        self._requests[request_id] = tracked
        if self.metrics is not None:
            self.metrics.observe_request_params(n=params.n, max_tokens=params.max_tokens)
        if reservation is not None:
            reservation.take(seqs, tracked.remaining_work)
        if self.tracer is not None:
            tracked.params = req.sampling_params
        self.output_processor.add_request(request_id, prompt_text, req.prompt_token_ids, params)
        self._log_received(request_id, req, params, prompt_text)
        finished = False
        deadline = time.monotonic() + timeout if timeout else None
        reason = "abort"
        try:
            await self.client.add_request(req)
            while True:
                if deadline is None:
                    out = await tracked.get()
                else:
                    try:
                        out = await asyncio.wait_for(tracked.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        reason = "timeout"
                        raise RequestTimeoutError(self._timeout_message(tracked, timeout)) from None
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                if isinstance(tracked.error, EngineDeadError):
                    reason = "error"  # failed by the engine's death: an error, not a client abort
                self._drop(request_id, abort_engine=True, reason=reason)

    def _timeout_message(self, tracked: _Tracked, timeout: float) -> str:
        if tracked.first_token is None:
            return (f"request timed out after {timeout:g} s before its first token (queued or prefilling); "
                    f"the server is busy, retry later or raise the timeout")
        return f"request timed out after {timeout:g} s while generating"

    async def abort(self, request_id: str) -> None:
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.fail(RequestFailedError(f"request {request_id} was aborted"))
        self._drop(request_id, abort_engine=True)

    def fail_all(self, exc: BaseException) -> None:
        """End every open request with `exc` (engine death, forced shutdown)."""
        for tracked in list(self._requests.values()):
            tracked.fail(exc)

    def _drop(self, request_id: str, abort_engine: bool, reason: str = "abort") -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        if self.output_processor is not None:
            try:
                self.output_processor.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("output processor abort failed")
        if not tracked.finished:
            tracked.finished = True
            out = tracked.latest
            gen = sum(len(o.token_ids) for o in out.outputs) if out is not None else 0
            if self.metrics is not None:
                self.metrics.observe_finished(finish_reason=reason, prompt_tokens=tracked.num_prompt_tokens,
                                              generation_tokens=gen, e2e=time.time() - tracked.arrival)
            self._trace(tracked, time.time(), reason, tracked.num_prompt_tokens, gen,
                        error=None if reason == "abort" else f"request ended: {reason}")
            if reason == "timeout":
                logger.warning("request %s timed out after %.3f s", request_id, time.time() - tracked.arrival)
            elif self.log_requests != "off":
                logger.info("request %s aborted after %.3f s", request_id, time.time() - tracked.arrival)
        if abort_engine and self.client.is_alive:
            self._spawn(self.client.abort_requests([request_id]))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ engine callbacks

    def _on_replica_dead(self, rank: int, reason: str, request_ids: list[str]) -> None:
        """Data parallel: one replica died; only its requests fail (with the engine-death error)."""
        for rid in request_ids:
            tracked = self._requests.get(rid)
            if tracked is not None:
                tracked.fail(EngineDeadError(f"the engine died: engine replica {rank}: {reason}"))
        if self.metrics is not None:
            self.metrics.observe_engine_stats({"num_running": 0, "num_waiting": 0}, rank)
        if self.on_replica_dead is not None and not self._stopping:
            try:
                self.on_replica_dead(rank, reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_replica_dead callback failed")

    def _on_dead(self, client: EngineCoreClient, reason: str) -> None:
        if client is not self.client:
            return  # a replaced engine
        self.fail_all(EngineDeadError(f"the engine died: {reason}"))
        if self.restarting:
            return  # a replacement died while starting: restart() raises, and its caller counts the attempt
        if self.metrics is not None:
            for rank in range(self.data_parallel_size):
                self.metrics.observe_engine_stats({"num_running": 0, "num_waiting": 0}, rank)
        if self.on_engine_dead is not None and not self._stopping:
            try:
                self.on_engine_dead(reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_engine_dead callback failed")

    def _on_outputs(self, msg: ipc.StepOutputs) -> None:
        now = time.time()
        metrics = self.metrics
        if metrics is not None:
            metrics.observe_iteration(msg.num_step_tokens)
        stats = msg.stats or {}
        running = int(stats.get("num_running", 0) or 0)
        self.load.observe_step(msg.timestamp, sum(len(o.new_token_ids) for o in msg.outputs), msg.num_step_tokens,
                               running, busy_after=bool(running or stats.get("num_waiting")))
        errors: dict[str, str] = {}
        outputs = []
        for o in msg.outputs:
            tracked = self._requests.get(o.request_id)
            if tracked is None:
                continue  # aborted meanwhile
            outputs.append(o)
            if o.error:
                errors[o.request_id] = o.error
            if o.new_token_ids:
                tracked.generated += len(o.new_token_ids)
                last = tracked.last_token.get(o.index)
                if tracked.first_token is None:
                    tracked.first_token = now
                    if metrics is not None:
                        metrics.observe_first_token(now - tracked.arrival)
                    if self.log_requests in ("stages", "full"):
                        logger.info("request %s first token after %.3f s", o.request_id, now - tracked.arrival)
                elif last is not None and metrics is not None:
                    metrics.observe_inter_token(now - last)
                tracked.last_token[o.index] = now
            for key in ("arrival_time", "first_scheduled_time", "first_token_time", "finished_time"):
                value = getattr(o, key)
                if value:
                    if key in ("arrival_time", "first_scheduled_time", "first_token_time"):
                        tracked.engine_times.setdefault(key, value)
                    else:
                        tracked.engine_times[key] = value
        if not outputs:
            return
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        for ro in request_outputs:
            tracked = self._requests.get(ro.request_id)
            if tracked is None:
                continue
            if ro.finished and ro.request_id not in errors and any(o.finish_reason == "error" for o in ro.outputs):
                # Not an OpenAI finish reason: the engine could not continue a sequence (e.g. its output
                # constraint allowed no token). The request fails with the engine error (500).
                errors[ro.request_id] = "the engine could not continue the generation (its output constraint " \
                                        "allowed no further token)"
            if ro.request_id in errors:
                tracked.fail(RequestFailedError(errors[ro.request_id]))
                tracked.finished = True
                self._requests.pop(ro.request_id, None)
                if metrics is not None:
                    metrics.observe_finished(finish_reason="error", prompt_tokens=tracked.num_prompt_tokens,
                                             generation_tokens=0, e2e=now - tracked.arrival)
                self._trace(tracked, now, "error", tracked.num_prompt_tokens, tracked.generated,
                            error=errors[ro.request_id])
                logger.warning("request %s failed in the engine: %s", ro.request_id, errors[ro.request_id])
                continue
            tracked.put(ro)
            if ro.finished:
                tracked.finished = True
                self._requests.pop(ro.request_id, None)
                self._record_finished(tracked, ro, now)
        if to_abort:
            self._spawn(self.client.abort_requests(list(to_abort)))

    def _record_finished(self, tracked: _Tracked, ro: RequestOutput, now: float) -> None:
        gen = sum(len(o.token_ids) for o in ro.outputs)
        reason = ro.outputs[0].finish_reason if ro.outputs else "error"
        self.mean_latency = 0.9 * self.mean_latency + 0.1 * max(0.0, now - tracked.arrival)
        t = tracked.engine_times
        queue = prefill = decode = None
        if t.get("first_scheduled_time") and t.get("arrival_time"):
            queue = t["first_scheduled_time"] - t["arrival_time"]
        if t.get("first_token_time") and t.get("first_scheduled_time"):
            prefill = t["first_token_time"] - t["first_scheduled_time"]
        if t.get("finished_time") and t.get("first_token_time"):
            decode = t["finished_time"] - t["first_token_time"]
        if self.metrics is not None:
            self.metrics.observe_finished(finish_reason=reason or "stop", prompt_tokens=len(ro.prompt_token_ids),
                                          generation_tokens=gen, e2e=now - tracked.arrival, queue=queue,
                                          prefill=prefill, decode=decode,
                                          max_generation_tokens=max((len(o.token_ids) for o in ro.outputs),
                                                                    default=0))
        self._trace(tracked, now, reason or "stop", len(ro.prompt_token_ids), gen, queue=queue, prefill=prefill,
                    decode=decode)
        if self.log_requests != "off":
            msg = (f"request {ro.request_id} finished ({reason}): {len(ro.prompt_token_ids)} prompt + "
                   f"{gen} generated tokens in {now - tracked.arrival:.3f} s")
            if self.log_requests in ("stages", "full"):
                fmt = lambda v: "-" if v is None else f"{v:.3f} s"  # noqa: E731
                msg += f"; queued {fmt(queue)}, prefill {fmt(prefill)}, decode {fmt(decode)}"
            if self.log_requests == "full":
                msg += f"; output: {[o.text for o in ro.outputs]!r}"
            logger.info(msg)

    def _trace(self, tracked: _Tracked, end: float, reason: str, prompt_tokens: int, generated: int,
               error: str | None = None, **latencies: float | None) -> None:
        """One span per ended request when tracing is on (see tracing.py); nothing otherwise."""
        if self.tracer is None:
            return
        from tokenloom.tracing import record_request_span

        try:
            record_request_span(self.tracer, request_id=tracked.request_id, model=self.served_model_name,
                                arrival=tracked.arrival, end=end, params=tracked.params,
                                prompt_tokens=prompt_tokens, completion_tokens=generated, finish_reason=reason,
                                ttft=None if tracked.first_token is None else tracked.first_token - tracked.arrival,
                                error=error, **latencies)
        except Exception:  # noqa: BLE001 - tracing never fails a request
            logger.exception("recording the trace span failed")

    def _log_received(self, request_id: str, req: Any, params: SamplingParams, prompt_text: str | None) -> None:
        if self.log_requests == "off":
            return
        msg = (f"request {request_id} received: {len(req.prompt_token_ids)} prompt tokens, n={params.n}, "
               f"max_tokens={params.max_tokens}, temperature={params.temperature}")
        if self.log_requests == "full":
            msg += f", prompt={prompt_text if prompt_text is not None else req.prompt_token_ids!r}"
            msg += f", params={params!r}"
        logger.info(msg)
