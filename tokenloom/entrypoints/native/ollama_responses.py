"""OpenAI answers -> Ollama's (the pure half of the Ollama API that shapes what goes back).

Ollama streams by default: newline-delimited JSON objects, each ``{"model", "created_at", "message":
{"role", "content"}, "done": false}`` (/api/chat) or ``{..., "response", "done": false}``
(/api/generate), then one ``"done": true`` object with ``done_reason`` and the counts and durations
(nanoseconds). Tool calls go out in one object of their own before it, their arguments as JSON
objects. An error after the stream started is a last ``{"error": "..."}`` line, as Ollama sends it.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.native.relay import GenerationTimer, StreamTotals, TextDelta, collect, text_deltas
from tokenloom.entrypoints.openai.errors import ServerError


def created_at() -> str:
    """RFC 3339 in UTC, as Ollama writes its timestamps."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ndjson(body: JsonObject) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n"


def done_reason(finish_reason: str | None) -> str:
    """Ollama knows ``stop`` and ``length`` (a tool call is a stop)."""
    return "length" if finish_reason == "length" else "stop"


def final_fields(finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                 timer: GenerationTimer) -> JsonObject:
    """The ``done: true`` object's fields (the model is always loaded: its load takes no time)."""
    return {"done": True, "done_reason": done_reason(finish_reason), "total_duration": timer.total_ns,
            "load_duration": 0, "prompt_eval_count": prompt_tokens, "prompt_eval_duration": timer.prompt_ns,
            "eval_count": completion_tokens, "eval_duration": timer.generation_ns}


def tool_call(name: str, arguments: str) -> JsonObject:
    """One call in Ollama's shape: arguments as an object (text that is no JSON object stays under
    ``arguments``, so nothing the model wrote is lost)."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    args: JsonValue = parsed if isinstance(parsed, dict) else {"arguments": arguments}
    return {"function": {"name": name, "arguments": args}}


def message(content: str, thinking: str = "", tool_calls: list[JsonValue] | None = None) -> JsonObject:
    out: JsonObject = {"role": "assistant", "content": content}
    if thinking:
        out["thinking"] = thinking
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def load_answer(model: str, chat: bool) -> JsonObject:
    """What Ollama answers a request with nothing to generate (it loads the model): done at once."""
    body: JsonObject = {"model": model, "created_at": created_at()}
    body.update({"message": message("")} if chat else {"response": ""})
    return {**body, "done": True, "done_reason": "load"}


# ------------------------------------------------------------------ whole answers

def _calls(totals: StreamTotals) -> list[JsonValue]:
    return [tool_call(c["name"], c["arguments"]) for _, c in sorted(totals.tool_calls.items())]


async def _collect(events: AsyncIterator[JsonObject], totals: StreamTotals, timer: GenerationTimer) -> TextDelta:
    whole = await collect(events, totals, timer)
    if totals.error is not None:
        raise ServerError(totals.error, code="engine_error")
    return whole


async def chat_answer(events: AsyncIterator[JsonObject], model: str, timer: GenerationTimer) -> JsonObject:
    """An OpenAI chat stream -> /api/chat's one object (an error raises it, for the error shape)."""
    totals = StreamTotals()
    whole = await _collect(events, totals, timer)
    return {"model": model, "created_at": created_at(), "message": message(whole.text, whole.thinking, _calls(totals)),
            **final_fields(totals.finish_reason, totals.prompt_tokens, totals.completion_tokens, timer)}


async def generate_answer(events: AsyncIterator[JsonObject], model: str, timer: GenerationTimer) -> JsonObject:
    """An OpenAI chat or completion stream -> /api/generate's one object."""
    totals = StreamTotals()
    whole = await _collect(events, totals, timer)
    out: JsonObject = {"model": model, "created_at": created_at(), "response": whole.text}
    if whole.thinking:
        out["thinking"] = whole.thinking
    return {**out, **final_fields(totals.finish_reason, totals.prompt_tokens, totals.completion_tokens, timer)}


# ------------------------------------------------------------------ streams

async def chat_stream(events: AsyncIterator[JsonObject], model: str, timer: GenerationTimer) -> AsyncIterator[str]:
    """An OpenAI chat stream (with usage) -> /api/chat's NDJSON lines."""
    totals = StreamTotals()
    async for delta in text_deltas(events, totals, timer):
        yield ndjson({"model": model, "created_at": created_at(), "message": message(delta.text, delta.thinking),
                      "done": False})
    if totals.error is not None:
        yield ndjson({"error": totals.error})
        return
    if totals.tool_calls:
        yield ndjson({"model": model, "created_at": created_at(), "message": message("", "", _calls(totals)),
                      "done": False})
    yield ndjson({"model": model, "created_at": created_at(), "message": message(""),
                  **final_fields(totals.finish_reason, totals.prompt_tokens, totals.completion_tokens, timer)})


async def generate_stream(events: AsyncIterator[JsonObject], model: str,
                          timer: GenerationTimer) -> AsyncIterator[str]:
    """An OpenAI chat or completion stream (with usage) -> /api/generate's NDJSON lines."""
    totals = StreamTotals()
    async for delta in text_deltas(events, totals, timer):
        line: JsonObject = {"model": model, "created_at": created_at(), "response": delta.text, "done": False}
        if delta.thinking:
            line["thinking"] = delta.thinking
        yield ndjson(line)
    if totals.error is not None:
        yield ndjson({"error": totals.error})
        return
    yield ndjson({"model": model, "created_at": created_at(), "response": "",
                  **final_fields(totals.finish_reason, totals.prompt_tokens, totals.completion_tokens, timer)})


def embed_answer(body: JsonObject, model: str, timer: GenerationTimer) -> JsonObject:
    """An embedding list -> /api/embed's ``embeddings``."""
    timer.finish()
    data = sorted(body.get("data") or (), key=lambda d: d["index"])
    return {"model": model, "embeddings": [d["embedding"] for d in data], "total_duration": timer.total_ns,
            "load_duration": 0, "prompt_eval_count": (body.get("usage") or {}).get("prompt_tokens", 0)}
