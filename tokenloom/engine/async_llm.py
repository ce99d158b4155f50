"""AsyncLLM: the API process's side of the engine (asyncio).

It owns the tokenizer, the InputProcessor (text/ids -> EngineCoreRequest, validation),
the OutputProcessor (detokenize, stop strings, n>1 aggregation) and the client of the
EngineCore process. `generate()` is an async iterator of cumulative `RequestOutput`s;
leaving it early (client disconnect, cancellation) aborts the request in the engine at
once. When the engine dies every open `generate()` raises `EngineDeadError`, then
`on_engine_dead(reason)` (set by the server) decides: `restart()` a fresh engine process
or stop the server. `generate(timeout=...)` ends a request that waited or ran too long
with `RequestTimeoutError` (aborted in the engine, counted with finish reason "timeout").

The jobs around it live beside it: streams.py (per-request streams), admission.py (reserved work),
restart_policy.py, replica_health.py, request_events.py (metrics, tracing, request log).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING

from tokenloom.config import EngineConfig
from tokenloom.core.engine_info import EngineInfo
from tokenloom.core.errors import RequestValidationError
from tokenloom.core.messages import EngineCoreOutput, EngineCoreRequest
from tokenloom.core.pooling import PoolingConfig
from tokenloom.core.sampling_params import SamplingParams
from tokenloom.core.stats import EngineStats
from tokenloom.engine import ipc
from tokenloom.engine.admission import Reservation, ReservedWork
from tokenloom.engine.core_client import EngineCoreClient, EngineDeadError
from tokenloom.engine.dp_client import DPEngineClient
from tokenloom.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from tokenloom.engine.load_estimator import LoadEstimator
from tokenloom.engine.replica_health import ReplicaHealth, replica_health
from tokenloom.engine.request_errors import DuplicateRequestIdError, RequestFailedError, RequestTimeoutError
from tokenloom.engine.request_events import RequestEvents
from tokenloom.engine.request_log import RequestLog
from tokenloom.engine.restart_policy import RestartPolicy
from tokenloom.engine.streams import OpenRequests, RequestStream
from tokenloom.engine.weight_updates import WeightUpdates
from tokenloom.metrics import ServerMetrics
from tokenloom.model.model_path import resolve_model_path
from tokenloom.outputs import RequestOutput
from tokenloom.tracing import SpanTracer

if TYPE_CHECKING:  # imported once the engine process is launched (`launch`, `start`)
    from PIL import Image

    from tokenloom.engine.input_processor import InputProcessor
    from tokenloom.engine.output_processor import OutputProcessor
    from tokenloom.tokenizer import Tokenizer

logger = logging.getLogger("tokenloom.requests")

__all__ = ["AsyncLLM"]

EngineClient = EngineCoreClient | DPEngineClient
# The idle engine's gauges, reported for a dead engine or replica.
_STOPPED = EngineStats()


class AsyncLLM:
    def __init__(self, config: EngineConfig, *, served_model_name: str | None = None,
                 heartbeat_timeout: float = 30.0, core_factory: str | None = None,
                 log_requests: str = "off", tokenizer: Tokenizer | None = None,
                 step_timeout: float | None = None) -> None:
        self.events = RequestEvents(RequestLog(log_requests))
        self.config = config
        self.served_model_name = served_model_name
        self.tokenizer = tokenizer
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.generation_defaults: GenerationDefaults = {}
        self.model_path: str | None = None
        self.info: EngineInfo | None = None  # set once the engine is up
        self._heartbeat_timeout, self._core_factory, self._step_timeout = heartbeat_timeout, core_factory, step_timeout
        self.client = self._new_client()
        self._requests = OpenRequests()
        self._bg: set[asyncio.Task[None]] = set()
        self._started = False
        self._tok_task: asyncio.Future[Tokenizer] | None = None  # set by `launch`, awaited by `start`
        self._stopping = False
        # Called once per engine death, after every open request failed (the server restarts
        # the engine or exits); None: the server keeps answering 503.
        self.on_engine_dead: Callable[[str], None] | None = None
        # Data parallel: called as (rank, reason) when one replica died while others serve (its requests
        # have failed); the server restarts it (--restart-engine) or serves on without it.
        self.on_replica_dead: Callable[[int, str], None] | None = None
        self.restarting = False
        self.restarts = RestartPolicy()
        self.load = LoadEstimator()
        self.reserved = ReservedWork()  # admitted by the server, not yet registered here (see Reservation)
        # Weight updates, pause and sleep (serving inside a training loop): the gate new requests pass.
        self.weight_updates = WeightUpdates(lambda *a, **kw: self.client.call_utility(*a, **kw),
                                            lambda: self.num_inflight)

    # ------------------------------------------------------------------ what the server reads and sets

    @property
    def metrics(self) -> ServerMetrics | None:
        return self.events.metrics

    @metrics.setter
    def metrics(self, metrics: ServerMetrics | None) -> None:
        self.events.metrics = metrics

    @property
    def tracer(self) -> SpanTracer | None:
        """An OpenTelemetry tracer when --otlp-traces-endpoint is set (tracing.py)."""
        return self.events.tracer

    @tracer.setter
    def tracer(self, tracer: SpanTracer | None) -> None:
        self.events.tracer = tracer

    @property
    def mean_latency(self) -> float:
        return self.events.mean_latency

    @property
    def num_restarts(self) -> int:
        return self.restarts.num_restarts

    @property
    def takes_images(self) -> bool:
        """Whether the served model reads images (a vision-language model, docs/multimodal.md)."""
        return self.input_processor is not None and self.input_processor.image_processor is not None

    @property
    def data_parallel_size(self) -> int:
        return int(self.config.parallel.data_parallel_size or 1)

    def _new_client(self) -> EngineClient:
        args = dict(heartbeat_timeout=self._heartbeat_timeout, core_factory=self._core_factory,
                    step_timeout=self._step_timeout)
        client: EngineClient
        if self.data_parallel_size > 1:
            client = DPEngineClient(self.config, self.data_parallel_size, on_outputs=self._on_outputs,
                                    on_dead=lambda reason: self._on_dead(client, reason),
                                    on_replica_dead=self._on_replica_dead, **args)
        else:
            client = EngineCoreClient(self.config, on_outputs=self._on_outputs,
                                      on_dead=lambda reason: self._on_dead(client, reason), **args)
        return client

    # ------------------------------------------------------------------ start / stop

    def launch(self) -> None:
        """Spawn the engine process(es) and start loading the tokenizer in a thread, without waiting: a caller
        with slow set-up of its own (the server imports its HTTP stack) calls this first, so that set-up runs
        while the engine loads. Inside the event loop; `start` waits for both."""
        if self._tok_task is not None or self._started:
            return
        self.model_path = resolve_model_path(self.config.model.model)
        self.client.launch()
        # The tokenizer and the input and output processors import numpy, jinja2 and PIL (0.1 s): after the launch.
        from tokenloom.tokenizer import Tokenizer  # lazy: imported once the engine process is launched
        if self.tokenizer is None:  # load it while the engine loads the weights
            self._tok_task = asyncio.ensure_future(asyncio.to_thread(Tokenizer.from_model_path, self.model_path))
            # A failed engine start reports its own error: the tokenizer's, if it failed as well, is not logged.
            self._tok_task.add_done_callback(lambda task: task.cancelled() or task.exception())
        else:
            self._tok_task = asyncio.get_running_loop().create_future()
            self._tok_task.set_result(self.tokenizer)

    async def start(self, startup_timeout: float | None = None) -> "AsyncLLM":
        self.launch()
        tok_task, self._tok_task = self._tok_task, None
        assert tok_task is not None
        try:
            info = self.info = await self.client.start(startup_timeout=startup_timeout)
        except BaseException:
            tok_task.cancel()
            raise
        self.tokenizer = await tok_task
        from tokenloom.engine.input_processor import InputProcessor  # lazy: as the tokenizer's, in `launch`
        from tokenloom.engine.output_processor import OutputProcessor  # lazy: as the tokenizer's, in `launch`
        self.load.calibrate(info.warmup_decode_seconds)
        self.input_processor = InputProcessor(self.tokenizer, self.config, self.max_model_len,
                                              info.vocab_size or self.tokenizer.vocab_size, list(info.eos_token_ids),
                                              model_path=self.model_path)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.generation_defaults = load_generation_defaults(self.model_path)
        if self.served_model_name is None:
            self.served_model_name = self.config.model.served_model_name or self.config.model.model
        self.events.model_name = self.served_model_name
        cache_info = {
            "block_size": info.kv_cache.block_size,
            "num_gpu_blocks": info.kv_cache.num_blocks,
            "enable_prefix_caching": self.config.cache.enable_prefix_caching,
            "cache_dtype": info.kv_cache.dtype,
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
        the restart policy's budget is spent (restart_policy.py)."""
        self.restarts.count_attempt("the engine was", "died again; not restarting it")
        self.restarting = True
        try:
            self.client.shutdown()  # kills what is left of the old one, frees its sockets
            self.fail_all(EngineDeadError("the engine died"))
            self.client = self._new_client()
            self.info = await self.client.start(startup_timeout=startup_timeout)
            self.load = LoadEstimator()
            self.load.calibrate(self.info.warmup_decode_seconds)
            self._restarted(range(self.data_parallel_size), all_engines=True)
            logger.warning("engine restarted (%d restart(s) so far)", self.num_restarts)
        finally:
            self.restarting = False

    async def restart_replica(self, rank: int, startup_timeout: float | None = None) -> None:
        """Data parallel: replace dead replica `rank` by a fresh process while the others serve; the same
        restart policy as `restart()` applies (all replicas together)."""
        self.restarts.count_attempt("engine replicas were", f"one died again; not restarting replica {rank}")
        assert isinstance(self.client, DPEngineClient)
        await self.client.restart_replica(rank, startup_timeout=startup_timeout)
        self._restarted([rank], all_engines=False)
        logger.warning("engine replica %d restarted (%d restart(s) so far)", rank, self.num_restarts)

    def _restarted(self, ranks: range | list[int], all_engines: bool) -> None:
        self.restarts.succeeded()
        if self.metrics is not None:
            for rank in ranks:
                self.metrics.engine_restarts_of(rank).inc()
                if not all_engines:
                    self.metrics.reset_engine_counters(rank)
            if all_engines:
                self.metrics.reset_engine_counters()

    def replica_health(self) -> list[ReplicaHealth] | None:
        """Data parallel: per replica, alive or why not (None with a single engine)."""
        return replica_health(self.client) if isinstance(self.client, DPEngineClient) else None

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
        return int((self.info.max_model_len if self.info else 0) or self.config.model.max_model_len)

    @property
    def pooling(self) -> PoolingConfig | None:
        """Set when the engine embeds (serves /v1/embeddings, not generation); see tokenloom/core/pooling.py."""
        return self.info.pooling if self.info is not None else None

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
    def engine_stats(self) -> EngineStats:
        return self.client.last_stats

    async def get_stats(self) -> EngineStats:
        """Fresh stats straight from the engine (a round trip)."""
        stats = await self.client.call_utility("stats")
        assert isinstance(stats, EngineStats)
        return stats

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.client.call_utility("reset_prefix_cache"))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    @property
    def num_inflight_seqs(self) -> int:
        return self._requests.num_seqs

    def open_requests(self) -> list[RequestStream]:
        """The open requests, oldest first (the web page's rows)."""
        return self._requests.oldest_first()

    @property
    def queued_work(self) -> float:
        """Decode-equivalent tokens the engine still owes the open requests, plus the reserved ones'."""
        return self._requests.remaining_work + self.reserved.work

    def reserve(self, seqs: int, work: float) -> Reservation:
        return Reservation(self.reserved, seqs, work)

    # ------------------------------------------------------------------ requests

    def default_sampling_params(self) -> GenerationDefaults:
        return dict(self.generation_defaults)

    def process_inputs(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None,
                       data_parallel_rank: int | None = None, images: Sequence[Image.Image] = ()) -> EngineCoreRequest:
        """Tokenize and validate (raises RequestValidationError / SamplingParamsError); `images`: decoded images
        for the prompt's placeholders (a blocking call then: run it in a thread)."""
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < self.data_parallel_size:
            raise RequestValidationError(f"data_parallel_rank {data_parallel_rank} is out of range: this server "
                                         f"runs {self.data_parallel_size} engine replica(s) "
                                         f"(0..{self.data_parallel_size - 1})", param="data_parallel_rank")
        assert self.input_processor is not None, "the engine is not started"
        req = self.input_processor.process(request_id, prompt, params, priority=priority,
                                           arrival_time=arrival_time, cache_salt=cache_salt, images=list(images))
        req.data_parallel_rank = data_parallel_rank
        return req

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str, *,
                       priority: int = 0, engine_request: EngineCoreRequest | None = None,
                       prompt_text: str | None = None, timeout: float | None = None,
                       reservation: Reservation | None = None) -> AsyncIterator[RequestOutput]:
        """Stream cumulative RequestOutputs of one request; the last one has finished=True.

        `engine_request` may be passed when the caller already ran `process_inputs` (to
        report validation errors before it starts streaming). `timeout` (seconds from now,
        queueing included) ends the request with RequestTimeoutError when it runs out.
        `reservation` (from `reserve()` at admission) hands its share of work over to this request.
        """
        await self.weight_updates.admitted()
        if not self.client.is_alive:
            raise EngineDeadError(self.client.dead_reason or "the engine is not running")
        if request_id in self._requests:
            raise DuplicateRequestIdError(f"request id {request_id!r} is already in use")
        assert self.output_processor is not None, "the engine is not started"
        arrival = time.time()
        req = engine_request or self.process_inputs(request_id, prompt, params, priority, arrival)
        if prompt_text is None and isinstance(prompt, str):
            prompt_text = prompt
        seqs = max(params.n, params.best_of or params.n)
        stream = RequestStream(request_id, arrival, len(req.prompt_token_ids), params=req.sampling_params,
                               num_seqs=seqs, max_tokens=int(req.sampling_params.max_tokens or params.max_tokens or 0))
        self._requests[request_id] = stream
        self.events.arrived(req, params, prompt_text)
        if reservation is not None:
            reservation.take(seqs, stream.remaining_work)
        self.output_processor.add_request(request_id, prompt_text, req.prompt_token_ids, params)
        finished = False
        deadline = time.monotonic() + timeout if timeout else None
        reason = "abort"
        try:
            await self.client.add_request(req)
            while True:
                if deadline is None:
                    out = await stream.get()
                else:
                    try:
                        out = await asyncio.wait_for(stream.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        reason = "timeout"
                        raise RequestTimeoutError(stream.timeout_message(timeout or 0.0)) from None
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                if isinstance(stream.error, EngineDeadError):
                    reason = "error"  # failed by the engine's death: an error, not a client abort
                self._drop(request_id, abort_engine=True, reason=reason)

    async def abort(self, request_id: str) -> None:
        stream = self._requests.get(request_id)
        if stream is not None:
            stream.fail(RequestFailedError(f"request {request_id} was aborted"))
        self._drop(request_id, abort_engine=True)

    def fail_all(self, exc: BaseException) -> None:
        """End every open request with `exc` (engine death, forced shutdown)."""
        self._requests.fail_all(exc)

    def _drop(self, request_id: str, abort_engine: bool, reason: str = "abort") -> None:
        stream = self._requests.pop(request_id, None)
        if stream is None:
            return
        if self.output_processor is not None:
            try:
                self.output_processor.abort(request_id)
            except Exception:  # noqa: BLE001
                logger.exception("output processor abort failed")
        if not stream.finished:
            stream.finished = True
            out = stream.latest
            gen = sum(len(o.token_ids) for o in out.outputs) if out is not None else 0
            self.events.ended(stream, reason, gen, time.time())
        if abort_engine and self.client.is_alive:
            self._spawn(self.client.abort_requests([request_id]))

    def _spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------ engine callbacks

    def _on_replica_dead(self, rank: int, reason: str, request_ids: list[str]) -> None:
        """Data parallel: one replica died; only its requests fail (with the engine-death error)."""
        for rid in request_ids:
            stream = self._requests.get(rid)
            if stream is not None:
                stream.fail(EngineDeadError(f"the engine died: engine replica {rank}: {reason}"))
        if self.metrics is not None:
            self.metrics.observe_engine_stopped(rank)
        if self.on_replica_dead is not None and not self._stopping:
            try:
                self.on_replica_dead(rank, reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_replica_dead callback failed")

    def _on_dead(self, client: EngineClient, reason: str) -> None:
        if client is not self.client:
            return  # a replaced engine
        self.fail_all(EngineDeadError(f"the engine died: {reason}"))
        if self.restarting:
            return  # a replacement died while starting: restart() raises, and its caller counts the attempt
        if self.metrics is not None:
            for rank in range(self.data_parallel_size):
                self.metrics.observe_engine_stopped(rank)
        if self.on_engine_dead is not None and not self._stopping:
            try:
                self.on_engine_dead(reason)
            except Exception:  # noqa: BLE001
                logger.exception("on_engine_dead callback failed")

    def _on_outputs(self, msg: ipc.StepOutputs) -> None:
        now = time.time()
        if self.metrics is not None:
            self.metrics.observe_iteration(msg.num_step_tokens)
        stats = msg.stats or _STOPPED
        self.load.observe_step(msg.timestamp, sum(len(o.new_token_ids) for o in msg.outputs), msg.num_step_tokens,
                               stats.num_running, busy_after=bool(stats.num_running or stats.num_waiting))
        errors: dict[str, str] = {}
        outputs: list[EngineCoreOutput] = []
        for o in msg.outputs:
            stream = self._requests.get(o.request_id)
            if stream is None:
                continue  # aborted meanwhile
            outputs.append(o)
            if o.error:
                errors[o.request_id] = o.error
            first = stream.first_token is None
            gap = stream.observe(o, now)
            if first and stream.first_token is not None:
                self.events.first_token(stream, now)
            elif gap is not None:
                self.events.token_gap(gap)
        if not outputs:
            return
        assert self.output_processor is not None
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        for ro in request_outputs:
            stream = self._requests.get(ro.request_id)
            if stream is None:
                continue
            if ro.finished and ro.request_id not in errors and any(o.finish_reason == "error" for o in ro.outputs):
                # Not an OpenAI finish reason: the engine could not continue a sequence (e.g. its output
                # constraint allowed no token). The request fails with the engine error (500).
                errors[ro.request_id] = "the engine could not continue the generation (its output constraint " \
                                        "allowed no further token)"
            if ro.request_id in errors:
                stream.fail(RequestFailedError(errors[ro.request_id]))
                stream.finished = True
                self._requests.pop(ro.request_id, None)
                self.events.failed(stream, errors[ro.request_id], now)
                continue
            stream.put(ro)
            if ro.finished:
                stream.finished = True
                self._requests.pop(ro.request_id, None)
                self.events.finished(stream, ro, now)
        if to_abort:
            self._spawn(self.client.abort_requests(list(to_abort)))
