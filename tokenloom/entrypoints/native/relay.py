"""Running a translated request through an OpenAI handler and reading its answer back.

The native APIs build an OpenAI request, hand it to the very handler that serves ``/v1`` and read
what it answers: a JSON body, or the SSE events of a stream (read as they are produced, in the same
task: a client that goes away closes the outer stream, which closes the handler's stream, which
aborts the request in the engine). Generations are always streamed from the handler, also when the
native client wants one object (`collect` joins the deltas): only a stream tells when the first token
came, which the native APIs report (prompt evaluation time).

`StreamTotals` gathers what the native APIs report at the end of a stream (finish reason, usage, the
tool calls pieced together from their deltas, an error) and `GenerationTimer` the durations.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.errors import ServerError

OpenAIHandler = Callable[..., Awaitable[Response]]


async def call_openai(handler: OpenAIHandler, request: object,
                      raw_request: Request) -> JsonObject | AsyncIterator[JsonObject] | None:
    """The handler's JSON body, its stream of SSE events, or None when the client went away."""
    response = await handler(request, raw_request)
    if isinstance(response, StreamingResponse):
        return sse_events(response.body_iterator)
    return _json_body(response)


async def stream_openai(handler: OpenAIHandler, request: object, raw_request: Request) -> AsyncIterator[JsonObject]:
    """The SSE events of a streamed request (`request.stream` is set)."""
    result = await call_openai(handler, request, raw_request)
    if result is None or isinstance(result, dict):
        raise ServerError("the OpenAI handler did not stream a streamed request")
    return result


def _json_body(response: Response) -> JsonObject | None:
    if response.status_code == 499:
        return None
    body = json.loads(bytes(response.body))
    if response.status_code >= 400:  # the handlers raise their errors; a body is a bug, not the client's
        raise ServerError(f"unexpected answer {response.status_code} from the OpenAI handler: {body}")
    return body


async def sse_events(body: AsyncIterator[str | bytes | memoryview]) -> AsyncIterator[JsonObject]:
    """``data: {...}`` events as JSON objects, up to ``[DONE]``; closes `body` when done or closed."""
    buffer = ""
    try:
        async for piece in body:
            buffer += piece if isinstance(piece, str) else bytes(piece).decode("utf-8")
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                for line in event.splitlines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        return
                    yield json.loads(payload)
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


def _now_ns() -> int:
    return time.perf_counter_ns()


@dataclass
class GenerationTimer:
    """Wall-clock marks of one request: arrival, first output (the prompt is evaluated), end."""

    start_ns: int = field(default_factory=_now_ns)
    first_ns: int | None = None
    end_ns: int | None = None

    def first_output(self) -> None:
        if self.first_ns is None:
            self.first_ns = _now_ns()

    def finish(self) -> None:
        self.end_ns = _now_ns()
        if self.first_ns is None:
            self.first_ns = self.end_ns

    @property
    def total_ns(self) -> int:
        return (self.end_ns or _now_ns()) - self.start_ns

    @property
    def prompt_ns(self) -> int:
        return (self.first_ns or self.start_ns) - self.start_ns

    @property
    def generation_ns(self) -> int:
        return (self.end_ns or _now_ns()) - (self.first_ns or self.start_ns)


@dataclass
class StreamTotals:
    """What a stream's deltas add up to, besides its text."""

    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    tool_calls: dict[int, dict[str, str]] = field(default_factory=dict)  # index -> {"name", "arguments"}

    def add_tool_call_delta(self, delta: JsonObject) -> None:
        index = delta.get("index", 0)
        call = self.tool_calls.setdefault(index if isinstance(index, int) else 0, {"name": "", "arguments": ""})
        fn = delta.get("function")
        if isinstance(fn, dict):
            if isinstance(fn.get("name"), str):
                call["name"] += fn["name"]
            if isinstance(fn.get("arguments"), str):
                call["arguments"] += fn["arguments"]

    def add_usage(self, usage: JsonValue) -> None:
        if isinstance(usage, dict):
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)


@dataclass
class TextDelta:
    text: str
    thinking: str = ""


async def text_deltas(events: AsyncIterator[JsonObject], totals: StreamTotals,
                      timer: GenerationTimer) -> AsyncIterator[TextDelta]:
    """The new text (and reasoning) of each chunk of a one-choice chat or completion stream; the rest goes
    to `totals`. An error event ends the deltas with ``totals.error`` set."""
    try:
        async for event in events:
            error = event.get("error")
            if isinstance(error, dict):
                totals.error = str(error.get("message") or "the request failed")
                return
            totals.add_usage(event.get("usage"))
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict):
                    continue
                timer.first_output()
                delta = choice.get("delta")
                if isinstance(delta, dict):  # chat
                    for call in delta.get("tool_calls") or ():
                        if isinstance(call, dict):
                            totals.add_tool_call_delta(call)
                    text, thinking = delta.get("content"), delta.get("reasoning_content")
                else:  # completion
                    text, thinking = choice.get("text"), None
                if text or thinking:
                    yield TextDelta(text if isinstance(text, str) else "",
                                    thinking if isinstance(thinking, str) else "")
                if choice.get("finish_reason") is not None:
                    totals.finish_reason = str(choice["finish_reason"])
                    stop_reason = choice.get("stop_reason")
                    totals.stop_reason = stop_reason if isinstance(stop_reason, (str, int)) else None
    finally:
        timer.finish()
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


async def collect(events: AsyncIterator[JsonObject], totals: StreamTotals, timer: GenerationTimer) -> TextDelta:
    """The whole text (and reasoning) of a stream; the rest goes to `totals`."""
    text: list[str] = []
    thinking: list[str] = []
    async for delta in text_deltas(events, totals, timer):
        text.append(delta.text)
        thinking.append(delta.thinking)
    return TextDelta("".join(text), "".join(thinking))
