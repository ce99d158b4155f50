"""What /v1/chat/completions and /v1/completions share.

* model name check (404), request ids, the request -> SamplingParams mapping with the
  server-side defaults (the model's generation_config.json), input errors -> 400;
* usage, logprob formatting, SSE framing;
* running a non-streamed handler so that a client disconnect cancels it (and thereby
  aborts the request in the engine), and a StreamingResponse that always watches for
  the disconnect.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextvars import ContextVar
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from starlette.responses import StreamingResponse

from tokenloom.core.sampling_params import SamplingParams, SamplingParamsError
from tokenloom.engine.async_llm import (
    AsyncLLM,
    DuplicateRequestIdError,
    EngineDeadError,
    RequestFailedError,
    RequestTimeoutError,
)
from tokenloom.engine.dp_client import ReplicaUnavailableError
from tokenloom.engine.load_estimator import PROMPT_TOKEN_WEIGHT
from tokenloom.entrypoints.openai.admission import UNSET_MAX_TOKENS_ESTIMATE, Arrival, EngineLoad, Limits, decide
from tokenloom.entrypoints.openai.errors import (
    APIError,
    BadRequestError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
    error_body,
)
from tokenloom.entrypoints.openai.protocol import SamplingFields
from tokenloom.outputs import CompletionOutput, PositionLogprobs, RequestOutput

logger = logging.getLogger("tokenloom.server")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ServerShuttingDownError(RuntimeError):
    """In-flight requests still open when the shutdown timeout ran out."""


DEFAULT_MAX_WAITING_REQUESTS = 256
# Default --max-expected-latency: the issue-21 flood (400 concurrent 64-token requests, client timeout 180 s)
# is answered cleanly with a 3x margin for the estimate's error: the machine slowing down after admission,
# the rate guessed (40 tokens/s) before the first steps are measured. Measured: docs/performance.md, "Overload".
DEFAULT_MAX_EXPECTED_LATENCY = 60.0
# Default --max-queue-wait: off; the expected latency above includes the wait.
DEFAULT_MAX_QUEUE_WAIT = 0.0
# Default --stream-write-timeout: a client that has not taken a chunk for this long (its socket
# and our buffers are full) has stalled; its stream ends and its connection closes.
DEFAULT_STREAM_WRITE_TIMEOUT = 30.0
# Characters per token assumed when estimating a prompt's size before it is tokenized.
CHARS_PER_TOKEN_ESTIMATE = 4


class ServerState:
    """Set by the server on shutdown: new requests get 503 while the in-flight ones drain.

    Also the admission settings (see `OpenAIServing.admit`): `max_expected_latency` (seconds a new request
    may be expected to take to complete, None: no limit), `max_queue_wait` (the same for its wait alone),
    the count backstop
    `max_waiting_requests` (sequences waiting for a slot in the running batch), `request_timeout`
    (seconds, None: none) capping every request's time, and `stream_write_timeout`.
    """

    def __init__(self, max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS,
                 request_timeout: float | None = None, trust_request_chat_template: bool = False,
                 max_queue_wait: float | None = DEFAULT_MAX_QUEUE_WAIT,
                 max_expected_latency: float | None = DEFAULT_MAX_EXPECTED_LATENCY,
                 stream_write_timeout: float | None = DEFAULT_STREAM_WRITE_TIMEOUT) -> None:
        self.draining = False
        # Render a chat_template sent with a request (in a limited process); off: such requests get 400.
        self.trust_request_chat_template = trust_request_chat_template
        self.inflight = 0
        self.max_waiting_requests = max_waiting_requests
        self.request_timeout = request_timeout if request_timeout and request_timeout > 0 else None
        self.max_queue_wait = max_queue_wait if max_queue_wait and max_queue_wait > 0 else None
        self.max_expected_latency = max_expected_latency if max_expected_latency and max_expected_latency > 0 \
            else None
        self.stream_write_timeout = stream_write_timeout if stream_write_timeout and stream_write_timeout > 0 \
            else None


# Set per HTTP request by AdmissionMiddleware: admit() keeps there the engine work it reserved, and
# the middleware drops what the engine did not take over when the response ends. Admission counts
# the engine's open requests plus these reservations: a response still being sent to a slow client
# no longer counts once the engine has finished it.
_ADMISSION: ContextVar[list | None] = ContextVar("tokenloom_admission", default=None)


class AdmissionMiddleware:
    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        holder: list = []
        token = _ADMISSION.set(holder)
        try:
            return await self.app(scope, receive, send)
        finally:
            _ADMISSION.reset(token)
            for reservation in holder:
                reservation.release()
            holder.clear()


def engine_error_to_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ServerShuttingDownError):
        return ServiceUnavailableError(str(exc), code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return ServerError(str(exc), code="engine_dead")
    if isinstance(exc, ReplicaUnavailableError):
        return ServiceUnavailableError(str(exc), code="engine_unavailable", headers={"Retry-After": "10"})
    if isinstance(exc, DuplicateRequestIdError):
        return BadRequestError(str(exc), param="request_id", code="duplicate_request_id")
    if isinstance(exc, RequestFailedError):
        return ServerError(f"the engine failed this request: {exc}", code="engine_error")
    if isinstance(exc, RequestTimeoutError):
        return APIError(str(exc), status_code=504, error_type="timeout_error", code="request_timeout")
    return ServerError(f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


class OpenAIServing:
    """Base of the chat and completion handlers."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], state: ServerState | None = None,
                 system_fingerprint: str | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.state = state or ServerState()
        self.system_fingerprint = system_fingerprint or "tokenloom"

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ checks

    def check_request(self, request: SamplingFields) -> None:
        self.check_available()
        self.check_model(request.model)
        if self.engine.pooling is not None:
            raise BadRequestError("this model embeds: it answers /v1/embeddings, not text generation (serve a "
                                  "generative model for completions and chat)", param="model",
                                  code="model_not_generative")
        from tokenloom.entrypoints.openai.limits import check_request_limits, check_text

        check_text(request)
        check_request_limits(request, self.engine.max_model_len)
        self.admit(request)

    def check_available(self) -> None:
        """503 while the server drains or the engine is down or restarting."""
        if self.state.draining:
            raise ServiceUnavailableError("the server is shutting down", code="shutting_down")
        if not self.engine.is_healthy:
            self._rejected("engine_unavailable")
            if getattr(self.engine, "restarting", False):
                raise ServiceUnavailableError("the engine is restarting after a failure; retry shortly",
                                              code="engine_restarting", headers={"Retry-After": "5"})
            raise ServiceUnavailableError(f"the engine is not running: {self.engine.dead_reason}",
                                          code="engine_dead", headers={"Retry-After": "10"})

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist. Available: "
                                f"{', '.join(self.served_model_names)}", param="model", code="model_not_found")

    def _rejected(self, reason: str) -> None:
        if self.engine.metrics is not None:
            self.engine.metrics.observe_rejected(reason)

    def arrival(self, request: SamplingFields, width: int, prompts: list) -> Arrival:
        """What the request will cost the engine, estimated before tokenizing it (decode-equivalent tokens)."""
        max_tokens = getattr(request, "effective_max_tokens", None) or request.max_tokens
        prompt_tokens = 0
        for p in prompts:
            if isinstance(p, list):
                prompt_tokens += len(p)
            elif isinstance(p, str):
                prompt_tokens += len(p) // CHARS_PER_TOKEN_ESTIMATE
        for m in getattr(request, "messages", None) or ():
            text = m.text_content()
            prompt_tokens += len(text or "") // CHARS_PER_TOKEN_ESTIMATE
        ctx = int(self.engine.max_model_len or 0)
        per_seq = max_tokens
        if max_tokens is None:
            max_tokens = max(1, ctx - prompt_tokens // max(1, len(prompts))) if ctx else 256
            per_seq = min(max_tokens, UNSET_MAX_TOKENS_ESTIMATE)
        seqs = width * len(prompts)
        return Arrival(seqs=seqs, tokens_per_seq=per_seq, work=seqs * max_tokens + prompt_tokens * PROMPT_TOKEN_WEIGHT,
                       timeout=getattr(request, "timeout", None))

    def admit(self, request: SamplingFields) -> None:
        """Admission, answered at once: 503 + Retry-After when the request's expected time to complete (its wait
        plus its own decode in the batch it joins) is over --max-expected-latency or its own timeout, its wait
        over --max-queue-wait, or too many sequences already wait (see `admission.decide`)."""
        width = max(request.n or 1, getattr(request, "best_of", None) or 1)
        max_n = getattr(getattr(self.engine.config, "limits", None), "max_n", None)
        if max_n is not None and width > max_n:
            return  # fails validation next, with a 400 naming n / best_of
        prompts = request.prompts() if hasattr(request, "prompts") else [None]
        self.admit_arrival(self.arrival(request, width, prompts))

    def admit_arrival(self, arrival: Arrival) -> None:
        """503 + Retry-After now if `arrival` is refused; else reserve its work until the engine takes it over."""
        engine = self.engine
        load = EngineLoad(inflight_seqs=engine.num_inflight_seqs + engine.reserved_seqs,
                          engine_waiting=int(engine.engine_stats.get("num_waiting", 0) or 0),
                          slots=int(engine.config.scheduler.max_num_seqs), queued_work=engine.queued_work)
        state = self.state
        limits = Limits(max_expected_latency=state.max_expected_latency, max_queue_wait=state.max_queue_wait,
                        max_waiting_requests=state.max_waiting_requests)
        refusal = decide(arrival, load, engine.load, limits, mean_latency=engine.mean_latency or 1.0)
        if refusal is not None:
            self._rejected(refusal.reason)
            raise ServiceUnavailableError(f"{refusal.message}; retry after {refusal.retry_after} s",
                                          code="server_overloaded", headers={"Retry-After": str(refusal.retry_after)})
        holder = _ADMISSION.get()
        if holder is not None:
            holder.append(engine.reserve(arrival.seqs, arrival.work))

    def reservation(self):
        """This HTTP request's admission reservation (None outside the server's middleware)."""
        holder = _ADMISSION.get()
        return holder[-1] if holder else None

    def timeout_for(self, request: SamplingFields) -> float | None:
        """The request's `timeout` field, capped by the server's --request-timeout."""
        mine = getattr(request, "timeout", None)
        server = self.state.request_timeout
        values = [t for t in (mine, server) if t]
        return min(values) if values else None

    def request_id(self, request: SamplingFields, prefix: str, num_prompts: int = 1) -> str:
        """The client's request_id (400 if it, or one of its per-prompt ids `ID-i`, is in use) or a new one."""
        rid = request.request_id
        if rid:
            taken = [rid] if num_prompts == 1 else [f"{rid}-{i}" for i in range(num_prompts)]
            if self.engine.has_request(rid) or any(self.engine.has_request(r) for r in taken):
                raise BadRequestError(f"request_id {rid!r} is already in use", param="request_id",
                                      code="duplicate_request_id")
            return rid
        return random_id(prefix)

    # ------------------------------------------------------------------ sampling params

    def sampling_params(self, request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                        default_max_tokens: int | None, best_of: int | None = None,
                        echo_logprobs: bool = False) -> SamplingParams:
        defaults = self.engine.default_sampling_params()

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(request, name)
            if value is not None:
                return value
            return defaults.get(name, fallback)

        if max_tokens is None:
            max_tokens = defaults.get("max_tokens", default_max_tokens)
        prompt_logprobs = request.prompt_logprobs
        if echo_logprobs and prompt_logprobs is None:
            prompt_logprobs = logprobs
        kwargs = dict(
            n=request.n if request.n is not None else 1,
            best_of=best_of,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=dict(request.logit_bias) if request.logit_bias else None,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=([request.stop] if isinstance(request.stop, str) else list(request.stop or [])),
            stop_token_ids=list(request.stop_token_ids or []),
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            bad_words=list(request.bad_words or []),
            allowed_token_ids=request.allowed_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            kv_transfer_params=request.kv_transfer_params,
        )
        try:
            return SamplingParams(**kwargs)
        except SamplingParamsError as e:
            raise BadRequestError(str(e), param=getattr(e, "field", None), code="invalid_value") from None
        except (ValueError, TypeError) as e:
            raise BadRequestError(str(e), code="invalid_value") from None

    def process_inputs(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int, cache_salt: str | None, prompt_param: str = "prompt",
                       data_parallel_rank: int | None = None):
        """Tokenize and validate one prompt; input errors become 400 naming the field."""
        from tokenloom.engine.input_processor import RequestValidationError

        try:
            return self.engine.process_inputs(request_id, prompt, params, priority=priority,
                                              arrival_time=time.time(), cache_salt=cache_salt,
                                              data_parallel_rank=data_parallel_rank)
        except RequestValidationError as e:
            param = e.param
            cause = e.__cause__ or e.__context__
            if param is None and isinstance(cause, SamplingParamsError):
                param = cause.field
            if param == "prompt":
                param = prompt_param
            raise BadRequestError(e.message, param=param, code=e.code or "invalid_value") from None
        except SamplingParamsError as e:
            raise BadRequestError(str(e), param=e.field, code="invalid_value") from None

    # ------------------------------------------------------------------ formatting

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def token_str(self, token_id: int, lp: Any = None) -> str:
        if lp is not None and getattr(lp, "decoded_token", None) is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def prompt_logprobs(ro: RequestOutput) -> list | None:
        """vLLM's shape: per prompt position None (the first) or {token_id: {logprob, rank, decoded_token}}."""
        if ro.prompt_logprobs is None:
            return None
        return [None if pos is None else
                {str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                 for tid, lp in pos.items()} for pos in ro.prompt_logprobs]

    def chat_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs], top: int) -> list[dict]:
        content = []
        for tid, pos in zip(token_ids, logprobs):
            chosen = pos.get(tid)
            tok = self.token_str(tid, chosen)
            entry = {"token": tok, "logprob": _finite(chosen.logprob if chosen else float("-inf")),
                     "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
            ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30))
            for alt_id, alt in ranked[:top]:
                alt_tok = self.token_str(alt_id, alt)
                entry["top_logprobs"].append({"token": alt_tok, "logprob": _finite(alt.logprob),
                                              "bytes": list(alt_tok.encode("utf-8"))})
            content.append(entry)
        return content

    def completion_logprobs(self, token_ids: list[int], logprobs: list[PositionLogprobs | None], top: int,
                            text_offset: int = 0) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = text_offset
        for tid, pos in zip(token_ids, logprobs):
            if pos is None:  # first prompt position: no logprob
                tok = self.token_str(tid)
                out["tokens"].append(tok)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                chosen = pos.get(tid)
                tok = self.token_str(tid, chosen)
                out["tokens"].append(tok)
                out["token_logprobs"].append(_finite(chosen.logprob if chosen else float("-inf")))
                ranked = sorted(pos.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30))
                out["top_logprobs"].append({self.token_str(i, lp): _finite(lp.logprob) for i, lp in ranked[:top]})
            out["text_offset"].append(offset)
            offset += len(tok)
        return out


def _finite(x: float) -> float:
    # JSON has no -inf: clamp like other OpenAI-compatible servers do.
    return max(x, -9999.0) if x == x else -9999.0


# ------------------------------------------------------------------ request execution helpers

async def run_cancellable(raw_request: Request, coro: Awaitable[Any]) -> Any:
    """Await `coro`, cancelling it if the client disconnects first (then returns None)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the client is gone; nothing to report to it
        pass
    return None


class StalledClientError(Exception):
    """The client took no chunk of a streamed response for the write timeout."""


class DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams the body while listening for the client's disconnect, whatever the ASGI spec
    version: on disconnect the body iterator is cancelled, which aborts the request. A client
    that takes no chunk for `write_timeout` seconds (it stopped reading) gets the same: the
    stream ends and the connection closes, so it holds no server resources."""

    def __init__(self, *args: Any, write_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_timeout = write_timeout

    async def __call__(self, scope, receive, send) -> None:
        timeout = self.write_timeout

        async def timed_send(message) -> None:
            if timeout is None:
                return await send(message)
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise StalledClientError(f"the client read nothing for {timeout:g} s") from None

        stream_task = asyncio.ensure_future(self.stream_response(timed_send))

        async def wait_disconnect() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        watcher = asyncio.ensure_future(wait_disconnect())
        try:
            done, _ = await asyncio.wait({stream_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            stream_task.cancel()
            watcher.cancel()
            await self._close_body()
            raise
        if watcher in done:
            stream_task.cancel()
            try:
                await stream_task
            except BaseException:  # noqa: BLE001
                pass
            await self._close_body()
            return
        watcher.cancel()
        exc = stream_task.exception()
        if isinstance(exc, StalledClientError):
            logger.warning("ending a stalled stream: %s", exc)
            await self._close_body()  # aborts the request in the engine now, not at garbage collection
            return  # the server closes a connection whose response is incomplete
        stream_task.result()

    async def _close_body(self) -> None:
        close = getattr(self.body_iterator, "aclose", None)
        if close is not None:
            try:
                await close()
            except BaseException:  # noqa: BLE001 - closing only
                pass


def stream_error_chunk(exc: BaseException) -> str:
    err = engine_error_to_api_error(exc)
    body = error_body(err.message, err.error_type, err.param, err.code)
    body["error"]["status_code"] = err.status_code
    return sse(body)


async def merge_generators(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators, yielding (index, item); closes all on exit."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item, None))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, None, e))
            return
        await queue.put((i, done, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                if isinstance(exc, asyncio.CancelledError):
                    raise RuntimeError("a generation was cancelled")
                raise exc
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # Let each cancelled pump unwind its generator (which aborts its request).
        await asyncio.gather(*tasks, return_exceptions=True)


def completion_tokens(ro: RequestOutput) -> int:
    return sum(len(o.token_ids) for o in ro.outputs)


def finish_fields(o: CompletionOutput) -> tuple[str | None, Any]:
    return o.finish_reason, o.stop_reason
