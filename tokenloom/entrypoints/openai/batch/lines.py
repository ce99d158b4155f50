"""The batch JSONL format, both ways: checking an input line, and writing an output line.

Input (OpenAI's and vLLM's): one JSON object a line, ``{"custom_id", "method": "POST", "url", "body"}``.
A line that breaks the format is not fatal: it becomes a `LineError` and is answered with an error line,
so one bad line never costs the rest of the batch. Blank lines are skipped (a trailing newline is common).

Output: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error"}``; a
request the handler answered (even with a 4xx) has a `response`; a line that could not be sent at all has
``"response": null`` and ``"error": {"code", "message"}``.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from tokenloom.core.json_types import JsonObject, JsonValue
from tokenloom.entrypoints.openai.batch.endpoints import HandlerAnswer

# Longest custom_id accepted (OpenAI documents none; this keeps stored ids small).
MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    index: int
    custom_id: str
    url: str
    body: JsonObject


@dataclass(frozen=True)
class LineError:
    index: int
    custom_id: str | None
    code: str
    message: str


def split_lines(content: bytes) -> list[bytes]:
    """The non-blank lines of a JSONL file (\\n or \\r\\n endings)."""
    return [line for line in content.split(b"\n") if line.strip()]


def parse_line(raw: bytes, index: int, *, urls: frozenset[str] | set[str], max_line_bytes: int,
               endpoint: str | None = None) -> BatchLine | LineError:
    """Check one input line: size, JSON, the four fields, a supported url (and `endpoint`, the batch's, when
    given: OpenAI's batches hold one endpoint's requests)."""
    def bad(code: str, message: str, custom_id: str | None = None) -> LineError:
        return LineError(index, custom_id, code, f"line {index + 1}: {message}")

    if len(raw) > max_line_bytes:
        return bad("line_too_long", f"the line has {len(raw)} bytes; the limit is {max_line_bytes}")
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as e:
        return bad("invalid_json", f"not valid JSON ({e})")
    if not isinstance(obj, dict):
        return bad("invalid_json", "a line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("missing_custom_id", "custom_id must be a non-empty string")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return bad("invalid_custom_id", f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters")
    method = obj.get("method", "POST")
    if method != "POST":
        return bad("invalid_method", f"method must be POST, got {method!r}", custom_id)
    url = obj.get("url")
    if not isinstance(url, str) or url not in urls:
        return bad("invalid_url", f"url must be one of {', '.join(sorted(urls))}, got {url!r}", custom_id)
    if endpoint is not None and url != endpoint:
        return bad("mismatched_url", f"url {url!r} differs from the batch's endpoint {endpoint!r}", custom_id)
    body = obj.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "body must be a JSON object", custom_id)
    return BatchLine(index, custom_id, url, body)


def parse_lines(lines: list[bytes], *, urls: frozenset[str] | set[str], max_line_bytes: int,
                endpoint: str | None = None) -> list[BatchLine | LineError]:
    """Every line checked; a custom_id seen before makes its later lines errors (results are matched by it)."""
    seen: set[str] = set()
    out: list[BatchLine | LineError] = []
    for i, raw in enumerate(lines):
        item = parse_line(raw, i, urls=urls, max_line_bytes=max_line_bytes, endpoint=endpoint)
        if isinstance(item, BatchLine):
            if item.custom_id in seen:
                item = LineError(i, item.custom_id, "duplicate_custom_id",
                                 f"line {i + 1}: custom_id {item.custom_id!r} is used by an earlier line")
            else:
                seen.add(item.custom_id)
        out.append(item)
    return out


def _line_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def answer_line(line: BatchLine, answer: HandlerAnswer) -> JsonObject:
    """The output line of a request the handler answered (a 4xx or 5xx included: that is its response)."""
    body = answer.body
    request_id = body.get("id") if isinstance(body.get("id"), str) else None
    response: JsonValue = {"status_code": answer.status_code, "request_id": request_id or _line_id(), "body": body}
    return {"id": _line_id(), "custom_id": line.custom_id, "response": response, "error": None}


def error_line(error: LineError) -> JsonObject:
    """The output line of a line that could not be sent."""
    return {"id": _line_id(), "custom_id": error.custom_id, "response": None,
            "error": {"code": error.code, "message": error.message}}


def line_succeeded(output: JsonObject) -> bool:
    """OpenAI's split: answered with a 2xx goes to the output file, anything else to the error file."""
    response = output.get("response")
    return isinstance(response, dict) and output.get("error") is None \
        and isinstance(response.get("status_code"), int) and 200 <= int(response["status_code"]) < 300


def dumps(output: JsonObject) -> str:
    return json.dumps(output, ensure_ascii=False, separators=(",", ":"))
