"""One streaming request to an OpenAI-compatible server, timed on the client side.

Works with any server that speaks the OpenAI streaming protocol (server-sent events,
``data: {...}`` lines, ``data: [DONE]`` at the end). It records the time to the first
chunk that carries text (TTFT), the gaps between later text chunks (ITL), the end-to-end
latency, and the token counts from the final ``usage`` chunk that
``stream_options.include_usage`` asks for (a chunk count stands in when a server sends
no usage).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from tokenloom.bench.datasets import BenchPrompt
from tokenloom.core.json_types import JsonObject

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    start: float = 0.0          # seconds since the benchmark started
    ttft: float = 0.0           # seconds
    latency: float = 0.0        # end to end, seconds
    itl: list[float] = field(default_factory=list)  # seconds between text chunks after the first
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    usage_reported: bool = False
    expected_input_len: int = 0
    expected_output_len: int = 0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (seconds); None with fewer than 2 tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def build_payload(endpoint: str, model: str, prompt: BenchPrompt, ignore_eos: bool = False,
                  temperature: float = 0.0, extra_body: dict | None = None) -> JsonObject:
    body: JsonObject = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": temperature, "max_tokens": prompt.output_len}
    if endpoint == "chat":
        body["messages"] = prompt.chat_messages()
    elif endpoint == "completions":
        body["prompt"] = prompt.completion_prompt()
    else:
        raise ValueError(f"unknown endpoint {endpoint!r} (expected one of {', '.join(ENDPOINTS)})")
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


def error_message(status: int, raw: bytes) -> str:
    """A one-line message from an error response in the OpenAI shape (or anything else)."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    msg = None
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
        elif isinstance(err, str):
            msg = err
        if msg is None and isinstance(obj.get("detail"), str):
            msg = obj["detail"]
    msg = msg or text[:300] or "(empty body)"
    return f"HTTP {status}: {msg}"


def chunk_text(chunk: JsonObject) -> str:
    """The text a streamed chunk adds (completions: choices[].text; chat: choices[].delta.content,
    plus reasoning_content where a server streams that separately)."""
    out = []
    for choice in chunk.get("choices") or ():
        if "text" in choice:
            out.append(choice.get("text") or "")
        delta = choice.get("delta") or {}
        out.append(delta.get("content") or "")
        out.append(delta.get("reasoning_content") or "")
    return "".join(out)


async def send_request(client: httpx.AsyncClient, url: str, payload: JsonObject,
                       headers: dict[str, str] | None = None, t0: float | None = None) -> RequestResult:
    """POST ``payload`` (a streaming request) to ``url`` and time it. Never raises for request
    failures: they come back as ``success=False`` with ``error`` set."""
    res = RequestResult()
    start = time.perf_counter()
    res.start = start - (t0 if t0 is not None else start)
    first = last = None
    chunks_with_text = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = error_message(resp.status_code, await resp.aread())
                res.latency = time.perf_counter() - start
                return res
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, ": keep-alive" comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    res.error = f"malformed stream chunk: {data[:200]}"
                    break
                if chunk.get("error"):
                    err = chunk["error"]
                    res.error = "stream error: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
                    break
                if chunk_text(chunk):
                    if first is None:
                        first = now
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks_with_text += 1
                usage = chunk.get("usage")
                if usage:
                    res.usage_reported = True
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end = time.perf_counter()
    res.latency = end - start
    if res.error:
        return res
    if not res.usage_reported:
        res.output_tokens = chunks_with_text
    res.ttft = (first - start) if first is not None else res.latency
    res.success = True
    return res
