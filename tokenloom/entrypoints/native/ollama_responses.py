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
from tokenloom.entrypoints.native.relay import GenerationTimer, StreamTotals, text_deltas


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

def chat_answer(body: JsonObject, model: str, timer: GenerationTimer) -> JsonObject:
    """A chat.completion -> /api/chat's one object."""
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    m = choice.get("message") or {}
    calls = [tool_call(c["function"]["name"], c["function"].get("arguments") or "")
             for c in m.get("tool_calls") or ()]
    timer.finish()
    return {"model": model, "created_at": created_at(),
            "message": message(m.get("content") or "", m.get("reasoning_content") or "", calls),
            **final_fields(choice.get("finish_reason"), usage.get("prompt_tokens", 0),
                           usage.get("completion_tokens", 0), timer)}


def generate_answer(body: JsonObject, model: str, timer: GenerationTimer) -> JsonObject:
    """A chat.completion or text_completion -> /api/generate's one object."""
    choice = body["choices"][0]
    usage = body.get("usage") or {}
    m = choice.get("message")
    text = (m.get("content") or "") if isinstance(m, dict) else (choice.get("text") or "")
    out: JsonObject = {"model": model, "created_at": created_at(), "response": text}
    if isinstance(m, dict) and m.get("reasoning_content"):
        out["thinking"] = m["reasoning_content"]
    timer.finish()
    return {**out, **final_fields(choice.get("finish_reason"), usage.get("prompt_tokens", 0),
                                  usage.get("completion_tokens", 0), timer)}


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
        calls: list[JsonValue] = [tool_call(c["name"], c["arguments"]) for _, c in sorted(totals.tool_calls.items())]
        yield ndjson({"model": model, "created_at": created_at(), "message": message("", "", calls), "done": False})
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
