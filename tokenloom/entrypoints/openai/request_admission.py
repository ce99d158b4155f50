"""Admission at the door: each generation request is admitted or refused (503 + Retry-After) at once, before it
is tokenized, and what it was admitted for is reserved until the engine takes it over.

The decision is admission.py's (`decide`); this module estimates a request's cost from its body, reads the
engine's load, and keeps the reservation for the length of the HTTP request (`AdmissionMiddleware`).
"""
from __future__ import annotations

from contextvars import ContextVar
from typing import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenloom.engine.admission import Reservation
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.load_estimator import PROMPT_TOKEN_WEIGHT
from tokenloom.entrypoints.openai.admission import UNSET_MAX_TOKENS_ESTIMATE, Arrival, EngineLoad, Limits, decide
from tokenloom.entrypoints.openai.errors import ServiceUnavailableError
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.server_state import ServerState

# Characters per token assumed when estimating a prompt's size before it is tokenized.
CHARS_PER_TOKEN_ESTIMATE = 4

# Set per HTTP request by AdmissionMiddleware: admit() keeps there the engine work it reserved, and
# the middleware drops what the engine did not take over when the response ends. Admission counts
# the engine's open requests plus these reservations: a response still being sent to a slow client
# no longer counts once the engine has finished it.
_ADMISSION: ContextVar[list[Reservation] | None] = ContextVar("tokenloom_admission", default=None)


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        holder: list[Reservation] = []
        token = _ADMISSION.set(holder)
        try:
            return await self.app(scope, receive, send)
        finally:
            _ADMISSION.reset(token)
            for reservation in holder:
                reservation.release()
            holder.clear()


def current_reservation() -> Reservation | None:
    """This HTTP request's admission reservation (None outside the server's middleware)."""
    holder = _ADMISSION.get()
    return holder[-1] if holder else None


def estimate_arrival(request: ChatCompletionRequest | CompletionRequest, width: int,
                     prompts: list[str | list[int] | None], max_model_len: int) -> Arrival:
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
    ctx = int(max_model_len or 0)
    per_seq = max_tokens
    if max_tokens is None:
        max_tokens = max(1, ctx - prompt_tokens // max(1, len(prompts))) if ctx else 256
        per_seq = min(max_tokens, UNSET_MAX_TOKENS_ESTIMATE)
    seqs = width * len(prompts)
    return Arrival(seqs=seqs, tokens_per_seq=per_seq, work=seqs * max_tokens + prompt_tokens * PROMPT_TOKEN_WEIGHT,
                   timeout=request.timeout)


def admit_arrival(engine: AsyncLLM, state: ServerState, arrival: Arrival, rejected: Callable[[str], None]) -> None:
    """503 + Retry-After now if `arrival` is refused (`rejected(reason)` counts it); else reserve its work until
    the engine takes it over."""
    load = EngineLoad(inflight_seqs=engine.num_inflight_seqs + engine.reserved.seqs,
                      engine_waiting=engine.engine_stats.num_waiting,
                      slots=int(engine.config.scheduler.max_num_seqs), queued_work=engine.queued_work)
    limits = Limits(max_expected_latency=state.max_expected_latency, max_queue_wait=state.max_queue_wait,
                    max_waiting_requests=state.max_waiting_requests)
    refusal = decide(arrival, load, engine.load, limits, mean_latency=engine.mean_latency or 1.0)
    if refusal is not None:
        rejected(refusal.reason)
        raise ServiceUnavailableError(f"{refusal.message}; retry after {refusal.retry_after} s",
                                      code="server_overloaded", headers={"Retry-After": str(refusal.retry_after)})
    holder = _ADMISSION.get()
    if holder is not None:
        holder.append(engine.reserve(arrival.seqs, arrival.work))
