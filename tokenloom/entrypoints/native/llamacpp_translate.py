"""llama-server's /completion <-> an OpenAI completion, and its /props (pure functions).

Request: ``n_predict`` -> ``max_tokens`` (-1, -2 and 0: no limit beyond the context), ``repeat_penalty``
-> ``repetition_penalty``, ``seed: -1`` -> a random seed, ``grammar`` (GBNF) -> ``guided_grammar``,
``json_schema`` -> a JSON-schema response format; both go through the same structured outputs as /v1.

Answer: ``content``, ``stop``, ``stop_type`` (``eos``: the model ended, ``word``: a stop string, named in
``stopping_word``, ``limit``: ``n_predict`` reached), ``tokens_predicted``, ``tokens_evaluated`` and
``timings`` in milliseconds, as llama-server reports them. A stream is SSE ``data: {...}`` lines, the last
one the whole final object; llama-server sends no ``[DONE]`` there.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from pydantic import ValidationError

from tokenloom.core.json_types import JsonObject
from tokenloom.engine.generation_defaults import GenerationDefaults
from tokenloom.entrypoints.native.llamacpp_protocol import LlamaCppCompletionRequest
from tokenloom.entrypoints.native.relay import GenerationTimer, StreamTotals, collect, text_deltas
from tokenloom.entrypoints.openai.errors import ServerError, validation_error_to_api_error
from tokenloom.entrypoints.openai.protocol import CompletionRequest
from tokenloom.entrypoints.openai.streaming import sse

# llama-server field -> the OpenAI / vLLM completion field it sets.
_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
           "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "stop": "stop", "ignore_eos": "ignore_eos",
           "grammar": "guided_grammar"}


def completion_request(request: LlamaCppCompletionRequest, model: str) -> CompletionRequest:
    """/completion -> /v1/completions (400 as /v1 answers it for a bad value)."""
    # Streamed from the handler either way (see relay.py); usage for the final counts.
    body: JsonObject = {"model": model, "prompt": request.prompt, "stream": True,
                        "stream_options": {"include_usage": True}}
    for name, field in _FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            body[field] = value
    if not request.stop:
        body.pop("stop", None)
    if request.n_predict > 0:
        body["max_tokens"] = request.n_predict
    if request.seed is not None and request.seed >= 0:
        body["seed"] = request.seed
    if request.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema",
                                                                          "schema": request.json_schema}}
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_api_error(list(e.errors())) from None


def stop_type(finish_reason: str | None, stop_reason: str | int | None) -> tuple[str, str]:
    """(stop_type, stopping_word) as llama-server names why generation ended."""
    if finish_reason == "length":
        return "limit", ""
    if finish_reason == "stop":
        return ("word", stop_reason) if isinstance(stop_reason, str) else ("eos", "")
    return "none", ""


def timings(prompt_tokens: int, completion_tokens: int, timer: GenerationTimer) -> JsonObject:
    prompt_ms, predicted_ms = timer.prompt_ns / 1e6, timer.generation_ns / 1e6

    def rates(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (n * 1000.0 / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = rates(prompt_tokens, prompt_ms)
    predicted_per_token, predicted_per_second = rates(completion_tokens, predicted_ms)
    return {"prompt_n": prompt_tokens, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_per_token,
            "prompt_per_second": prompt_per_second, "predicted_n": completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second}


def final_answer(content: str, model: str, prompt: str, finish_reason: str | None, stop_reason: str | int | None,
                 prompt_tokens: int, completion_tokens: int, timer: GenerationTimer) -> JsonObject:
    """The object llama-server answers a whole completion with (and ends a stream with, content "")."""
    kind, word = stop_type(finish_reason, stop_reason)
    return {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": model,
            "tokens_predicted": completion_tokens, "tokens_evaluated": prompt_tokens, "prompt": prompt,
            "has_new_line": "\n" in content, "truncated": False, "stop_type": kind, "stopping_word": word,
            "tokens_cached": prompt_tokens + completion_tokens,
            "timings": timings(prompt_tokens, completion_tokens, timer)}


async def completion_answer(events: AsyncIterator[JsonObject], model: str, prompt: str,
                            timer: GenerationTimer) -> JsonObject:
    """An OpenAI completion stream -> /completion's one answer (an error raises it, for the error shape)."""
    totals = StreamTotals()
    whole = await collect(events, totals, timer)
    if totals.error is not None:
        raise ServerError(totals.error, code="engine_error")
    return final_answer(whole.text, model, prompt, totals.finish_reason, totals.stop_reason, totals.prompt_tokens,
                        totals.completion_tokens, timer)


async def completion_stream(events: AsyncIterator[JsonObject], model: str, prompt: str,
                            timer: GenerationTimer) -> AsyncIterator[str]:
    """An OpenAI completion stream (with usage) -> /completion's SSE events."""
    totals = StreamTotals()
    async for delta in text_deltas(events, totals, timer):
        yield sse({"index": 0, "content": delta.text, "tokens": [], "stop": False, "id_slot": 0})
    if totals.error is not None:
        yield sse({"error": {"code": 500, "message": totals.error, "type": "server_error"}})
        return
    yield sse(final_answer("", model, prompt, totals.finish_reason, totals.stop_reason, totals.prompt_tokens,
                           totals.completion_tokens, timer))


def props(model: str, model_path: str, n_ctx: int, total_slots: int, chat_template: str,
          defaults: GenerationDefaults, build_info: str) -> JsonObject:
    """/props: what llama-server reports about itself, from the served model and its defaults."""
    params: JsonObject = {"n_predict": -1, "temperature": defaults.get("temperature", 1.0),
                          "top_k": defaults.get("top_k", 0), "top_p": defaults.get("top_p", 1.0),
                          "min_p": defaults.get("min_p", 0.0),
                          "repeat_penalty": defaults.get("repetition_penalty", 1.0), "presence_penalty": 0.0,
                          "frequency_penalty": 0.0, "seed": -1, "stop": [], "ignore_eos": False,
                          "stream": False, "grammar": "", "n_probs": 0}
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": n_ctx, "model": model,
                                            "is_processing": False, "params": params},
            "total_slots": total_slots, "model_alias": model, "model_path": model_path, "n_ctx": n_ctx,
            "chat_template": chat_template, "modalities": {"vision": False, "audio": False},
            "build_info": build_info}


def prompt_text(prompt: str | list[int]) -> str:
    """The prompt as the final object echoes it (token prompts as their JSON list)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt)
