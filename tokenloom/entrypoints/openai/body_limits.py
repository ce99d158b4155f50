"""Limits a JSON request body must meet before it is parsed, checked on its measured shape (body_shape.py).

The body guard runs `check_body` on every JSON body, in a worker thread when it is over
`OFF_LOOP_BYTES` (the numpy passes release the GIL), so a hostile body costs other clients
nothing while it is measured and refused. What passes here is bounded in what the parser and
pydantic then spend on it:

* UTF-8 text, nested at most `MAX_JSON_DEPTH` deep;
* at most `MAX_JSON_VALUES` JSON values in all: parsing and validating is ~1.5 µs per value on
  2 shared cores (2026-12-02: `json.loads` 1.25 s + validation 0.7 s for 1.6M values), each step
  one call that holds the GIL, so the cap keeps the longest one near 100 ms under load (~25 ms on
  an idle core). It holds two context-length prompts of token ids (2 x 65,536);
* at most `MAX_MEASURED_FIELDS` top-level fields (no API has that many);
* per-field caps (`FIELD_LIMITS`) on what feeds expensive work: structured-output specs and tools
  (compiled to grammars), chat_template_kwargs (rendered by the template); the exact limits on the
  parsed values (limits.py) still apply after, these only stop a 15 MB spec before its parse;
* no lone UTF-16 surrogate anywhere, keys included (a rare case: only then is the body parsed
  here, to name where it is).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from tokenloom.entrypoints.openai.body_shape import MAX_MEASURED_FIELDS, BodyShape, measure
from tokenloom.entrypoints.openai.limits import MAX_JSON_DEPTH, MAX_SCHEMA_BYTES, lone_surrogate

# Bodies over this are measured in a worker thread; smaller ones take ~1 ms, less than the hand-off.
OFF_LOOP_BYTES = 64 * 1024
MAX_JSON_VALUES = 131_072
# Room for an indented spec: the compact size is held to MAX_SCHEMA_BYTES after the parse.
MAX_SPEC_RAW_BYTES = 4 * MAX_SCHEMA_BYTES
MAX_TEMPLATE_KWARGS_BYTES = 1024 * 1024  # room for RAG "documents"
MAX_TEMPLATE_KWARGS_KEYS = 256
MAX_TEMPLATE_KWARGS_VALUES = 16_384


@dataclass(frozen=True)
class FieldLimit:
    max_bytes: int
    max_values: int = MAX_JSON_VALUES
    max_keys: int = MAX_JSON_VALUES


@dataclass(frozen=True)
class Refusal:
    """A 400 in the API's error shape."""

    message: str
    param: str | None
    code: str


_SPEC = FieldLimit(max_bytes=MAX_SPEC_RAW_BYTES)
# By top-level field name, in every JSON API that has the field (OpenAI's, vLLM's, llama.cpp's, Ollama's).
FIELD_LIMITS: dict[str, FieldLimit] = {
    **{name: _SPEC for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                "guided_choice", "guided_grammar", "structural_tag", "json_schema", "grammar",
                                "tools", "functions", "format")},
    "chat_template_kwargs": FieldLimit(max_bytes=MAX_TEMPLATE_KWARGS_BYTES, max_values=MAX_TEMPLATE_KWARGS_VALUES,
                                       max_keys=MAX_TEMPLATE_KWARGS_KEYS),
}

# What the fast path (`_plainly_within_limits`) compares counts with; it needs no byte check, as every
# field's byte limit is above OFF_LOOP_BYTES (a unit test holds it so).
_SMALLEST_COUNT_LIMIT = min(MAX_MEASURED_FIELDS, *(min(f.max_values, f.max_keys) for f in FIELD_LIMITS.values()))


def check_body(body: bytes) -> Refusal | None:
    """Why this JSON body is refused before parsing, or None."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return Refusal(f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_json")
    if _plainly_within_limits(body):
        return None
    shape = measure(body)
    if shape.depth > MAX_JSON_DEPTH:
        return Refusal(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", None, "nesting_too_deep")
    if shape.num_fields > MAX_MEASURED_FIELDS:
        return Refusal(f"request body has {shape.num_fields} top-level fields; the limit is {MAX_MEASURED_FIELDS}",
                       None, "request_too_large")
    refusal = _field_refusal(shape)  # first: a refusal that names the field
    if refusal is not None:
        return refusal
    if shape.values > MAX_JSON_VALUES:
        return Refusal(f"request body has {shape.values} JSON values; the limit is {MAX_JSON_VALUES}", None,
                       "request_too_large")
    return _surrogate_refusal(body) if shape.lone_surrogate else None


def _plainly_within_limits(body: bytes) -> bool:
    """True when counting brackets, commas and colons (upper bounds of depth, values and keys) already shows
    every limit met: most requests, which then skip the numpy passes (~1 ms of fixed cost on a small body)."""
    if len(body) > OFF_LOOP_BYTES or b"\\ud" in body or b"\\uD" in body:
        return False
    opens = body.count(b"[") + body.count(b"{")
    return opens <= MAX_JSON_DEPTH and opens + body.count(b",") + body.count(b":") < _SMALLEST_COUNT_LIMIT


def _field_refusal(shape: BodyShape) -> Refusal | None:
    for field in shape.fields:
        limit = FIELD_LIMITS.get(field.name)
        if limit is None:
            continue
        for what, size, most in (("bytes", field.nbytes, limit.max_bytes), ("JSON values", field.values,
                                 limit.max_values), ("keys", field.keys, limit.max_keys)):
            if size > most:
                return Refusal(f"{field.name}: {size} {what}; the limit is {most}", field.name, "request_too_large")
    return None


def _surrogate_refusal(body: bytes) -> Refusal | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None  # the parser answers it
    found = lone_surrogate(value)
    if found is None:
        return None
    path, in_key = found
    where = f"{path}: a key" if in_key and path else ("a top-level key" if in_key else f"{path}: the string")
    return Refusal(f"{where} contains a lone UTF-16 surrogate (not valid Unicode text)", path, "invalid_value")
